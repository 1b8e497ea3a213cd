"""Consolidated safetensors export (streamed) and loading safetensors straight into shards."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM

TIERS = {"params": {"host": 0.5, "nvme": 0.5}, "grads": "host", "optimizer": "nvme"}


def trained_engine(tmp_path, precision: str = "fp32", tie: bool = False) -> ot.Engine:
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(tiers=dict(TIERS, nvme_dir=str(tmp_path / "swap")), precision={"compute_dtype": precision})
    engine = ot.initialize(DecoderLM(DecoderConfig.preset("tiny", tie_embeddings=tie)), cfg)
    x = torch.randint(0, 256, (2, 16))
    engine.backward(engine(x, x)[1])
    engine.step()
    return engine


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_reloads_with_safetensors_and_equals_the_engine(tmp_path, dtype, tie) -> None:
    with trained_engine(tmp_path, tie=tie) as engine:
        path = engine.export_safetensors(tmp_path / "out" / "model.safetensors", dtype=dtype)  # dir made
        expected = engine.full_state_dict()
    loaded = load_file(str(path))
    first = {n for n, _ in DecoderLM(DecoderConfig.preset("tiny", tie_embeddings=tie)).named_parameters()}
    assert set(loaded) == first  # a tied weight once, under its first name
    for name, tensor in loaded.items():
        assert tensor.dtype == dtype
        assert torch.equal(tensor, expected[name].to(dtype))
    assert not list(tmp_path.glob("*.tmp-*"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_loaded_weights_equal_the_files(tmp_path, precision) -> None:
    torch.manual_seed(7)
    source = DecoderLM(DecoderConfig.preset("tiny"))
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    items = {n: p.detach().clone() for n, p in source.named_parameters()}
    names = sorted(items)
    save_file({n: items[n] for n in names[: len(names) // 2]}, str(files[0]))
    save_file({n: items[n] for n in names[len(names) // 2 :]}, str(files[1]))
    with trained_engine(tmp_path, precision) as engine:
        engine.load_safetensors(files)
        state = engine.full_state_dict()
        x = torch.randint(0, 256, (2, 16))
        engine.backward(engine(x, x)[1])  # the loaded weights are the ones used
        engine.step()
    assert all(torch.equal(state[n], items[n]) for n in items)


def test_mismatched_weights_are_refused_before_anything_is_written(tmp_path) -> None:
    torch.manual_seed(7)
    items = {n: p.detach().clone() for n, p in DecoderLM(DecoderConfig.preset("tiny")).named_parameters()}
    items["lm_head.weight"] = torch.zeros(3, 3)
    del items["norm.weight"]
    items["extra.weight"] = torch.zeros(2)
    save_file(items, str(tmp_path / "bad.safetensors"))
    with trained_engine(tmp_path) as engine:
        before = engine.full_state_dict()
        with pytest.raises(ValueError) as info:
            engine.load_safetensors([tmp_path / "bad.safetensors"])
        message = str(info.value)
        assert "lm_head.weight" in message and "norm.weight" in message and "extra.weight" in message
        after = engine.full_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_safetensors_file_the_format_refuses_is_named_and_nothing_is_written(tmp_path) -> None:
    """Two tensors over the same bytes: the safetensors library refused it as "invalid offset for
    tensor `b`" (a SafetensorError, not a ValueError), naming no file among the ones given."""
    import json
    import struct

    items = {n: p.detach().clone() for n, p in DecoderLM(DecoderConfig.preset("tiny")).named_parameters()}
    save_file(items, str(tmp_path / "good.safetensors"))
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with trained_engine(tmp_path) as engine:
        before = engine.full_state_dict()
        with pytest.raises(ValueError, match=r"bad\.safetensors is corrupted: tensor 'b' at \[0, 8\] overlaps"):
            engine.load_safetensors([tmp_path / "good.safetensors", tmp_path / "bad.safetensors"])
        after = engine.full_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_path_that_is_no_file_is_refused_naming_it_and_nothing_is_written(tmp_path) -> None:
    """load_safetensors of a missing path raised a bare FileNotFoundError (a directory: IsADirectoryError),
    not the ValueError naming the path and the fix that every other unusable file gets."""
    items = {n: p.detach().clone() for n, p in DecoderLM(DecoderConfig.preset("tiny")).named_parameters()}
    save_file(items, str(tmp_path / "good.safetensors"))
    (tmp_path / "directory.safetensors").mkdir()
    on_host = ot.OffloadConfig(tiers={"params": "host", "grads": "host", "optimizer": "host"})
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), on_host) as engine:
        before = engine.full_state_dict()
        for bad, what in (("missing", "does not exist"), ("directory", "is not a regular file")):
            with pytest.raises(ValueError, match=rf"{bad}\.safetensors {what}; name a"):
                engine.load_safetensors([tmp_path / "good.safetensors", tmp_path / f"{bad}.safetensors"])
        after = engine.full_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)



_KILLED_EXPORT = r"""
import os, signal, sys
import torch
import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM
from offload_trainer.runtime.persist import export

target, swap = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
cfg = ot.OffloadConfig(tiers={"params": "host", "grads": "host", "optimizer": "host", "nvme_dir": swap})
engine = ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg)
engine.export_safetensors(target, dtype=torch.bfloat16)
gather, calls = export.group_parameters, [0]
def killed(*args):
    calls[0] += 1
    if calls[0] == 3:  # the header and two groups written into the temporary
        os.kill(os.getpid(), signal.SIGKILL)
    return gather(*args)
export.group_parameters = killed
engine.export_safetensors(target)
"""


def test_the_next_export_removes_what_a_killed_export_of_the_same_file_left(tmp_path) -> None:
    """engine.export_safetensors over an earlier export, SIGKILLed mid-write (an OOM kill, a
    scheduler's): the target is the old export, whole, and the next export of it removes the killed
    one's temporary. It stayed beside the target for good, part of a whole model's bytes each time
    (only write_atomic removed its target's leftovers, not atomic_open, which the export writes with)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    target = tmp_path / "out" / "model.safetensors"
    repo = Path(__file__).resolve().parents[3]
    died = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, str(target), str(tmp_path / "swap")], cwd=repo, capture_output=True,
        text=True, timeout=300,
    )
    assert died.returncode == -signal.SIGKILL, died.stderr[-3000:]
    old = load_file(str(target))
    assert all(t.dtype == torch.bfloat16 for t in old.values())
    (left,) = target.parent.glob("model.safetensors.tmp-*")
    assert left.stat().st_size > 0
    with trained_engine(tmp_path) as engine:
        engine.export_safetensors(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.safetensors"]
    assert all(t.dtype == torch.float32 for t in load_file(str(target)).values())
