"""The random generators saved with a checkpoint: the CPU's always, the CUDA device's when the engine
runs on one (dropout on a CUDA tensor draws from it), restored on resume; unusable states refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload_trainer.app.rng_state import load_rng_state, rng_state
from offload_trainer.errors import CheckpointError

CPU = torch.device("cpu")


def test_the_cpu_generator_is_restored_bitwise() -> None:
    torch.manual_seed(3)
    saved = rng_state(CPU)
    assert set(saved) == {"torch_rng"}
    expected = torch.nn.functional.dropout(torch.ones(64), 0.5)
    torch.manual_seed(4)
    load_rng_state(saved, CPU, Path("ckpt"))
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), expected)


def test_the_cuda_generator_of_the_engines_device_is_saved_and_restored(monkeypatch) -> None:
    """Without a GPU, torch.cuda's generator calls are stood in for: what is saved is the engine
    device's state, and it goes back to that device."""
    device = torch.device("cuda", 1)
    states = {1: torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: states[torch.device(d).index].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: states.__setitem__(torch.device(d).index, s.clone()))
    saved = rng_state(device)
    assert saved["cuda_rng"] == list(range(16))
    states[1] = torch.zeros(16, dtype=torch.uint8)  # drawn from since
    load_rng_state(saved, device, Path("ckpt"))
    assert states[1].tolist() == list(range(16))
    # Resumed on the CPU: the device's state has nowhere to go and is left; the CPU's is restored.
    load_rng_state(saved, CPU, Path("ckpt"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dropout_on_cuda_draws_the_same_masks_after_a_restore() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    torch.nn.functional.dropout(torch.ones(1000, device=device), 0.5)  # the run so far
    saved = rng_state(device)
    expected = torch.nn.functional.dropout(torch.ones(1000, device=device), 0.5)
    torch.manual_seed(0)  # what a resumed run's start does
    load_rng_state(saved, device, Path("ckpt"))
    assert torch.equal(torch.nn.functional.dropout(torch.ones(1000, device=device), 0.5), expected)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({}, "no 'torch_rng' entry"),
        ({"torch_rng": [1, 2, 3]}, "RNG state is unusable"),
        ({"torch_rng": "x"}, "RNG state is unusable"),
        ({"torch_rng": torch.get_rng_state().tolist(), "cuda_rng": "x"}, "RNG state is unusable"),
    ],
)
def test_an_unusable_state_is_refused_naming_the_checkpoint(extra, message) -> None:
    with pytest.raises(CheckpointError, match=message) as info:
        load_rng_state(extra, CPU, Path("runs/ckpt-000002"))
    assert "runs/ckpt-000002" in str(info.value)
