"""Tiny Hugging Face models (built from configs, saved with save_pretrained: no download) are
fine-tuned by offload-train, exported, reloaded with transformers, and their logits match the
engine's (restored from the run's last checkpoint) bitwise in fp32. The export is stored the
way save_pretrained stores the architecture (Mixtral: one tensor per expert, which the model holds
fused), so its tensor names are exactly save_pretrained's, and from_pretrained finds nothing
missing or unexpected."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Set

import pytest
import torch

transformers = pytest.importorskip("transformers")

import offload_trainer as ot  # noqa: E402
from offload_trainer.app.causal_lm import build_causal_lm  # noqa: E402
from offload_trainer.app.run_config import RunConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def tiny_llama(path: Path, with_tokenizer: bool = False) -> None:
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    if with_tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers

        chars = sorted(set("abcdefghijklmnopqrstuvwxyz_():=+ \n0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ,.#"))
        vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)


def tiny_gpt2(path: Path) -> None:
    """Learned positions, Conv1D weights, and the LM head tied to the token embedding."""
    config = transformers.GPT2Config(
        vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)


def tiny_mixtral(path: Path) -> None:
    """Experts stored one tensor each (w1/w2/w3) under block_sparse_moe, held fused under mlp."""
    config = transformers.MixtralConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(path)


def stored_names(directory: Path) -> Set[str]:
    from safetensors import safe_open

    names: Set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def offload_train(model_dir: Path, tmp_path: Path, steps: int, seq_len: int = 32) -> subprocess.CompletedProcess:
    """The real command line, on a small code corpus: `steps` steps, no intermediate checkpoints, export."""
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    (corpus / "a.py").write_text("def add(a, b):\n    return a + b\n" * 200)
    argv = [
        "--model.hf_path", str(model_dir), "--data.path", str(corpus), "--data.seq_len", str(seq_len),
        "--data.batch_size", "4", "--train.steps", str(steps), "--train.checkpoint_every", "0",
        "--train.eval_batches", "2", "--train.out_dir", str(tmp_path / "run"), "--tiers.nvme_dir", str(tmp_path / "swap"),
        "--no-progress", "--json",
    ]
    return subprocess.run([sys.executable, "-m", "offload_trainer", *argv], cwd=REPO, capture_output=True, text=True, timeout=300)


def engine_logits(out: Path, tmp_path: Path, steps: int, x: torch.Tensor) -> torch.Tensor:
    """The run's model rebuilt from its saved config and restored from its last checkpoint."""
    cfg = RunConfig.from_dict(json.loads((out / "config.json").read_text()))
    cfg = cfg.with_overrides({"tiers.nvme_dir": str(tmp_path / "swap2")})
    lm = build_causal_lm(cfg)
    lm.model.eval()  # no dropout (GPT-2 has some), as from_pretrained's model
    with ot.initialize(lm.model, cfg.engine_config(), init_fn=lm.init_fn) as engine:
        engine.load_checkpoint(out / f"ckpt-{steps:06d}")
        with torch.no_grad():
            return engine(x).logits


def check_round_trip(model_dir: Path, tmp_path: Path, steps: int) -> Path:
    """offload-train, then: the export reloads with nothing missing or unexpected, under save_pretrained's
    names, with the engine's logits, and fine-tuning changed them. Returns the export directory."""
    done = offload_train(model_dir, tmp_path, steps)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "run"
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["export"] == str(out / "hf")
    files = sorted(model_dir.glob("*.safetensors"))
    assert f"loading the weights from {model_dir} ({len(files)} file(s), " in done.stdout, done.stdout
    assert "\nloaded the weights in " in done.stdout, done.stdout
    # Without tokenizer files the run trains on bytes, and says so (test_causal_lm has the line in full).
    bytes_said = f"offload-train: model.hf_path={str(model_dir)!r} has no tokenizer files" in done.stderr
    assert bytes_said == (not (model_dir / "tokenizer.json").is_file()), done.stderr[-3000:]

    assert stored_names(out / "hf") == stored_names(model_dir)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    x = torch.randint(0, 40, (2, 16))
    ours = engine_logits(out, tmp_path, steps, x)
    with torch.no_grad():
        theirs = reloaded(input_ids=x).logits
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()  # bitwise: the same fp32 weights and ops
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        assert not torch.allclose(original(input_ids=x).logits, theirs), "fine-tuning changed nothing"
    return out / "hf"


# Without tokenizer files (the byte tokenizer) and Mixtral's MoE blocks: slow (7-8 s each); the default
# run keeps Llama with its tokenizer and GPT-2, and test_causal_lm / test_model_families build the other two.
@pytest.mark.parametrize("with_tokenizer", [pytest.param(False, marks=pytest.mark.slow), True])
def test_hf_llama_fine_tuned_exported_and_reloaded(tmp_path, with_tokenizer) -> None:
    model_dir = tmp_path / "llama"
    tiny_llama(model_dir, with_tokenizer)
    exported = check_round_trip(model_dir, tmp_path, steps=4)
    if with_tokenizer:
        assert (exported / "tokenizer.json").is_file()


BUILDERS: Dict[str, Callable[[Path], None]] = {"gpt2": tiny_gpt2, "mixtral": tiny_mixtral}


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "mixtral" else a for a in sorted(BUILDERS)])
def test_hf_architecture_fine_tuned_exported_and_reloaded(tmp_path, arch) -> None:
    model_dir = tmp_path / arch
    BUILDERS[arch](model_dir)
    check_round_trip(model_dir, tmp_path, steps=2)


def test_seq_len_beyond_the_models_positions_is_refused_up_front(tmp_path) -> None:
    model_dir = tmp_path / "gpt2"
    tiny_gpt2(model_dir)  # n_positions = 64
    done = offload_train(model_dir, tmp_path, steps=1, seq_len=65)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "data.seq_len=65" in last and "max_position_embeddings=64" in last and "at most 64" in last, done.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_the_loss_builds_no_key_value_cache(tmp_path, monkeypatch) -> None:
    """offload-train called a Hugging Face model with its default use_cache (True in LlamaConfig), so
    every training and eval forward built a DynamicCache of every layer's keys and values, which no loss
    reads (in the eval's no_grad forward it kept them all alive to the end of the forward). The loss is
    unchanged, bitwise, with use_cache=False."""
    from transformers import cache_utils

    model_dir = tmp_path / "llama"
    tiny_llama(model_dir)
    cfg = RunConfig().with_overrides({
        "model.hf_path": str(model_dir), "data.seq_len": "16", "tiers.params": "host", "tiers.optimizer": "host",
        "tiers.nvme_dir": str(tmp_path / "swap"),
    })
    lm = build_causal_lm(cfg)
    x = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(0))
    caches = []
    real_init = cache_utils.DynamicCache.__init__

    def counted(self, *args, **kwargs):
        caches.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicCache, "__init__", counted)
    with ot.initialize(lm.model, cfg.engine_config(), init_fn=lm.init_fn) as engine:
        engine.load_safetensors(lm.weight_files)
        loss = lm.loss(engine, x[:, :-1], x[:, 1:])
        engine.backward(loss)
        with torch.no_grad():
            engine.eval()
            eval_loss = lm.loss(engine, x[:, :-1], x[:, 1:])
            plain = lm.loss_of(engine(x[:, :-1]), x[:, 1:])  # the model's default: a cache
    assert len(caches) == 1
    assert torch.equal(eval_loss, plain)
