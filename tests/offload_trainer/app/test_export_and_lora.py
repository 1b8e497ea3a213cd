"""Export through the libraries' own save_pretrained, and [lora] through PEFT.

A tiny Llama with a tokenizer that has a chat template (built offline, saved with save_pretrained)
and a README is fine-tuned by offload-train and exported in bf16: the export holds every file the
model came with, keeps the chat template, says bf16 in its config and loads as bf16 with the
engine's weights. With [lora], only the adapters change (the base stays bitwise the original,
paged to NVMe), and both exports load back with the engine's logits: merged (a plain model) and
the adapters alone (PeftModel.from_pretrained over the base)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, List, Tuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

import offload_trainer as ot  # noqa: E402
from offload_trainer.app.causal_lm import build_causal_lm  # noqa: E402
from offload_trainer.app.data import BatchStream, load_corpus  # noqa: E402
from offload_trainer.app.run_config import RunConfig  # noqa: E402
from offload_trainer.app.trainer import Trainer, run, train_step  # noqa: E402

from tests.offload_trainer.app.test_data_sources import CHAT_TEMPLATE, make_tokenizer  # noqa: E402


def tiny_llama_with_chat(path: Path, tied: bool = False) -> None:
    config = transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    (path / "README.md").write_text("# a tiny model\n")


def corpus(tmp_path: Path, chat: bool = True) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("hello there, a short text to learn.\n" * 40)
    if chat:
        conversation = {"messages": [{"role": "user", "content": "hi?"}, {"role": "assistant", "content": "hello!"}]}
        (root / "chat.jsonl").write_text((json.dumps(conversation) + "\n") * 20)
    return root


def config(tmp_path: Path, model_dir: Path, **overrides: str) -> RunConfig:
    base = {
        "model.hf_path": str(model_dir), "data.path": str(corpus(tmp_path)), "data.seq_len": "16",
        "data.batch_size": "4", "train.steps": "2", "train.checkpoint_every": "0", "train.eval_batches": "1",
        "train.out_dir": str(tmp_path / "run"), "tiers.nvme_dir": str(tmp_path / "swap"),
    }
    return RunConfig().with_overrides({**base, **overrides})


def restored_weights(cfg: RunConfig, tmp_path: Path, step: int) -> dict:
    cfg = cfg.with_overrides({"tiers.nvme_dir": str(tmp_path / "swap2")})
    lm = build_causal_lm(cfg)
    with ot.initialize(lm.model, cfg.engine_config(), init_fn=lm.init_fn) as engine:
        engine.load_checkpoint(Path(cfg.train.out_dir) / f"ckpt-{step:06d}")
        return engine.full_state_dict()


def test_export_keeps_every_file_the_chat_template_and_the_dtype(tmp_path: Path) -> None:
    model_dir = tmp_path / "llama"
    tiny_llama_with_chat(model_dir)
    cfg = config(tmp_path, model_dir, **{"train.export_dtype": "bf16"})
    summary = run(cfg, progress=False)
    exported = Path(summary.export)
    assert exported == tmp_path / "run" / "hf"
    came_with = {p.name for p in model_dir.iterdir()}
    assert came_with <= {p.name for p in exported.iterdir()}, came_with - {p.name for p in exported.iterdir()}
    assert (exported / "README.md").read_text() == "# a tiny model\n"
    assert transformers.AutoTokenizer.from_pretrained(exported).chat_template == CHAT_TEMPLATE
    assert json.loads((exported / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert reloaded.dtype == torch.bfloat16
    engine_weights = restored_weights(cfg, tmp_path, 2)
    theirs = reloaded.state_dict()
    assert set(theirs) == set(engine_weights)
    assert all(torch.equal(theirs[n], w.to(torch.bfloat16)) for n, w in engine_weights.items())


def lora_run(tmp_path: Path, steps: int = 3):
    """A [lora] model through the engine for `steps` steps, parameters on NVMe; (cfg, lm, engine, before)."""
    pytest.importorskip("peft")
    model_dir = tmp_path / "llama"
    tiny_llama_with_chat(model_dir)
    cfg = config(tmp_path, model_dir, **{
        "lora.rank": "4", "lora.alpha": "8", "lora.target_modules": "q_proj,v_proj", "tiers.params": "nvme",
        "optimizer.lr": "0.05",
    })
    lm = build_causal_lm(cfg)
    engine = ot.initialize(lm.model, cfg.engine_config(), init_fn=lm.init_fn)
    engine.load_safetensors(lm.weight_files)
    before = engine.full_state_dict()
    stream = BatchStream(load_corpus(cfg.data, lm.tokenizer), cfg.data.batch_size, cfg.seed)
    for _ in range(steps):
        train_step(engine, lm, stream, 1)
    return cfg, lm, engine, before, model_dir


def test_lora_trains_only_the_adapters_and_both_exports_load_back(tmp_path: Path) -> None:
    _, lm, engine, before, model_dir = lora_run(tmp_path)
    with engine:
        after = engine.full_state_dict()
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        adapters = {n for n in before if ".lora_A." in n or ".lora_B." in n}
        assert changed == adapters and len(adapters) == 2 * 2 * 2  # q and v, A and B, two layers
        original = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        assert all(torch.equal(after[n], original[lm.lora.base_names[n]]) for n in after if n not in adapters)
        x = torch.randint(0, 48, (2, 12))
        with torch.no_grad():
            ours = engine(x).logits

        merged = lm.export(engine, tmp_path / "merged", "fp32")
        assert merged == tmp_path / "merged" / "hf"
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        with torch.no_grad():
            assert torch.allclose(reloaded(input_ids=x).logits, ours, atol=1e-5, rtol=1e-5)

        lm.export_adapter = True
        adapter = lm.export(engine, tmp_path / "adapter", "fp32")
        assert adapter == tmp_path / "adapter" / "adapter"
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
        import peft

        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        with torch.no_grad():
            theirs = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=x).logits
        assert torch.allclose(theirs, ours, atol=1e-5, rtol=1e-5)


def _train_two_steps_and_export(lm: Any, cfg: Any, x: torch.Tensor, out: Path) -> Tuple[torch.Tensor, Path]:
    """Two steps of `lm` under `cfg` from its weight files, then its logits on `x` and its export to `out`."""
    with ot.initialize(lm.model, cfg.engine_config(), init_fn=lm.init_fn) as engine:
        engine.load_safetensors(lm.weight_files)
        stream = BatchStream(load_corpus(cfg.data, lm.tokenizer), cfg.data.batch_size, cfg.seed)
        for _ in range(2):
            train_step(engine, lm, stream, 1)
        with torch.no_grad():
            ours = engine(x).logits
        return ours, lm.export(engine, out, "fp32")


def test_lora_on_a_model_with_tied_embeddings_loads_trains_and_exports_merged(tmp_path: Path) -> None:
    """The embedding and the head are one tensor under two names: each wrapped name maps back to its own
    base name (by identity alone both mapped to one, and the stored embedding fitted no parameter)."""
    pytest.importorskip("peft")
    model_dir = tmp_path / "llama"
    tiny_llama_with_chat(model_dir, tied=True)
    cfg = config(tmp_path, model_dir, **{"lora.rank": "4", "lora.target_modules": "q_proj,v_proj", "optimizer.lr": "0.05"})
    lm = build_causal_lm(cfg)
    assert lm.lora.base_names["base_model.model.model.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert lm.lora.base_names["base_model.model.lm_head.weight"] == "lm_head.weight"
    x = torch.randint(0, 48, (2, 12))
    ours, merged = _train_two_steps_and_export(lm, cfg, x, tmp_path / "merged")
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert torch.equal(reloaded.model.embed_tokens.weight, original.model.embed_tokens.weight)  # frozen base
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=x).logits, ours, atol=1e-5, rtol=1e-5)


def test_an_adapter_on_a_tied_head_is_refused_for_a_merged_export_and_kept_for_an_adapter_export(tmp_path: Path) -> None:
    """The export stores a tied tensor once: a merged export would have dropped the head's adapter (the
    reloaded model's logits were not the engine's). The adapters alone load back over the base as trained."""
    pytest.importorskip("peft")
    model_dir = tmp_path / "llama"
    tiny_llama_with_chat(model_dir, tied=True)
    lora = {"lora.rank": "4", "lora.target_modules": "lm_head,q_proj", "optimizer.lr": "0.05"}
    cfg = config(tmp_path, model_dir, **lora, **{"lora.export": "adapter"})
    with pytest.raises(ValueError) as info:
        build_causal_lm(cfg.with_overrides({"lora.export": "merged"}))
    message = str(info.value)
    assert "'lm_head', whose weight is tied to 'model.embed_tokens.weight'" in message and "\n" not in message
    assert 'set lora.export = "adapter"' in message

    lm = build_causal_lm(cfg)
    x = torch.randint(0, 48, (2, 12))
    ours, adapter = _train_two_steps_and_export(lm, cfg, x, tmp_path / "out")
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=x).logits
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=1e-5)


def test_lora_on_the_builtin_decoder_through_offload_train(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    cfg = RunConfig().with_overrides({
        "model.preset": "tiny", "data.path": str(corpus(tmp_path, chat=False)), "data.seq_len": "16",
        "data.batch_size": "4",
        "train.steps": "2", "train.checkpoint_every": "1", "train.eval_batches": "1",
        "train.out_dir": str(tmp_path / "run"), "tiers.nvme_dir": str(tmp_path / "swap"),
        "lora.rank": "2", "lora.target_modules": "q_proj,v_proj", "lora.export": "adapter",
    })
    summary = run(cfg, progress=False)
    assert summary.export == str(tmp_path / "run" / "adapter")
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert stored and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in stored)
    assert any(".lora_B." in n and bool(t.abs().sum() > 0) for n, t in stored.items())  # B trained away from 0
    # A resume with another lora.alpha (the adapters' scale, in no parameter's shape) went on without a word,
    # from weights trained under the old scale; it is refused, naming the flag that resumes, out_dir as it was.
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    other = cfg.with_overrides({"lora.alpha": "32", "train.steps": "3"})
    with pytest.raises(ValueError, match=r"ckpt-000002 was saved with other model settings \(lora\.alpha=16\.0 then, "
                       r"32\.0 now\).*resume with --lora\.alpha 16\.0"):
        Trainer(other, resume="latest", progress=False).run()
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == metrics


def test_lora_without_peft_is_one_clear_line(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    cfg = RunConfig().with_overrides({"model.preset": "tiny", "lora.rank": "4"})
    with pytest.raises(ValueError, match=r"^\[lora\] is set .* peft package is not installed: pip install"):
        build_causal_lm(cfg)


@pytest.mark.parametrize("lora", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_resumed_run_takes_every_weight_from_its_checkpoint_and_none_from_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lora: bool
) -> None:
    """A resume read the model's safetensors files first (minutes on a large model), then wrote the
    checkpoint over every byte of them. It now reads the checkpoint only, the frozen base of a LoRA
    model included, and ends bitwise where the uninterrupted run ends."""
    if lora:
        pytest.importorskip("peft")
    model_dir = tmp_path / "llama"
    tiny_llama_with_chat(model_dir)
    extra = {"lora.rank": "4", "lora.alpha": "8", "lora.target_modules": "q_proj,v_proj"} if lora else {}
    straight = config(tmp_path, model_dir, **{"train.steps": "3", "train.checkpoint_every": "1", **extra})
    run(straight, progress=False)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run" / "ckpt-000001", resumed_dir / "ckpt-000001")
    cfg = straight.with_overrides({"train.out_dir": str(resumed_dir)})
    calls: List[Any] = []
    monkeypatch.setattr(ot.Engine, "load_safetensors", lambda self, files: calls.append(files))
    run(cfg, resume="ckpt-000001", progress=False)
    assert calls == []
    assert_same_weights(restored_weights(straight, tmp_path, 3), restored_weights(cfg, tmp_path, 3))


def assert_same_weights(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]


def test_the_adapter_config_names_its_modules_in_one_order_whatever_the_process(tmp_path: Path) -> None:
    """PEFT keeps target_modules as a set and wrote it in the set's order, which str hashing (seeded per
    process) changes: a kill-and-resume chain ended with an adapter_config.json listing "v_proj",
    "q_proj" where the uninterrupted run's listed "q_proj", "v_proj". Written sorted."""
    peft = pytest.importorskip("peft")
    from types import SimpleNamespace

    from offload_trainer.app.hf_export import write_hf_files

    names = ["v_proj", "q_proj", "up_proj", "k_proj", "o_proj", "down_proj", "gate_proj"]
    config = peft.LoraConfig(r=2, target_modules=names)
    write_hf_files(tmp_path / "adapter", peft_model=SimpleNamespace(peft_config={"default": config}))
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["target_modules"] == sorted(names)


def test_the_adapter_config_says_inference_mode_as_peft_writes_it(tmp_path: Path) -> None:
    """PeftModel.save_pretrained writes "inference_mode": true (the adapter as saved is for inference; the
    model's own config stays as it was); the export wrote the training model's false, the one key in
    which its adapter_config.json differed from PEFT's own save of the same adapters."""
    peft = pytest.importorskip("peft")
    from types import SimpleNamespace

    from offload_trainer.app.hf_export import write_hf_files

    config = peft.LoraConfig(r=2, target_modules=["q_proj"], inference_mode=False)
    write_hf_files(tmp_path / "adapter", peft_model=SimpleNamespace(peft_config={"default": config}))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["inference_mode"] is True
    assert config.inference_mode is False  # the training model's config is left as it was


def test_an_adapter_names_its_base_by_an_absolute_path_under_a_relative_hf_path(tmp_path: Path, monkeypatch) -> None:
    """adapter_config.json's base_model_name_or_path (PEFT's, from the model's name_or_path) was model.hf_path as
    given: "llama" under a relative path, which AutoPeftModelForCausalLM run from any other directory looked
    up on the Hub. It is the directory's absolute path now."""
    pytest.importorskip("peft")
    tiny_llama_with_chat(tmp_path / "llama")
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig().with_overrides({
        "model.hf_path": "llama", "data.seq_len": "16", "lora.rank": "2", "lora.target_modules": "q_proj",
        "lora.export": "adapter",
    })
    lm = build_causal_lm(cfg)
    assert lm.lora is not None
    assert lm.lora.model.peft_config["default"].base_model_name_or_path == str((tmp_path / "llama").resolve())


@pytest.mark.slow
def test_a_bf16_adapter_export_holds_bf16_and_peft_upcasts_it_unless_told_not_to(tmp_path: Path) -> None:
    """An adapter exported in bf16 came back from PEFT as fp32, which looked like the export had lost its
    dtype. It had not: the file holds the engine's fp32 adapters rounded to bf16, and PEFT gives an adapter
    the dtype of the layer it adapts (fp32 over the fp32 base the run started from) and, over a bf16 base,
    upcasts bf16 and fp16 adapters to fp32 by default (autocast_adapter_dtype=True), as it does for an adapter
    PEFT saved itself; with a bf16 base and autocast_adapter_dtype=False they load as bf16, bitwise the
    export (README)."""
    import peft
    from safetensors.torch import load_file

    _, lm, engine, _, model_dir = lora_run(tmp_path)
    with engine:
        ours = {n: w for n, w in engine.full_state_dict().items() if ".lora_" in n}
        lm.export_adapter = True
        adapter = lm.export(engine, tmp_path / "adapter", "bf16")
    stored = load_file(adapter / "adapter_model.safetensors")
    assert {w.dtype for w in stored.values()} == {torch.bfloat16} and len(stored) == len(ours) == 8
    expected = sorted(w.to(torch.bfloat16).flatten().tolist() for w in ours.values())
    assert sorted(w.flatten().tolist() for w in stored.values()) == expected

    def adapters(base_dtype: torch.dtype, **kwargs: Any) -> dict:
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=base_dtype)
        model = peft.PeftModel.from_pretrained(base, adapter, **kwargs)
        return {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}

    fp32_base = adapters(torch.float32)
    upcast, kept = adapters(torch.bfloat16), adapters(torch.bfloat16, autocast_adapter_dtype=False)
    assert {w.dtype for w in fp32_base.values()} == {w.dtype for w in upcast.values()} == {torch.float32}
    assert {w.dtype for w in kept.values()} == {torch.bfloat16}
    assert sorted(w.flatten().tolist() for w in kept.values()) == expected
    assert all(torch.equal(upcast[n], kept[n].float()) and torch.equal(fp32_base[n], upcast[n]) for n in kept)
