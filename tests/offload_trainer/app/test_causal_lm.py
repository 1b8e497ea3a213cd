"""app/causal_lm.py: a local Hugging Face model directory as offload-train builds and loads it.

Tiny models built from configs and saved with save_pretrained (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import offload_trainer as ot  # noqa: E402
from offload_trainer.app.causal_lm import build_causal_lm  # noqa: E402
from offload_trainer.app.run_config import RunConfig  # noqa: E402


def tiny_llama(path: Path, dtype: torch.dtype) -> None:
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(path)


def run_config(tmp_path: Path, model_dir: Path) -> RunConfig:
    return RunConfig().with_overrides({
        "model.hf_path": str(model_dir), "data.seq_len": "16", "tiers.nvme_dir": str(tmp_path / "swap"),
        "train.out_dir": str(tmp_path / "run"),
    })


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_a_checkpoint_stored_in_half_precision_trains_from_its_weights_in_fp32(tmp_path, stored) -> None:
    """Most published checkpoints are stored in bf16, and their config.json says so; the model is still
    built in fp32 (the engine's parameters; precision.compute_dtype picks the compute), with the stored
    weights cast exactly, as from_pretrained(dtype=torch.float32) loads them."""
    model_dir = tmp_path / "llama"
    tiny_llama(model_dir, stored)
    lm = build_causal_lm(run_config(tmp_path, model_dir))
    assert {p.dtype for p in lm.model.parameters()} == {torch.float32}
    with ot.initialize(lm.model, run_config(tmp_path, model_dir).engine_config(), init_fn=lm.init_fn) as engine:
        engine.load_safetensors(lm.weight_files)
        ours = engine.full_state_dict()
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    theirs = dict(reference.named_parameters())
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[n], theirs[n].detach()) for n in theirs)
    assert any(t.dtype == stored for t in transformers.AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def test_activation_checkpointing_of_an_hf_model_is_on_without_deprecation_warnings(tmp_path) -> None:
    """transformers 5 renamed gradient checkpointing to activation checkpointing and warns (FutureWarning)
    at every use of the old names; the model is built and planned with checkpointing on, silently."""
    import warnings

    from offload_trainer.planning.model_spec import ModelSpec

    model_dir = tmp_path / "llama"
    tiny_llama(model_dir, torch.float32)
    cfg = run_config(tmp_path, model_dir).with_overrides({"model.activation_checkpointing": "true"})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lm = build_causal_lm(cfg)
        spec = ModelSpec.from_module(lm.model)
    assert spec.activation_checkpointing
    assert not [w for w in seen if "checkpointing" in str(w.message)], [str(w.message) for w in seen]


def _bert_family(model_type: str, is_decoder: bool) -> object:
    sizes = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    extra = {"rembert": dict(input_embedding_size=16, output_embedding_size=16), "big_bird": dict(attention_type="original_full")}
    return transformers.AutoConfig.for_model(model_type, **sizes, **extra.get(model_type, {}), is_decoder=is_decoder)


def _sees_later_tokens(model: torch.nn.Module) -> bool:
    """Whether a later token changes an earlier position's logits (the forward probe refuse_non_causal does
    not need: here it checks the flags against what the models compute)."""
    ids = torch.arange(8).view(1, 8) % 60
    later = ids.clone()
    later[0, -1] += 1
    with torch.no_grad():
        return not torch.equal(model.eval()(input_ids=ids).logits[:, :-1], model(input_ids=later).logits[:, :-1])


@pytest.mark.parametrize("model_type", ["megatron-bert", "rembert", "roformer", "big_bird"])
def test_an_encoder_whose_layers_carry_is_decoder_but_no_is_causal_is_refused(model_type: str) -> None:
    """MegatronBERT, RemBERT, RoFormer and BigBird build a "causal LM" from an encoder's config without any
    module's is_causal: they were taken, and trained positions that see the tokens they predict. Their
    layers' is_decoder (the config's, which makes them mask) says so; with is_decoder true they are taken."""
    from offload_trainer.app.causal_lm import refuse_non_causal

    torch.manual_seed(0)
    encoder = transformers.AutoModelForCausalLM.from_config(_bert_family(model_type, False))
    assert _sees_later_tokens(encoder)
    with pytest.raises(ValueError, match=f"builds {type(encoder).__name__}, whose attention is not causal"):
        refuse_non_causal(encoder, "model.hf_path='m'")
    decoder = transformers.AutoModelForCausalLM.from_config(_bert_family(model_type, True))
    assert not _sees_later_tokens(decoder)
    refuse_non_causal(decoder, "model.hf_path='m'")


def test_a_model_directory_without_tokenizer_files_is_said_to_train_on_bytes(
    tmp_path, tiny_run_args, capsys, monkeypatch
) -> None:
    """A Hugging Face model directory with no tokenizer files trained on UTF-8 bytes without a word: for a
    pretrained model (its tokenizer not copied along with its weights) almost surely a mistake. offload-train
    says so in one line at the start, before the corpus is tokenized with them (the run is stopped there).
    The model here is the tiny preset posing as one from model.hf_path: building a real one costs seconds
    (test_trainer_hf's runs check the line on a real directory); a preset or a directory with a tokenizer
    is not told."""
    import dataclasses

    from offload_trainer.app import trainer
    from offload_trainer.app.causal_lm import byte_tokens_note
    from offload_trainer.app.cli import main

    preset = build_causal_lm(RunConfig().with_overrides({"data.seq_len": "16"}))
    hf_dir = tmp_path / "my-llama"
    from_dir = dataclasses.replace(preset, hf_dir=hf_dir)
    assert byte_tokens_note(preset) is None
    assert byte_tokens_note(dataclasses.replace(from_dir, hf_tokenizer=object())) is None
    expected = (
        f"model.hf_path={str(hf_dir)!r} has no tokenizer files (tokenizer.json, tokenizer_config.json, "
        "tokenizer.model): training on UTF-8 bytes (token ids 0-255), not the ids a pretrained model's "
        "embeddings stand for; copy its tokenizer files there"
    )
    assert byte_tokens_note(from_dir) == expected

    def stop(*args: object) -> None:
        raise ValueError("stopped where the corpus is read")

    monkeypatch.setattr(trainer, "build_causal_lm", lambda cfg: from_dir)
    monkeypatch.setattr(trainer, "build_data", stop)
    assert main(tiny_run_args()) == 2
    err = capsys.readouterr().err
    assert err.count(f"offload-train: {expected}\n") == 1, err
