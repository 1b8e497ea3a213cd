"""offload-train on two ranks (gloo, CPU) when one of them stops answering: the other ends within
train.dist_timeout_s with a line naming the rank and removes its swap files, and the run resumes
from its last checkpoint; killed (SIGKILL) at named moments, mid-step or mid-checkpoint, either
rank, the run resumes to the uninterrupted run's checkpoints, metrics and export, bit for bit.
Ranks are started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) but without
torchrun, so that nothing else tears them down."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from tests.command_lines import argv_with

from tests.offload_trainer.app.test_kill_moments import LAUNCHER, _records

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 10
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40


def _corpus(root: Path) -> Path:
    d = root / "corpus"
    d.mkdir()
    for i in range(6):
        (d / f"doc{i}.py").write_text(f"# document {i}\n" + TEXT)
    return d


def _exit_codes(procs: List[subprocess.Popen], timeout: float) -> List[int]:
    """Each process's exit code, waiting at most `timeout` seconds for each; any still running then
    (a test that failed) is killed."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _args(root: Path, steps: int, *extra: str) -> List[str]:
    return argv_with([
        "--model.preset", "tiny", "--data.path", str(root / "corpus"), "--data.seq_len", "32",
        "--data.batch_size", "4", "--train.steps", str(steps), "--train.checkpoint_every", "2",
        "--train.eval_batches", "1", "--train.out_dir", str(root / "run"), "--tiers.nvme_dir", str(root / "swap"),
        "--train.dist_timeout_s", str(TIMEOUT_S), "--no-progress",
    ], *extra)


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
    # Rank 0's swap directory is gone; rank 1's (killed) is reclaimed as rank 0's store closes
    # (FileStore.close), or else by the next run's store.
    left = _swap_dirs(tmp_path)
    assert len(left) <= 1
    latest = (tmp_path / "run" / "latest").read_text()
    step = int(latest.split("-")[1])
    resumed = subprocess.run(
        [sys.executable, "-m", "offload_trainer", *_args(tmp_path, step + 1, "--resume", "latest")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "run" / "latest").read_text() == f"ckpt-{step + 1:06d}"
    assert _swap_dirs(tmp_path) == []
    if left:
        assert f"removed {len(left)} swap directories of dead runs" in resumed.stderr, resumed.stderr


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
    codes = _exit_codes(procs, timeout=240)
    errs = [(tmp_path / f"rank{r}.err").read_text() for r in range(2)]
    assert codes == [0, 0], errs
    assert (tmp_path / "run" / "latest").read_text() == "ckpt-000002"


KILLS = {  # moment: (KILL_AT, the rank, the signal, when the lines say it happened)
    # Rank 1 has written its shard of ckpt-000002, not yet its part of the manifest; rank 0 waits.
    "rank 1 mid-checkpoint": ("offload_trainer.runtime.persist.checkpoint:open_exclusive:4", 1, "SIGKILL", "while saving ckpt-000002"),
    # Rank 0 (the store's host) has ckpt-000002 complete under its temporary name, not renamed yet.
    "rank 0 mid-checkpoint": ("offload_trainer.runtime.persist.checkpoint:fsync_dir:3", 0, "SIGKILL", "while saving ckpt-000002"),
    # Between the ranks' commits: rank 1's part of ckpt-000002's manifest is written, rank 0 (the
    # store's host) killed as it opens the manifest that joins the parts.
    "rank 0 mid-manifest": ("offload_trainer.runtime.persist.checkpoint:open_exclusive:6", 0, "SIGKILL", "while saving ckpt-000002"),
    # Rank 1 between its forward and backward of step 3.
    "rank 1 mid-step": ("offload_trainer.runtime.engine:Engine.backward:3", 1, "SIGKILL", "during step 3"),
    # A signal to one rank alone as the shards of ckpt-000002 are written: the rank interrupted
    # removes its part of the temporary directory, never the other's, which finds it gone at its
    # next collective (it once failed with "No such file or directory ... check train.out_dir", exit 2).
    "rank 0 Ctrl-C mid-checkpoint": ("offload_trainer.runtime.persist.checkpoint:open_exclusive:4", 0, "SIGINT", "while saving ckpt-000002"),
    "rank 1 SIGTERM mid-checkpoint": ("offload_trainer.runtime.persist.checkpoint:open_exclusive:3", 1, "SIGTERM", "while saving ckpt-000002"),
    # After the last step's save, as the export gathers its second group: rank 0 has its new
    # model.safetensors half written under a temporary name; the resume (at its last step) exports again.
    "rank 1 mid-export": (
        "offload_trainer.runtime.persist.export:group_parameters:2", 1, "SIGKILL", "while exporting the weights"
    ),
    "rank 0 SIGTERM mid-export": (
        "offload_trainer.runtime.persist.export:group_parameters:2", 0, "SIGTERM", "while exporting the weights"
    ),
}
KILL_STEPS = 4


def _run_ranks(root: Path, *extra: str, kill: Optional[Tuple[str, int, str, str]] = None) -> List[int]:
    """Both ranks of a KILL_STEPS-step run (LAUNCHER: killed at `kill`'s moment in its rank); their exit
    codes. A rank that hangs fails the test (TimeoutExpired) instead of holding it."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", KILL_MARK=str(root / "killed"))
        for name in ("KILL_AT", "KILL_MATCH", "KILL_RANK", "KILL_SIGNAL"):
            env.pop(name, None)
        if kill is not None:
            env.update(KILL_AT=kill[0], KILL_RANK=str(kill[1]), KILL_SIGNAL=kill[2])
        procs.append(subprocess.Popen(
            [sys.executable, "-c", LAUNCHER,
             *_args(root, KILL_STEPS, "--train.checkpoint_every", "1", "--train.keep_last", "0", *extra)],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(root / f"rank{rank}.err", "w"),
        ))
    return _exit_codes(procs, timeout=300)


@pytest.fixture(scope="module")
def straight_ranks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("straight")
    _corpus(root)
    codes = _run_ranks(root)
    assert codes == [0, 0], [(root / f"rank{r}.err").read_text()[-2000:] for r in range(2)]
    return root / "run"


@pytest.mark.slow  # two runs of two ranks each (and the uninterrupted one once): 60-90 s each
@pytest.mark.parametrize("moment", sorted(KILLS))
def test_a_rank_killed_mid_step_or_mid_checkpoint_ends_the_other_and_resumes_bit_for_bit(
    tmp_path: Path, straight_ranks: Path, moment: str
) -> None:
    _corpus(tmp_path)
    kill = KILLS[moment]
    codes = _run_ranks(tmp_path, kill=kill)
    survivor = 1 - kill[1]
    err = (tmp_path / f"rank{survivor}.err").read_text()
    assert (tmp_path / "killed").exists(), err
    signum = signal.Signals[kill[2]]
    ended = -signum if signum == signal.SIGKILL else 128 + signum  # 130 for Ctrl-C, 143 for SIGTERM
    assert codes[kill[1]] == ended and codes[survivor] == 1, (codes, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    gone = "rank 1 stopped answering" if kill[1] == 1 else "rank 0 (which hosts it)"
    assert f"rank {survivor}:" in lines[0] and gone in lines[0] and "--resume latest" in lines[0], lines[0]
    assert f"a collective failed {kill[3]} (" in lines[0], lines[0]
    if signum != signal.SIGKILL:
        said = (tmp_path / f"rank{kill[1]}.err").read_text().strip().splitlines()
        name = "Ctrl-C" if signum == signal.SIGINT else signum.name
        assert len(said) == 1 and f"interrupted by {name} {kill[3]};" in said[0] and "--resume latest" in said[0], said
    run = tmp_path / "run"
    assert not list(run.glob("*.tmp-*")), sorted(os.listdir(run))
    for checkpoint in run.glob("ckpt-*"):
        assert _records(checkpoint) == _records(straight_ranks / checkpoint.name), checkpoint.name
    latest = (run / "latest").read_text()
    assert (run / latest / "manifest.json").is_file()

    codes = _run_ranks(tmp_path, "--resume", "latest")
    assert codes == [0, 0], [(tmp_path / f"rank{r}.err").read_text()[-2000:] for r in range(2)]
    name = f"ckpt-{KILL_STEPS:06d}"
    assert _records(run / name) == _records(straight_ranks / name)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (straight_ranks / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "lr", "grad_norm", "eval_loss")
    assert [[r.get(k) for k in keys] for r in steps] == [[r.get(k) for k in keys] for r in again]
    assert (run / "model.safetensors").read_bytes() == (straight_ranks / "model.safetensors").read_bytes()
    assert _swap_dirs(tmp_path) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_interrupted_alone_removes_no_file_rank_0_is_writing(tmp_path: Path, monkeypatch, rank: int) -> None:
    """A signal to rank 1 alone, between two collectives, while rank 0 writes `latest` (or config.json,
    the export) through an atomic file: rank 1 removed rank 0's temporary on its way out, rank 0's
    rename then failed with "No such file or directory ... check train.out_dir" (exit 2) and `latest`
    was never written (seen with the rank kill sweep: a 3 s pause in rank 0's rename, SIGTERM to rank
    1 as it took its next batch). Rank 0 itself, interrupted, still removes what it left."""
    from offload_trainer.app.ranks import Ranks
    from offload_trainer.app.run_config import RunConfig
    from offload_trainer.app.signals import Terminated
    from offload_trainer.app.trainer import Trainer

    run = tmp_path / "run"
    run.mkdir()
    writing = run / "latest.tmp-0123456789abcdef"  # rank 0's write_atomic, under way

    def interrupted(self, ranks):  # the run: rank 0 starts writing `latest`, then this rank gets SIGTERM
        writing.write_text("ckpt-000001")
        raise Terminated(signal.SIGTERM)

    monkeypatch.setattr(Trainer, "_run", interrupted)
    ranks = Ranks(rank=rank, world_size=2, timeout_s=10.0)  # not joined: no collective runs here
    trainer = Trainer(RunConfig().with_overrides({"train.out_dir": str(run)}), ranks=ranks)
    with pytest.raises(Terminated):
        trainer.run()
    assert writing.exists() == (rank == 1)


def _run_one(root: Path, *extra: str, kill: Optional[Tuple[str, str]] = None) -> int:
    """One rank (no RANK or WORLD_SIZE, as a plain offload-train) of the same KILL_STEPS-step run as
    _run_ranks, killed at `kill` (KILL_AT, KILL_SIGNAL); its exit code."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "KILL_AT", "KILL_MATCH",
                                                          "KILL_RANK", "KILL_SIGNAL")}
    env.update(OMP_NUM_THREADS="1", KILL_MARK=str(root / "killed"))
    if kill is not None:
        env.update(KILL_AT=kill[0], KILL_SIGNAL=kill[1])
    with open(root / "rank0.err", "w") as log:
        return subprocess.run(
            [sys.executable, "-c", LAUNCHER,
             *_args(root, KILL_STEPS, "--train.checkpoint_every", "1", "--train.keep_last", "0", *extra)],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log, timeout=300,
        ).returncode


def _back_to(source: Path, root: Path, step: int) -> None:
    """root/run as `source` (a finished run) was when ckpt-{step} was its newest checkpoint."""
    import shutil

    shutil.copytree(source, root / "run", ignore=shutil.ignore_patterns("*.safetensors", "trace*"))
    for later in (root / "run").glob("ckpt-*"):
        if int(later.name.split("-")[1]) > step:
            shutil.rmtree(later)
    (root / "run" / "latest").write_text(f"ckpt-{step:06d}")
    metrics = root / "run" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= step))


def _same_run(run: Path, reference: Path) -> None:
    name = f"ckpt-{KILL_STEPS:06d}"
    assert _records(run / name) == _records(reference / name)
    keys = ("step", "loss", "lr", "grad_norm", "eval_loss")
    logged = [[json.loads(line).get(k) for k in keys] for line in (run / "metrics.jsonl").read_text().splitlines()]
    expected = [[json.loads(line).get(k) for k in keys] for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert logged == expected
    assert (run / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert not list(run.glob("*.tmp-*"))


@pytest.mark.slow  # four runs each (two of two ranks): 60-120 s each
@pytest.mark.parametrize("ranks_before", [2, 1])
def test_a_run_killed_mid_step_resumes_bit_for_bit_on_another_number_of_ranks(tmp_path: Path, ranks_before: int) -> None:
    """Two ranks SIGKILLed in step 3 (rank 1 between its forward and backward; rank 0 ends with its
    one line), resumed on one rank; and one rank killed there, resumed on two. The resume ends with
    the checkpoint, metrics and export of the uninterrupted run that switched the number of ranks
    at the same checkpoint (ckpt-000002): nothing the kill left changes the resumed run."""
    straight, reference, killed = (tmp_path / name for name in ("straight", "reference", "killed"))
    for root in (straight, reference, killed):
        root.mkdir()
        _corpus(root)
    run_before = _run_ranks if ranks_before == 2 else (lambda root, *extra, kill=None: [_run_one(root, *extra)])
    run_after = _run_one if ranks_before == 2 else (lambda root, *extra: _run_ranks(root, *extra))
    assert set(run_before(straight)) == {0}, (straight / "rank0.err").read_text()[-2000:]
    _back_to(straight / "run", reference, 2)
    done = run_after(reference, "--resume", "latest")
    assert done in (0, [0, 0]), (reference / "rank0.err").read_text()[-2000:]

    step3 = "offload_trainer.runtime.engine:Engine.backward:3"
    if ranks_before == 2:
        codes = _run_ranks(killed, kill=(step3, 1, "SIGKILL", "during step 3"))
        assert codes == [1, -signal.SIGKILL], codes
        line = (killed / "rank0.err").read_text().strip().splitlines()
        assert len(line) == 1 and "rank 1 stopped answering" in line[0], line
    else:
        assert _run_one(killed, kill=(step3, "SIGKILL")) == -signal.SIGKILL
    assert (killed / "killed").exists() and (killed / "run" / "latest").read_text() == "ckpt-000002"
    resumed = run_after(killed, "--resume", "latest")
    assert resumed in (0, [0, 0]), [(killed / f"rank{r}.err").read_text()[-2000:] for r in range(2) if (killed / f"rank{r}.err").exists()]
    _same_run(killed / "run", reference / "run")
    assert _swap_dirs(killed) == []


@pytest.mark.parametrize("written", [False, True])
def test_a_rank_lost_says_how_to_continue_from_what_is_on_disk(tmp_path: Path, monkeypatch, written: bool) -> None:
    """A peer lost before anything was written (rank 1 SIGKILLed while building its model: rank 0's next
    collective fails): rank 0's line said "resume with --resume latest" where there is nothing to
    resume (--resume latest then refused: "has no checkpoint yet"). It now says what the trainer says
    for what is on disk: nothing written, or the checkpoint to resume from."""
    from offload_trainer.app.ranks import RankFailure, Ranks
    from offload_trainer.app.run_config import RunConfig
    from offload_trainer.app.trainer import Trainer

    run = tmp_path / "run"
    if written:
        (run / "ckpt-000002").mkdir(parents=True)
        (run / "ckpt-000002" / "manifest.json").write_text("{}")
        (run / "latest").write_text("ckpt-000002")

    def lost(self, ranks):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:19592")

    monkeypatch.setattr(Trainer, "_run", lost)
    ranks = Ranks(rank=0, world_size=2, timeout_s=10.0)  # not joined: no collective runs here
    with pytest.raises(RankFailure) as failed:
        Trainer(RunConfig().with_overrides({"train.out_dir": str(run)}), ranks=ranks).run()
    line = str(failed.value)
    assert "a collective failed while starting (Connection closed by peer" in line, line
    if written:
        assert line.endswith("resume with --resume latest (the newest checkpoint is ckpt-000002)"), line
    else:
        assert line.endswith("nothing was written: run the same command again"), line


@pytest.mark.slow  # one run of two ranks, ~15 s
def test_rank_0_killed_right_after_the_join_leaves_the_other_with_its_one_line(tmp_path: Path) -> None:
    """Rank 0 (the store's host) SIGKILLed as it builds its model, right after the ranks joined: rank 1's
    heartbeat thread was still connecting to the store, and c10d's client printed its retries with
    stack traces (some thirty lines) above rank 1's line. Rank 1 ends with that one line only, saying
    that nothing was written."""
    _corpus(tmp_path)
    codes = _run_ranks(tmp_path, kill=("offload_trainer.app.trainer:build_causal_lm:1", 0, "SIGKILL", ""))
    err = (tmp_path / "rank1.err").read_text()
    assert (tmp_path / "killed").exists() and codes == [-signal.SIGKILL, 1], (codes, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("offload-train: rank 1: ") and lines[0].endswith("nothing was written: run the same command again")
    assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run")
