"""app/hf_weights.py: a Hugging Face checkpoint loads into the engine through transformers' own
conversion rules, bitwise as from_pretrained loads it, and exports back to save_pretrained's layout.

Tiny MoE models built from configs (no download): Mixtral (per-expert w1/w3/w2 under
block_sparse_moe, held as fused mlp.experts.gate_up_proj/down_proj) and Qwen3-MoE (another rule
set: per-expert gate/up/down_proj). Eleven experts, so a string sort of the expert index (0, 1, 10,
2, ...) would misplace them; small shards, so one fused parameter's experts span several files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest
import torch

transformers = pytest.importorskip("transformers")

import offload_trainer as ot  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from offload_trainer.app.causal_lm import zero_init  # noqa: E402
from offload_trainer.app.hf_weights import HFCheckpoint  # noqa: E402
from offload_trainer.runtime.persist.materialize import parameters_on_meta  # noqa: E402

NUM_EXPERTS = 11


def tiny_config(arch: str) -> "transformers.PretrainedConfig":
    common = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=24, num_local_experts=NUM_EXPERTS, **common)
    return transformers.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=NUM_EXPERTS, **common)


def save_tiny(arch: str, path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch))
    model.save_pretrained(path, max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 2


def stored(directory: Path) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def on_meta(directory: Path) -> "tuple[torch.nn.Module, HFCheckpoint]":
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    return model, HFCheckpoint(model, sorted(directory.glob("*.safetensors")))


def engine_config(tmp_path: Path) -> ot.OffloadConfig:
    tiers = {"params": {"host": 0.5, "nvme": 0.5}, "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path / "swap")}
    return ot.OffloadConfig(tiers=tiers)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_per_expert_tensors_fill_the_fused_parameters_bitwise_as_from_pretrained(tmp_path, arch) -> None:
    save_tiny(arch, tmp_path / "hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    fused = [n for n, p in reference.named_parameters() if p.dim() == 3]
    assert fused and all(reference.get_parameter(n).shape[0] == NUM_EXPERTS for n in fused)
    assert not any(".experts." in k and k.endswith(("gate_up_proj", "down_proj")) for k in stored(tmp_path / "hf"))

    model, checkpoint = on_meta(tmp_path / "hf")
    with ot.initialize(model, engine_config(tmp_path), init_fn=zero_init) as engine:
        engine.load_safetensors(checkpoint)
        ours = engine.full_state_dict()
    theirs = dict(reference.named_parameters())
    assert set(ours) == set(theirs)
    unequal = [n for n in theirs if not torch.equal(ours[n], theirs[n].detach())]
    assert not unequal


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_export_restores_save_pretrained_layout_bitwise(tmp_path, arch) -> None:
    save_tiny(arch, tmp_path / "hf")
    model, checkpoint = on_meta(tmp_path / "hf")
    with ot.initialize(model, engine_config(tmp_path), init_fn=zero_init) as engine:
        engine.load_safetensors(checkpoint)
        path = engine.export_safetensors(tmp_path / "out" / "model.safetensors", stored_as=checkpoint.stored_as)
    original, exported = stored(tmp_path / "hf"), stored(path.parent)
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_unknown_and_misfit_tensors_are_refused_in_one_line_before_anything_is_written(tmp_path) -> None:
    save_tiny("mixtral", tmp_path / "hf")
    tensors = stored(tmp_path / "hf")
    for path in (tmp_path / "hf").glob("*.safetensors*"):
        path.unlink()
    del tensors["model.layers.1.block_sparse_moe.experts.7.w1.weight"]  # gate_up_proj of 10 gates, 11 ups
    tensors["model.layers.0.block_sparse_moe.router_bias"] = torch.zeros(3)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))

    model, checkpoint = on_meta(tmp_path / "hf")
    with ot.initialize(model, engine_config(tmp_path), init_fn=zero_init) as engine:
        with pytest.raises(ValueError) as info:
            engine.load_safetensors(checkpoint)
        after = engine.full_state_dict()
    message = str(info.value)
    assert "\n" not in message
    assert "'model.layers.0.block_sparse_moe.router_bias'" in message  # as stored: what the user can find
    assert "cannot be converted into 'model.layers.1.mlp.experts.gate_up_proj'" in message
    assert "missing from the weights: ['model.layers.1.mlp.experts.gate_up_proj']" in message
    assert all(not t.any() for t in after.values())  # nothing was written


def test_a_checkpoint_in_the_models_own_layout_loads_and_exports_as_it_is(tmp_path) -> None:
    """No rule matches (the fused names stored as they are, e.g. by another tool): identity both ways."""
    save_tiny("mixtral", tmp_path / "hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    save_file({n: p.detach().contiguous() for n, p in reference.named_parameters()}, str(tmp_path / "own" / "model.safetensors"))

    model, checkpoint = on_meta(tmp_path / "own")
    with ot.initialize(model, engine_config(tmp_path), init_fn=zero_init) as engine:
        engine.load_safetensors(checkpoint)
        ours = engine.full_state_dict()
        path = engine.export_safetensors(tmp_path / "out" / "model.safetensors", stored_as=checkpoint.stored_as)
    assert all(torch.equal(ours[n], p.detach()) for n, p in reference.named_parameters())
    assert set(stored(path.parent)) == set(stored(tmp_path / "own"))


def test_the_shard_index_save_pretrained_writes_is_checked_against_the_headers_and_passes(tmp_path) -> None:
    """hf_weight_files compares the index's weight_map with the shards' headers (a misplaced or missing
    tensor is refused: tests/offload_trainer/app/test_bad_inputs.py); a real sharded save matches."""
    from offload_trainer.app.hf_weights import SHARD_INDEX, hf_weight_files

    save_tiny("mixtral", tmp_path / "hf")
    assert (tmp_path / "hf" / SHARD_INDEX).is_file()
    assert hf_weight_files(tmp_path / "hf") == sorted((tmp_path / "hf").glob("*.safetensors"))
