"""The compute probe's cache (json_cache.py): a hit is not measured again, a cache file of another format is
replaced, a file that is not a cache file is named and left as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from offload_trainer.planning import compute_probe
from offload_trainer.planning.compute_probe import cached_decoder_times
from offload_trainer.planning.zero_memory import DecoderShape

SHAPE = DecoderShape(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)


def _times(path: Path, refresh: bool = False) -> tuple:
    return cached_decoder_times(SHAPE, 1, 8, torch.float32, False, path, refresh)


def test_second_call_comes_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "compute.json"
    first, cached = _times(path)
    assert not cached and first.forward_s > 0 and first.backward_s > 0

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured although cached")

    monkeypatch.setattr(compute_probe, "measure_decoder_times", no_measuring)
    again, cached = _times(path)
    assert cached and again == first


def test_a_cache_of_another_format_is_named_measured_again_and_replaced(tmp_path: Path) -> None:
    path = tmp_path / "compute.json"
    path.write_text(json.dumps({"format": 999, "entries": {}}))
    with pytest.warns(UserWarning, match=f"compute-time cache {path}: a format-999 cache file"):
        _, cached = _times(path)
    assert not cached
    assert len(json.loads(path.read_text())["entries"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compute.json"]  # no temporary file left
    assert _times(path)[1]


@pytest.mark.parametrize("text", ["{ not json", json.dumps([1, 2])], ids=["not_json", "not_a_cache"])
def test_a_file_that_is_no_cache_is_named_measured_and_left_as_it_is(tmp_path: Path, text: str) -> None:
    """compute.json sits beside $OFFLOAD_TRAINER_CACHE: a file of the user's of that name was replaced."""
    path = tmp_path / "compute.json"
    path.write_text(text)
    with pytest.warns(UserWarning, match=f"compute-time cache {path}: it is not a cache file"):
        _, cached = _times(path)
    assert not cached
    assert path.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compute.json"]  # no temporary file left


def test_an_unwritable_cache_warns_and_still_returns_the_times(tmp_path: Path) -> None:
    # HOME not writable (~/.cache cannot be made): offload-plan stopped there with exit code 2,
    # naming a path it could not make, rather than planning without a cache as the rates do.
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    path = blocker / "compute.json"  # its directory cannot be made: a file is in the way
    with pytest.warns(UserWarning) as record:  # it cannot be read either: warned about too
        times, cached = _times(path)
    assert not cached and times.forward_s > 0
    assert any(f"could not write the compute-time cache {path}" in str(w.message) for w in record)


def test_the_probe_computes_on_the_device_it_plans_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan for a GPU weighs IO against the GPU's compute time, not the CPU's (many times longer).
    The meta device stands in for the GPU here: the probe's tensors must all be there."""
    seen = []
    timed = compute_probe._timed_forward_backward

    def recording(loss, device):
        seen.append(loss().device)
        return timed(loss, device)

    monkeypatch.setattr(compute_probe, "_timed_forward_backward", recording)
    compute_probe.measure_decoder_times(SHAPE, 1, 8, repeats=1, device=torch.device("meta"))
    assert seen and set(seen) == {torch.device("meta")}


def test_the_cpus_times_and_another_devices_are_cached_apart(tmp_path: Path) -> None:
    path = tmp_path / "compute.json"
    _, cached = cached_decoder_times(SHAPE, 1, 8, torch.float32, False, path, device=torch.device("meta"))
    assert not cached
    assert not _times(path)[1]  # the CPU's: not the meta device's entry
    assert _times(path)[1]
    assert len(json.loads(path.read_text())["entries"]) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_probe_times_the_gpu_and_leaves_its_generator_alone() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.get_rng_state(device)
    times = compute_probe.measure_decoder_times(SHAPE, 2, 32, repeats=2, device=device)
    assert times.forward_s > 0 and times.backward_s > 0
    assert torch.equal(torch.cuda.get_rng_state(device), before)
