"""offload-train when the swap disk fails under a running step (a disk filled by another process, a
sparse swap file on a file system that cannot preallocate, a dying disk): one line naming the file,
offset, size and the fix, exit status 2, the last checkpoint intact, no swap file left."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from offload_trainer.app import cli
from offload_trainer.app.trainer import Trainer

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40


@pytest.mark.parametrize("err, meaning", [(errno.ENOSPC, "the disk is full"), (errno.EIO, "IO error")])
def test_a_swap_write_that_fails_mid_run_ends_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture, err: int, meaning: str
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text(TEXT)
    out, swap = tmp_path / "out", tmp_path / "swap"
    failing = {"on": False}
    real_pwritev, real_save = os.pwritev, Trainer._save

    def pwritev(fd: int, buffers: object, offset: int) -> int:
        if failing["on"]:
            raise OSError(err, os.strerror(err))
        return real_pwritev(fd, buffers, offset)

    def save(self: Trainer, *args: object, **kwargs: object) -> None:
        real_save(self, *args, **kwargs)
        failing["on"] = True  # the writes of the steps after the first checkpoint fail

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(Trainer, "_save", save)
    status = cli.main([
        "--model.preset", "tiny", "--data.path", str(corpus), "--data.seq_len", "32", "--data.batch_size", "4",
        "--train.steps", "6", "--train.checkpoint_every", "2", "--train.eval_batches", "1",
        "--train.out_dir", str(out), "--tiers.nvme_dir", str(swap), "--no-progress",
    ])
    err_lines = capfd.readouterr().err.strip().splitlines()
    assert status == 2, err_lines
    assert len(err_lines) == 1 and "Traceback" not in err_lines[0]
    line = err_lines[0]
    assert "swap-" in line and " at offset " in line and " bytes " in line and meaning in line
    assert "tiers.nvme_dir" in line
    assert (out / "latest").read_text().strip() == "ckpt-000002"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("ckpt-")) == ["ckpt-000002"]
    assert os.listdir(swap) == []


def test_a_checkpoint_truncated_after_its_check_is_refused_not_loaded_as_zeros(
    tiny_run_args, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards are read twice at load: once for their CRC32s, then into the engine. A rank file cut
    short between the two (another process, a failing disk) filled the rest with zeros, silently:
    the second read's length is checked too, and the resume ends in one line with path, size and offset."""
    from offload_trainer.app.cli import main
    from offload_trainer.runtime.persist import checkpoint

    assert main(tiny_run_args()) == 0
    verify = checkpoint._verify

    def verify_then_truncate(by_key):  # type: ignore[no-untyped-def]
        verify(by_key)
        rank_file = tmp_path / "out" / "ckpt-000002" / "rank00000.bin"
        os.truncate(rank_file, rank_file.stat().st_size // 2)

    monkeypatch.setattr(checkpoint, "_verify", verify_then_truncate)
    capsys.readouterr()
    assert main(tiny_run_args("--resume", "latest", "--train.steps", "3")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rank00000.bin was truncated while it was loaded" in err[0] and "at offset" in err[0], err


def test_a_note_made_an_error_by_the_warnings_filter_ends_in_one_line(
    tiny_run_args, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """PYTHONWARNINGS=error (a CI job's environment) with the swap directory on a file system that refuses
    O_DIRECT (tmpfs before Linux 6.6): the fallback's note became an exception that ended the run with a
    traceback and exit status 1."""
    import warnings

    import io_engine.file

    real_open = io_engine.file.os.open

    def refuse_o_direct(path: str, flags: int, *args: object, **kwargs: object) -> int:
        if flags & io_engine.file._O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(io_engine.file, "_O_DIRECT", io_engine.file._O_DIRECT or 0o40000)
    monkeypatch.setattr(io_engine.file.os, "open", refuse_o_direct)
    warnings.simplefilter("error")  # pytest restores the filters after the test
    status = cli.main(tiny_run_args())
    err_lines = capfd.readouterr().err.strip().splitlines()
    assert status == 2 and len(err_lines) == 1, err_lines
    assert "refused O_DIRECT" in err_lines[0] and "PYTHONWARNINGS=error" in err_lines[0]
    assert os.listdir(tmp_path / "swap") == []
