"""offload-train on two ranks (gloo, CPU) when one of them stops answering: the other ends within
train.dist_timeout_s with a line naming the rank and removes its swap files, and the run resumes
from its last checkpoint. Ranks are started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) but without torchrun, so that nothing else tears them down."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 10
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40


def _corpus(root: Path) -> Path:
    d = root / "corpus"
    d.mkdir()
    for i in range(6):
        (d / f"doc{i}.py").write_text(f"# document {i}\n" + TEXT)
    return d


def _args(root: Path, steps: int, *extra: str) -> List[str]:
    return [
        "--model.preset", "tiny", "--data.path", str(root / "corpus"), "--data.seq_len", "32",
        "--data.batch_size", "4", "--train.steps", str(steps), "--train.checkpoint_every", "2",
        "--train.eval_batches", "1", "--train.out_dir", str(root / "run"), "--tiers.nvme_dir", str(root / "swap"),
        "--train.dist_timeout_s", str(TIMEOUT_S), "--no-progress", *extra,
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ranks(root: Path, steps: int) -> List[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(root / f"rank{rank}.err", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "offload_trainer", *_args(root, steps)], cwd=REPO, env=env,
            stdout=subprocess.DEVNULL, stderr=log,
        ))
    return procs


def _wait_for_step(root: Path, procs: List[subprocess.Popen], step: int) -> None:
    metrics = root / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.05)
    errs = "\n".join("rank %d (exit %s): %s" % (r, p.poll(), (root / f"rank{r}.err").read_text()[-3000:]) for r, p in enumerate(procs))
    raise AssertionError("the ranks did not reach step %d:\n%s" % (step, errs))


def _swap_dirs(root: Path) -> List[str]:
    return sorted(p.name for p in (root / "swap").glob("offload-swap-*"))


@pytest.mark.parametrize("how", [pytest.param("stopped", marks=pytest.mark.slow), "killed"])  # stopped: 26 s
def test_a_rank_that_stops_answering_ends_the_other_with_its_name_and_the_run_resumes(tmp_path: Path, how: str) -> None:
    _corpus(tmp_path)
    procs = _start_ranks(tmp_path, steps=10_000)
    try:
        _wait_for_step(tmp_path, procs, 3)  # past the first checkpoint (ckpt-000002)
        mine = {p.pid for p in procs}
        assert procs[1].pid in mine
        os.kill(procs[1].pid, signal.SIGSTOP if how == "stopped" else signal.SIGKILL)
        start = time.monotonic()
        status = procs[0].wait(timeout=TIMEOUT_S + 60)
        took = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    err = (tmp_path / "rank0.err").read_text()
    assert status == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "rank 0:" in lines[0] and "rank 1 stopped answering" in lines[0] and "--resume latest" in lines[0], lines[0]
    # A stopped rank holds its peers for the timeout, a dead one releases them at once; the wait
    # above bounds both (no tighter wall-clock bound: a loaded machine stretches any of them).
    assert took < TIMEOUT_S + 60, took
    assert not list((tmp_path / "run").glob("*.tmp-*"))
    # Rank 0's swap directory is gone; rank 1's (killed) is reclaimed by the next run.
    assert len(_swap_dirs(tmp_path)) <= 1
    latest = (tmp_path / "run" / "latest").read_text()
    step = int(latest.split("-")[1])
    resumed = subprocess.run(
        [sys.executable, "-m", "offload_trainer", *_args(tmp_path, step + 1, "--resume", "latest")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "run" / "latest").read_text() == f"ckpt-{step + 1:06d}"
    assert _swap_dirs(tmp_path) == []
    if how == "killed":
        assert "removed 1 swap directories of dead runs" in resumed.stderr, resumed.stderr


# Rank 1 starts its checks late, as a loaded machine may delay one rank: rank 0 must not write the
# run's files (config.json, metrics.jsonl) before every rank has checked that out_dir is free.
LATE_CHECKS = r"""
import runpy, sys, time
import offload_trainer.app.run_checks as run_checks
original = run_checks.check_run_dir
def late(*args, **kwargs):
    time.sleep(8.0)
    return original(*args, **kwargs)
if sys.argv[1] == "1":
    run_checks.check_run_dir = late
sys.argv = ["offload_trainer", *sys.argv[2:]]
runpy.run_module("offload_trainer", run_name="__main__", alter_sys=True)
"""


def test_a_rank_whose_checks_run_late_sees_an_out_dir_the_other_has_not_written_yet(tmp_path: Path) -> None:
    _corpus(tmp_path)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", LATE_CHECKS, str(rank), *_args(tmp_path, 2)], cwd=REPO, env=env,
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"rank{rank}.err", "w"),
        ))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errs = [(tmp_path / f"rank{r}.err").read_text() for r in range(2)]
    assert codes == [0, 0], errs
    assert (tmp_path / "run" / "latest").read_text() == "ckpt-000002"
