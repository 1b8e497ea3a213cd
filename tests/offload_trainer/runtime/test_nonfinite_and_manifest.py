"""Nothing trains on or saves garbage: a non-finite gradient updates nothing, no checkpoint or export is
written from a non-finite state, and an edited checkpoint manifest is refused before anything loads."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
import torch

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM

TIERS = {"params": "nvme", "grads": "host", "optimizer": "nvme"}


def make_engine(tmp_path: Path, precision: str = "fp32", clip: float | None = 1.0) -> ot.Engine:
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(
        tiers=dict(TIERS, nvme_dir=str(tmp_path / "swap")),
        optimizer={"lr": 1e-2, "grad_clip_norm": clip},
        precision={"compute_dtype": precision},
    )
    return ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg)


def step(engine: ot.Engine, poison: bool = False) -> None:
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(engine.global_step))
    loss = engine(x, x.roll(-1, 1))[1]
    engine.backward(loss * float("nan") if poison else loss)
    engine.step()


@pytest.mark.parametrize("precision,clip", [("fp32", 1.0), ("fp32", None), ("bf16", None)])
def test_a_nan_gradient_updates_nothing_and_says_so(tmp_path: Path, precision: str, clip: float | None) -> None:
    with make_engine(tmp_path, precision, clip) as engine:
        step(engine)
        before = engine.full_state_dict()
        step(engine, poison=True)
        stats = engine.stats()
        assert stats.skipped and stats.nonfinite and not torch.isfinite(torch.tensor(stats.grad_norm))
        after = engine.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "a non-finite step changed the weights"
        step(engine)  # the next good step trains normally
        assert not engine.stats().skipped and not engine.stats().nonfinite


def _poison_a_home(engine: ot.Engine) -> None:
    """Put a NaN into group 0's parameter shard, as a bad update or a corrupted home would."""
    engine.pipeline.wait_all()  # the last step's updates, running behind, write the homes too
    group = engine.groups[0]
    shard = torch.empty(group.param_home.numel, dtype=group.param_home.dtype)
    group.param_home.read(engine.tiers, shard)
    shard[3] = float("nan")
    group.param_home.write(engine.tiers, shard)


def test_no_checkpoint_and_no_export_from_a_non_finite_state(tmp_path: Path) -> None:
    with make_engine(tmp_path) as engine:
        step(engine)
        _poison_a_home(engine)
        with pytest.raises(ot.NonFiniteError, match="not finite"):
            engine.save_checkpoint(tmp_path / "ckpt")
        with pytest.raises(ot.NonFiniteError, match="inf or nan"):
            engine.export_safetensors(tmp_path / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["swap"], "a refused save or export left files behind"


def _rewrite(path: Path, edit: Callable[[Dict[str, Any]], None], fix_checksum: bool = False) -> None:
    manifest = json.loads(path.read_text())
    edit(manifest)
    if fix_checksum:  # an editor who knows the format: the structure checks must still refuse it
        body = {k: v for k, v in manifest.items() if k != "checksum"}
        manifest["checksum"] = f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"
    path.write_text(json.dumps(manifest))


EDITS = {
    "step": lambda m: m["state"].__setitem__("step", 99),
    "optimizer steps": lambda m: m["ranks"][0]["state"]["optimizer"]["steps"].__setitem__("0", [7.0] * 3),
    "data position": lambda m: m["extra"].__setitem__("data_position", 0),
    "data seed": lambda m: m["extra"].__setitem__("seed", 5),
    "data epoch": lambda m: m["extra"].__setitem__("epoch", 3),
    "empty record": lambda m: m["ranks"][0]["records"][0].update(numel=0, crc32=0),
    "loss scale 0": lambda m: m["state"]["loss_scale"].__setitem__("scale", 0.0),
    "absolute rank file": lambda m: m["ranks"][0].__setitem__("file", "/etc/passwd"),
    "rank file with ..": lambda m: m["ranks"][0].__setitem__("file", "../rank00000.bin"),
    "missing key": lambda m: m.pop("state"),
}


@pytest.mark.parametrize("what", sorted(EDITS))
def test_every_manifest_edit_is_refused(tmp_path: Path, what: str) -> None:
    with make_engine(tmp_path) as engine:
        step(engine)
        engine.save_checkpoint(tmp_path / "ckpt", extra={"data_position": 8, "seed": 0, "epoch": 0})
        expected = engine.full_state_dict()
        manifest = tmp_path / "ckpt" / "manifest.json"
        original = manifest.read_text()
        _rewrite(manifest, EDITS[what])
        with pytest.raises(ot.CheckpointError, match="edited or corrupted"):
            engine.load_checkpoint(tmp_path / "ckpt")
        assert engine.global_step == 1
        got = engine.full_state_dict()
        assert all(torch.equal(expected[k], got[k]) for k in expected), "a refused load changed the state"
        manifest.write_text(original)
        engine.load_checkpoint(tmp_path / "ckpt")  # the unedited manifest still loads


@pytest.mark.parametrize("what", ["empty record", "absolute rank file", "rank file with ..", "missing key"])
def test_a_well_formed_lie_is_refused_too(tmp_path: Path, what: str) -> None:
    with make_engine(tmp_path) as engine:
        step(engine)
        engine.save_checkpoint(tmp_path / "ckpt")
        _rewrite(tmp_path / "ckpt" / "manifest.json", EDITS[what], fix_checksum=True)
        with pytest.raises(ot.CheckpointError, match="rank file|incomplete|lacks|corrupted"):
            engine.load_checkpoint(tmp_path / "ckpt")


def test_a_flipped_byte_in_a_live_swap_file_stops_the_step_with_the_location(tmp_path: Path) -> None:
    from io_engine import IntegrityError

    with make_engine(tmp_path) as engine:
        step(engine)
        engine.pipeline.wait_all()  # the step's updates, running behind, write the swap file too
        store = engine.tiers.store
        assert store is not None
        key = "g1.param"
        extent = store.extent(key)
        with open(extent.path, "r+b") as f:
            f.seek(extent.offset + 100)
            byte = f.read(1)
            f.seek(extent.offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(IntegrityError) as info:
            step(engine)
        message = str(info.value)
        assert extent.path in message and f"group {engine.groups[1].plan.name!r} param" in message
