"""One offload-train per train.out_dir: a second run started while the first lives (a scheduler's
retry, the same command twice) is refused in one line and touches nothing of the first's."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Callable, List

import pytest

from offload_trainer.app import cli
from offload_trainer.app.run_lock import OutDirLock

def _snapshot(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("second", [("--resume", "latest"), ("--train.overwrite", "true")])
def test_a_second_run_in_a_live_runs_out_dir_is_refused_and_changes_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture, second: tuple, tiny_run_args: Callable[..., List[str]]
) -> None:
    assert cli.main(tiny_run_args()) == 0
    out = tmp_path / "out"
    (out / "ckpt-000003.tmp-4242").mkdir()  # the live run's checkpoint, half written
    before = _snapshot(out)
    capfd.readouterr()
    live = os.open(out, os.O_RDONLY)  # the first run, still alive, holds the directory's lock
    try:
        fcntl.flock(live, fcntl.LOCK_EX | fcntl.LOCK_NB)
        status = cli.main(tiny_run_args("--train.steps", "4", *second))
    finally:
        os.close(live)
    err = capfd.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and "is in use by another offload-train run" in err[0] and "train.out_dir" in err[0]
    assert _snapshot(out) == before
    assert cli.main(tiny_run_args("--train.steps", "3", "--resume", "latest")) == 0  # once it ended: fine


def test_the_lock_is_released_and_taken_again(tmp_path: Path) -> None:
    first, second = OutDirLock(tmp_path), OutDirLock(tmp_path)
    first.acquire()
    assert first.held
    with pytest.raises(ValueError, match="in use by another offload-train run"):
        second.acquire()
    first.release()
    second.acquire()
    assert second.held
    second.release()
    OutDirLock(tmp_path / "not made yet").acquire()  # nothing to lock yet: no error, nothing made
    assert not (tmp_path / "not made yet").exists()


def test_a_run_refused_after_another_made_out_dir_leaves_that_runs_temporaries(
    tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
    tiny_run_args: Callable[..., List[str]],
) -> None:
    """Two fresh runs racing: out_dir did not exist when this one started (so its list of
    temporaries to clean up on failure was empty), and the other made it, locked it and began a
    checkpoint before this one reached out_dir. The refusal must not take that checkpoint's
    temporary directory for this run's leftover."""
    from offload_trainer.app import trainer

    out = tmp_path / "out"
    held: List[int] = []
    original = trainer.check_run

    def other_run_arrives(*args, **kwargs):  # type: ignore[no-untyped-def]
        checkpoint = original(*args, **kwargs)
        out.mkdir()
        held.append(os.open(out, os.O_RDONLY))
        fcntl.flock(held[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
        (out / "ckpt-000001.tmp-4242").mkdir()
        return checkpoint

    monkeypatch.setattr(trainer, "check_run", other_run_arrives)
    try:
        status = cli.main(tiny_run_args())
    finally:
        for fd in held:
            os.close(fd)
    assert status == 2 and "is in use by another offload-train run" in capfd.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-000001.tmp-4242"]
