"""Checkpoints: a resumed run continues bit for bit; corrupted or foreign checkpoints are refused
before anything changes; nothing is ever overwritten."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM


def make_engine(tmp_path: Path, tiers: dict, precision: str = "fp32", seed: int = 0, **model_kw) -> ot.Engine:
    torch.manual_seed(seed)
    model = DecoderLM(DecoderConfig.preset("tiny", **model_kw))
    cfg = ot.OffloadConfig(
        tiers=dict(tiers, nvme_dir=str(tmp_path / f"swap-{seed}")),
        optimizer={"lr": 1e-2, "weight_decay": 0.1, "grad_clip_norm": 1.0},
        precision={"compute_dtype": precision},
        grad_accum_steps=2,
    )
    return ot.initialize(model, cfg)


def batches(first: int, last: int):
    for step in range(first, last):
        g = torch.Generator().manual_seed(100 + step)
        yield [torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)]


def train(engine: ot.Engine, first: int, last: int) -> None:
    for micro_batches in batches(first, last):
        for x in micro_batches:
            engine.backward(engine(x, x.roll(-1, 1))[1] / 2)
        engine.step()


@pytest.mark.parametrize(
    "tiers,precision",
    [
        ({"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "fp32"),
        ({"params": {"host": 0.5, "nvme": 0.5}, "grads": "device", "optimizer": {"host": 0.3, "nvme": 0.7}}, "fp32"),
        ({"params": "host", "grads": "host", "optimizer": "nvme"}, "bf16"),
    ],
)
def test_resume_continues_bit_for_bit(tmp_path, tiers, precision) -> None:
    with make_engine(tmp_path, tiers, precision) as straight:
        train(straight, 0, 2)
        straight.save_checkpoint(tmp_path / "ckpt", extra={"data_position": 2})
        train(straight, 2, 4)
        expected = straight.full_state_dict()
    with make_engine(tmp_path, tiers, precision, seed=1) as resumed:  # other initial weights
        assert resumed.load_checkpoint(tmp_path / "ckpt") == {"data_position": 2}
        assert resumed.global_step == 2
        train(resumed, 2, 4)
        got = resumed.full_state_dict()
    bad = [n for n in expected if not torch.equal(expected[n], got[n])]
    assert not bad, f"resumed run differs: {bad}"


ALL_NVME = {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}


def test_corrupted_checkpoint_is_refused_and_changes_nothing(tmp_path) -> None:
    with make_engine(tmp_path, ALL_NVME) as engine:
        train(engine, 0, 1)
        engine.save_checkpoint(tmp_path / "ckpt")
    data = bytearray((tmp_path / "ckpt" / "rank00000.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "ckpt" / "rank00000.bin").write_bytes(bytes(data))
    with make_engine(tmp_path, ALL_NVME, seed=1) as other:
        before = other.full_state_dict()
        with pytest.raises(ot.CheckpointError, match="fails its checksum"):
            other.load_checkpoint(tmp_path / "ckpt")
        after = other.full_state_dict()
        assert all(torch.equal(before[n], after[n]) for n in before)


def test_bytes_that_change_between_the_check_and_the_load_are_refused(tmp_path, monkeypatch) -> None:
    """load checks every record's CRC32 before it writes a home, then reads the file again to load it:
    a byte changed in between (a file rewritten in place) was loaded unchecked, and the engine trained
    on it. The second read is checked too: the load raises, and the engine refuses to go on from the
    part it wrote until a load completes ([Note: A load that failed part-way] in runtime/engine.py)."""
    from offload_trainer.runtime.persist import checkpoint

    with make_engine(tmp_path, ALL_NVME) as engine:
        train(engine, 0, 1)
        engine.save_checkpoint(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "rank00000.bin"
    real_verify = checkpoint._verify

    def verify_then_change(records) -> None:
        real_verify(records)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    monkeypatch.setattr(checkpoint, "_verify", verify_then_change)
    with make_engine(tmp_path, ALL_NVME, seed=1) as other:
        with pytest.raises(ot.CheckpointError, match="fails its checksum as it is loaded"):
            other.load_checkpoint(tmp_path / "ckpt")
        with pytest.raises(ot.PartialStateError):
            train(other, 1, 2)


def test_truncated_and_missing_checkpoints_are_refused(tmp_path) -> None:
    with make_engine(tmp_path, ALL_NVME) as engine:
        train(engine, 0, 1)
        engine.save_checkpoint(tmp_path / "ckpt")
        with pytest.raises(ot.CheckpointError, match="no manifest.json"):
            engine.load_checkpoint(tmp_path)
        with pytest.raises(ot.CheckpointError, match=r"rank00000.bin is not a checkpoint: it is a file, not a directory; "
                                                      r"name a checkpoint directory \(ckpt-NNNNNN, holding manifest.json\)"):
            engine.load_checkpoint(tmp_path / "ckpt" / "rank00000.bin")
        path = tmp_path / "ckpt" / "rank00000.bin"
        path.write_bytes(path.read_bytes()[:1000])
        with pytest.raises(ot.CheckpointError, match="truncated"):
            engine.load_checkpoint(tmp_path / "ckpt")


def test_checkpoint_of_another_model_is_refused(tmp_path) -> None:
    with make_engine(tmp_path, ALL_NVME) as engine:
        engine.save_checkpoint(tmp_path / "ckpt")
    with make_engine(tmp_path, ALL_NVME, seed=1, n_layers=3) as bigger:
        with pytest.raises(ot.CheckpointError, match="another model"):
            bigger.load_checkpoint(tmp_path / "ckpt")


def test_a_checkpoint_in_new_directories_is_durable_with_them(tmp_path, monkeypatch) -> None:
    """save_checkpoint into directories it makes (a run's first save; offload-train's own out_dir is made
    the same way): each new one's entry is fsynced in its parent, or a power loss could take away the
    checkpoint with them although every file and rename in it was fsynced."""
    import io_engine.atomic_file as atomic_file

    synced: list = []
    real = atomic_file.fsync_dir
    monkeypatch.setattr(atomic_file, "fsync_dir", lambda d: (synced.append(Path(d)), real(d))[1])
    with make_engine(tmp_path, ALL_NVME) as engine:
        engine.save_checkpoint(tmp_path / "runs" / "x" / "ckpt")
    assert synced[:2] == [tmp_path, tmp_path / "runs"], synced
    assert (tmp_path / "runs" / "x" / "ckpt" / "manifest.json").is_file()


def test_checkpoints_are_never_overwritten_and_leave_no_temporary(tmp_path) -> None:
    with make_engine(tmp_path, ALL_NVME) as engine:
        engine.save_checkpoint(tmp_path / "ckpt")
        manifest = (tmp_path / "ckpt" / "manifest.json").read_text()
        train(engine, 0, 1)
        with pytest.raises(ValueError, match="never overwritten"):
            engine.save_checkpoint(tmp_path / "ckpt")
        x = torch.randint(0, 256, (2, 16))
        engine.backward(engine(x, x)[1])
        with pytest.raises(ValueError, match="between micro-batches"):
            engine.save_checkpoint(tmp_path / "ckpt2")
    assert (tmp_path / "ckpt" / "manifest.json").read_text() == manifest
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == []
    assert json.loads(manifest)["config"]["optimizer"]["lr"] == 1e-2


def test_a_checkpoint_named_near_the_name_length_limit_is_saved_and_loaded(tmp_path) -> None:
    """A 250-byte directory name is valid; its temporary (the name, '.tmp-' and 16 hex digits) was not, and
    the save ended with 'File name too long' (io_engine.atomic_file.temporary_prefix cuts it short)."""
    target = tmp_path / ("c" * 250)
    with make_engine(tmp_path, ALL_NVME) as engine:
        engine.save_checkpoint(target)
        engine.load_checkpoint(target)
    assert (target / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == []


def test_a_save_under_a_file_names_the_path_given_not_its_temporary(tmp_path) -> None:
    """The error named `ckpt.tmp-<hex>`, the temporary directory save() makes beside its target: a name
    the caller never gave, and gone by the time they look. It names the file in the way, a part of the
    path given."""
    (tmp_path / "afile").write_text("the user's")
    with make_engine(tmp_path, ALL_NVME) as engine:
        with pytest.raises(NotADirectoryError) as raised:
            engine.save_checkpoint(tmp_path / "afile" / "ckpt")
    assert raised.value.filename == str(tmp_path / "afile"), raised.value
    assert "a file is there, where a directory is needed" in str(raised.value)
    assert ".tmp-" not in str(raised.value)
    assert (tmp_path / "afile").read_text() == "the user's"


def _fail_third_read(monkeypatch, error: BaseException) -> None:
    """Home.read raises `error` at its third call: a save interrupted with a group's shard half written."""
    from offload_trainer.runtime.groups.homes import Home

    real, calls = Home.read, [0]

    def read(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Home, "read", read)


@pytest.mark.parametrize(
    "error", [OSError(28, "No space left on device"), KeyboardInterrupt()], ids=["ENOSPC", "Ctrl-C"]
)
def test_a_save_that_fails_or_is_interrupted_removes_its_temporary(tmp_path, monkeypatch, error) -> None:
    # Each failed save of a script (a disk that fills, Ctrl-C in a notebook) left a temporary
    # directory as large as its shards so far; and where the process id repeats (a container's
    # process 1), one a SIGKILL left made every later save of that name fail with "File exists".
    (tmp_path / f"ckpt.tmp-{os.getpid()}").mkdir()  # a killed process of the same id left it
    with make_engine(tmp_path, ALL_NVME) as engine:
        train(engine, 0, 1)
        with monkeypatch.context() as patched:
            _fail_third_read(patched, error)
            with pytest.raises(type(error)):
                engine.save_checkpoint(tmp_path / "ckpt")
        assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == [f"ckpt.tmp-{os.getpid()}"]
        engine.save_checkpoint(tmp_path / "ckpt")
        assert engine.load_checkpoint(tmp_path / "ckpt") == {}


def _resign(directory: Path, change) -> None:
    """Edit the manifest and give it a matching checksum: a manifest of another version, or one rewritten
    by a tool, which the checksum alone does not catch."""
    from offload_trainer.runtime.persist import checkpoint

    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest["checksum"] = checkpoint._manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda m: m["state"].update(step="x"), "corrupted or of another version: its saved engine state misstates"),
        (lambda m: m["state"].pop("recorded_order"), "its saved engine state lacks 'recorded_order'"),
        (lambda m: m["ranks"][0]["state"].update(optimizer="x"), "corrupted or of another version"),
        (lambda m: m["ranks"][0]["records"][0].update(offset=2**63), r"is truncated: .* at offset 9223372036854775808, found 0"),
        (lambda m: m["ranks"][0]["records"][0].update(numel=2**61), r"is truncated: group 0 param needs 9223372036854775808 bytes"),
        # A checkpoint from before parameters were 256-byte aligned in their group (layout/partition.py).
        (lambda m: m["params"][1].update(offset=m["params"][1]["offset"] + 1), "packed parameters without aligning them"),
        # A checkpoint of another format: which offload-trainer wrote it, and what to do (the message named neither).
        (lambda m: m.update(format=99, written_by={"offload_trainer": "9.0.0"}),
         r"has format 99, written by offload-trainer 9\.0\.0, newer than this one: this offload-trainer \(.*\) reads "
         r"format 2; upgrade offload-trainer to resume from it, or start a new run"),
        (lambda m: m.update(format=1), r"has format 1, written by offload-trainer .*, older than this one: .* resume it "
                                       r"with the version that wrote it, or start a new run"),
        (lambda m: m.update(format="2"), r"is corrupted: its format is '2', which no offload-trainer writes"),
    ],
    ids=["step-not-a-number", "order-missing", "optimizer-state-a-string", "offset-past-2**63", "numel-2**61", "unaligned-layout",
         "format-newer", "format-older", "format-a-string"],
)
def test_a_manifest_with_a_matching_checksum_but_bad_values_is_refused_and_changes_nothing(tmp_path, change, match) -> None:
    # The engine's small state was loaded after the shards were written: a state it refused ended
    # load_checkpoint with int()'s own message and the engine holding the checkpoint's weights with
    # its old step. Offsets and sizes past the file reached seek()/read() (OverflowError, a traceback).
    with make_engine(tmp_path, ALL_NVME) as engine:
        train(engine, 0, 1)
        engine.save_checkpoint(tmp_path / "ckpt")
    _resign(tmp_path / "ckpt", change)
    with make_engine(tmp_path, ALL_NVME, seed=1) as other:
        before, step = other.full_state_dict(), other.global_step
        state, rank_state = other.state_dict(), other.rank_state_dict()
        with pytest.raises(ot.CheckpointError, match=match) as caught:
            other.load_checkpoint(tmp_path / "ckpt")
        assert str(tmp_path / "ckpt") in str(caught.value)
        after = other.full_state_dict()
        assert all(torch.equal(before[n], after[n]) for n in before) and other.global_step == step
        assert other.state_dict() == state and other.rank_state_dict() == rank_state


def test_a_disk_that_fills_mid_save_names_the_file_offset_and_size_and_keeps_the_last_checkpoint(
    tmp_path, monkeypatch
) -> None:
    """ENOSPC part-way through a checkpoint's shards (the disk takes a short write, then refuses): the
    error named the checkpoint's directory only ("[Errno 28] No space left on device"), not which file,
    where in it, nor how much; now a TransferError with the file as it would be in the checkpoint, the
    offset and the size of the write refused. The temporary is gone and the last checkpoint loads."""
    import errno

    from io_engine import TransferError
    from io_engine import sequential_file

    with make_engine(tmp_path, ALL_NVME) as engine:
        train(engine, 0, 1)
        engine.save_checkpoint(tmp_path / "ckpt-1")
        saved = engine.full_state_dict()
        train(engine, 1, 2)
        room = [100_000]  # bytes the disk still takes
        real_write = os.write

        def write(fd, data):
            if room[0] <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = real_write(fd, data[: room[0]])
            room[0] -= n
            return n

        with monkeypatch.context() as full:
            full.setattr(sequential_file.os, "write", write, raising=True)
            with pytest.raises(TransferError) as failed:
                engine.save_checkpoint(tmp_path / "ckpt-2")
        assert room[0] == 0, "the save never met the full disk"
        err = failed.value
        assert err.errno == errno.ENOSPC and err.path == str(tmp_path / "ckpt-2" / "rank00000.bin")
        assert err.offset <= 100_000 < err.offset + err.size_bytes, (err.offset, err.size_bytes)
        assert f"at offset {err.offset} in {err.path}" in str(err) and f"of {err.size_bytes} bytes" in str(err)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt-1"]
    with make_engine(tmp_path, ALL_NVME, seed=1) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt-1")
        got = resumed.full_state_dict()
    assert all(torch.equal(saved[n], got[n]) for n in saved)


def test_a_record_loaded_in_part_is_still_read_and_checked_whole(tmp_path, monkeypatch) -> None:
    """A load onto another number of ranks fills a rank's homes from part of a saved record: the rest
    of the record is read through a small scratch buffer (odd sizes here) so that its CRC32 is checked
    as it is loaded, and a record that changed is refused."""
    import zlib

    from offload_trainer.errors import CheckpointError
    from offload_trainer.runtime.persist import checkpoint

    monkeypatch.setattr(checkpoint, "_SCRATCH_BYTES", 7)
    data = bytes(range(256)) * 4 + b"\x01\x02\x03\x04"
    path = tmp_path / "rank00000.bin"
    path.write_bytes(b"x" * 13 + data)
    record = {"group": 0, "kind": "param", "numel": len(data) // 4, "offset": 13, "crc32": zlib.crc32(data)}
    into = torch.zeros(41 * 4, dtype=torch.uint8)
    checkpoint._read_record(path, record, 4, 4 * 37, into)
    assert bytes(into.numpy()) == data[4 * 37 : 4 * 78]
    with pytest.raises(CheckpointError, match="fails its checksum as it is loaded"):
        checkpoint._read_record(path, dict(record, crc32=record["crc32"] ^ 1), 4, 4 * 37, into)
    with pytest.raises(CheckpointError, match="truncated while it was loaded"):
        checkpoint._read_record(path, dict(record, numel=record["numel"] + 1), 4, 0, into)
