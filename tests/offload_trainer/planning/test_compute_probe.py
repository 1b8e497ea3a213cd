"""The compute probe's cache (json_cache.py): a hit is not measured again, a corrupt or foreign file is
named and replaced."""

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


@pytest.mark.parametrize(
    "text", ["{ not json", json.dumps({"format": 999, "entries": {}}), json.dumps([1, 2])],
    ids=["not_json", "another_format", "not_a_cache"],
)
def test_a_corrupt_cache_is_named_measured_again_and_replaced(tmp_path: Path, text: str) -> None:
    path = tmp_path / "compute.json"
    path.write_text(text)
    with pytest.warns(UserWarning, match=f"compute-time cache {path}"):
        _, cached = _times(path)
    assert not cached
    assert len(json.loads(path.read_text())["entries"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compute.json"]  # no temporary file left
    assert _times(path)[1]
