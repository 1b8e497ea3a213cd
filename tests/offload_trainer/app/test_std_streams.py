"""offload-train with standard streams that differ from a terminal's: a stdout whose reader went away
(`offload-train | head`), descriptors 0-2 closed at start (`offload-train >&-`). The run goes on
and ends as usual; nothing meant for stdout or stderr lands in a file the run opened."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, List

import pytest

from offload_trainer.app import cli


def test_a_stdout_whose_reader_went_away_stops_the_lines_not_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture, tiny_run_args: Callable[..., List[str]]
) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as after `| head -1` exits
    broken = open(write_end, "w")
    monkeypatch.setattr(sys, "stdout", broken)
    try:
        status = cli.main(tiny_run_args())
    finally:
        broken.close()
    err = capfd.readouterr().err.strip().splitlines()
    assert status == 0
    assert len(err) == 1 and "warning: stdout could not be written" in err[0] and "metrics.jsonl" in err[0]
    out = tmp_path / "out"
    assert (out / "latest").read_text().strip() == "ckpt-000002"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert os.listdir(tmp_path / "swap") == []


CLOSED_FDS = textwrap.dedent(
    """
    import os, sys
    from offload_trainer.app.std_streams import open_closed_std_fds
    was_none = sys.stdout is None and sys.stderr is None
    open_closed_std_fds()
    f = open(sys.argv[1], "w")
    print("to stdout"); print("to stderr", file=sys.stderr); os.write(2, b"from C")
    f.write(str(was_none)); f.close()
    """
)


def test_closed_descriptors_are_pointed_at_dev_null_before_anything_is_opened(tmp_path: Path) -> None:
    target = tmp_path / "file.txt"

    def close_std_fds() -> None:
        os.close(1)
        os.close(2)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", CLOSED_FDS, str(target)], preexec_fn=close_std_fds, env=env, timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0
    assert target.read_text() == "True"  # Python had no streams; what they got went to /dev/null, not here


def test_offload_train_with_stdout_closed_runs_to_the_end(tmp_path: Path, tiny_run_args: Callable[..., List[str]]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "offload_trainer", *tiny_run_args()], preexec_fn=lambda: os.close(1), env=env,
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "out" / "latest").read_text().strip() == "ckpt-000002"


def test_offload_plan_ends_quietly_when_its_reader_went_away(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """`offload-plan | head -1`: exit 2 and "Broken pipe; check the path" before; now the status of a
    program killed by SIGPIPE, and nothing on stderr."""
    from offload_trainer.app import plan_cli
    from offload_trainer.app.std_streams import EXIT_STDOUT_GONE

    read_end, write_end = os.pipe()
    os.close(read_end)
    broken = open(write_end, "w")
    monkeypatch.setattr(sys, "stdout", broken)
    try:
        status = plan_cli.main(["--model.preset", "tiny", "--tiers.nvme_dir", str(tmp_path), "--no-measure"])
    finally:
        broken.close()
    assert status == EXIT_STDOUT_GONE == 141
    assert capfd.readouterr().err == ""
