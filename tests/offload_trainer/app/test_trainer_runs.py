"""offload-train's runs end cleanly however they end, and its out_dir stays coherent:

- SIGTERM and SIGHUP end a run like Ctrl-C: exit 143 / 129, one line, no swap directory and no
  temporary file left, mid-step or mid-save, and the run resumes to bitwise the state of an
  uninterrupted one; Ctrl-C before the first checkpoint says to start over, not to resume; a signal
  while torch is imported, during the export or while the summary is printed ends with one line
  too, saying what is on disk;
- a non-finite step stops the run (exit 2, nothing saved after it) or is skipped, as
  train.on_nonfinite says;
- a fresh run into a run's directory is refused unless train.overwrite, which replaces that run;
  a resume from an earlier checkpoint leaves metrics.jsonl with each step once and `latest` naming
  the newest checkpoint written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from tests.command_lines import argv_with

REPO = Path(__file__).resolve().parents[3]
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40


def _corpus(root: Path) -> None:
    d = root / "corpus"
    d.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        (d / f"doc{i}.py").write_text(f"# document {i}\n" + TEXT)


def _args(root: Path, steps: int, *extra: str) -> List[str]:
    return argv_with([
        "--model.preset", "tiny", "--data.path", str(root / "corpus"), "--data.seq_len", "32",
        "--data.batch_size", "4", "--train.steps", str(steps), "--train.checkpoint_every", "1",
        "--train.eval_batches", "1", "--train.out_dir", str(root / "run"), "--tiers.nvme_dir", str(root / "swap"),
        "--no-progress",
    ], *extra)


def _train(root: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "offload_trainer", *_args(root, steps, *extra)], cwd=REPO, capture_output=True,
        text=True, timeout=300,
    )


def _records(run: Path, step: int) -> list:
    manifest = json.loads((run / f"ckpt-{step:06d}" / "manifest.json").read_text())
    return [(r["group"], r["kind"], r["crc32"]) for part in manifest["ranks"] for r in part["records"]]


def _steps(run: Path) -> List[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _left(root: Path) -> List[str]:
    found = list((root / "swap").glob("offload-swap-*")) if (root / "swap").exists() else []
    found += list((root / "run").glob("*.tmp-*")) if (root / "run").exists() else []
    return [str(p) for p in found]


def _signal_when(root: Path, signum: int, mid_save: bool, log: Path, *extra: str) -> subprocess.Popen:
    """Start a run, and send `signum` once a checkpoint exists: at once, or as soon as a save is under way."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "offload_trainer", *_args(root, 8, *extra)], cwd=REPO, stdout=subprocess.DEVNULL,
            stderr=out,
        )
    run = root / "run"
    deadline = time.monotonic() + 240
    before = (run / "latest").read_text() if (run / "latest").exists() else None
    while proc.poll() is None and time.monotonic() < deadline:
        latest = (run / "latest").read_text() if (run / "latest").exists() else None
        if latest is not None and latest != before:
            if not mid_save or any(".tmp-" in name for name in os.listdir(run)):
                break
        time.sleep(0.001)
    proc.send_signal(signum)
    proc.wait(timeout=120)
    return proc


@pytest.mark.slow  # 24-31 s; the default run keeps test_trainer's random-moment kills
def test_sigterm_and_sighup_mid_step_and_mid_save_clean_up_and_resume_exactly(tmp_path: Path) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _corpus(straight)
    _corpus(killed)
    assert _train(straight, 8).returncode == 0

    for attempt, (signum, mid_save) in enumerate(
        [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGHUP, True)]
    ):
        log = tmp_path / f"attempt{attempt}.err"
        resume = ["--resume", "latest"] if (killed / "run" / "latest").exists() else []
        proc = _signal_when(killed, signum, mid_save, log, *resume)
        err = log.read_text()
        if proc.returncode == 0:
            continue  # the run finished before the signal landed: nothing to check
        assert proc.returncode == 128 + signum, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert signal.Signals(signum).name in lines[0] and "--resume latest" in lines[0], lines[0]
        assert _left(killed) == [], "left behind after %s" % signal.Signals(signum).name
        name = (killed / "run" / "latest").read_text()
        assert (killed / "run" / name / "manifest.json").is_file()
    resumed = _train(killed, 8, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _records(killed / "run", 8) == _records(straight / "run", 8)
    assert _steps(killed / "run") == list(range(1, 9)), "metrics.jsonl holds each step once"
    assert _left(killed) == []


def test_ctrl_c_before_the_first_checkpoint_says_to_start_over(tmp_path: Path) -> None:
    _corpus(tmp_path)
    log = tmp_path / "run.err"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "offload_trainer", *_args(tmp_path, 10_000, "--train.checkpoint_every", "0")],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=out,
        )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    err = log.read_text().strip()
    assert len(err.splitlines()) == 1 and "--train.overwrite true" in err and "--resume latest" not in err, err
    assert _left(tmp_path) == []
    again = _train(tmp_path, 1)
    assert again.returncode == 2 and "--train.overwrite true" in again.stderr, again.stderr
    over = _train(tmp_path, 1, "--train.overwrite", "true")
    assert over.returncode == 0, over.stderr[-3000:]
    assert _steps(tmp_path / "run") == [1]


def test_a_non_finite_step_stops_the_run_unsaved_or_is_skipped(tmp_path: Path) -> None:
    _corpus(tmp_path)
    # out_dir and nvme_dir as symlinks to directories, as scratch space often is: followed.
    for name in ("run", "swap"):
        (tmp_path / f"real-{name}").mkdir()
        os.symlink(tmp_path / f"real-{name}", tmp_path / name)
    # lr 1e30: the first update makes the weights huge, so the second step's gradients overflow.
    stop = _train(tmp_path, 4, "--optimizer.lr", "1e30")
    assert stop.returncode == 2, stop.stderr[-3000:]
    lines = stop.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stop.stderr, stop.stderr
    assert "step 2:" in lines[0] and "optimizer.lr" in lines[0] and "--resume latest (ckpt-000001)" in lines[0]
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000001"]
    assert (run / "latest").read_text() == "ckpt-000001" and not (run / "model.safetensors").exists()
    assert _left(tmp_path) == []

    skip = _train(tmp_path, 4, "--optimizer.lr", "1e30", "--train.on_nonfinite", "skip", "--train.overwrite", "true")
    assert skip.returncode == 0, skip.stderr[-3000:]
    assert "non-finite steps skipped: 3 (2, 3, 4)" in skip.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("nonfinite", False) for r in records] == [False, True, True, True]
    assert (tmp_path / "real-run" / "latest").read_text() == "ckpt-000004" and (tmp_path / "run").is_symlink()


@pytest.mark.slow  # 24-31 s; the default run keeps test_trainer's random-moment kills
def test_overwrite_replaces_a_run_and_a_resume_from_an_earlier_checkpoint_keeps_the_dir_coherent(
    tmp_path: Path,
) -> None:
    _corpus(tmp_path)
    run = tmp_path / "run"
    assert _train(tmp_path, 4).returncode == 0
    first = _records(run, 4)
    # Resume from ckpt-000002 of a run that went on to ckpt-000004: steps 3 and 4 are run again,
    # their checkpoints replaced (bitwise the same here: same data, same seed), metrics not doubled.
    again = _train(tmp_path, 3, "--resume", str(run / "ckpt-000002"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert (run / "latest").read_text() == "ckpt-000003", "latest names the newest checkpoint written"
    assert _steps(run) == [1, 2, 3]
    assert _train(tmp_path, 4, "--resume", "latest").returncode == 0
    assert _records(run, 4) == first and _steps(run) == [1, 2, 3, 4]
    assert not list(run.glob("*.tmp-*"))
    # Continued without an export: step 4's export goes, instead of staying beside ckpt-000005.
    assert (run / "model.safetensors").is_file()
    more = _train(tmp_path, 5, "--resume", "latest", "--train.export_dtype", "none")
    assert more.returncode == 0, more.stderr[-3000:]
    assert not (run / "model.safetensors").exists() and (run / "latest").read_text() == "ckpt-000005"

    (run / "notes.txt").write_text("mine")
    over = _train(tmp_path, 1, "--train.overwrite", "true", "--train.export_dtype", "none")
    assert over.returncode == 0, over.stderr[-3000:]
    kept = ["ckpt-000001", "config.json", "latest", "metrics.jsonl", "notes.txt"]
    assert sorted(p.name for p in run.iterdir()) == kept
    assert _steps(run) == [1]


@pytest.mark.slow  # two short runs, ~15 s; test_run_dir checks what --resume auto picks, without a run
def test_resume_auto_starts_a_run_then_continues_it_with_the_same_command(tmp_path: Path) -> None:
    _corpus(tmp_path)
    first = _train(tmp_path, 2, "--resume", "auto")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _train(tmp_path, 3, "--resume", "auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from ckpt-000002" in again.stdout, again.stdout[-2000:]
    assert _steps(tmp_path / "run") == [1, 2, 3] and (tmp_path / "run" / "latest").read_text() == "ckpt-000003"


SIGNAL_DURING_IMPORT = r"""
import importlib.abc, os, runpy, signal, sys
class SignalAtImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["SIGNAL_AT_IMPORT"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.Signals[os.environ["SIGNAL"]])
        return None
sys.meta_path.insert(0, SignalAtImport())
sys.argv = ["offload_trainer", *sys.argv[1:]]
runpy.run_module("offload_trainer", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("signame, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_while_torch_is_imported_ends_with_one_line(tmp_path: Path, signame: str, status: int) -> None:
    """The first seconds of offload-train import torch: SIGTERM there killed it without a word (the
    handlers came later), Ctrl-C printed a traceback."""
    env = {**os.environ, "SIGNAL_AT_IMPORT": "torch", "SIGNAL": signame}
    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_DURING_IMPORT, *_args(tmp_path, 2)], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=300,
    )
    name = "Ctrl-C" if signame == "SIGINT" else signame
    assert done.returncode == status, (done.returncode, done.stderr[-3000:])
    assert done.stderr.strip() == (
        f"offload-train: interrupted by {name} while starting; nothing was written: run the same command again"
    ), done.stderr
    assert not (tmp_path / "run").exists()


LAST_MOMENTS = [
    # (KILL_AT of test_kill_moments' LAUNCHER, what the line says after "interrupted by SIGTERM ")
    ("offload_trainer.runtime.persist.export:group_parameters:2",
     "while exporting the weights; the swap files and partial files were removed; every step is saved "
     "(ckpt-000002) but the export to {run}/model.safetensors is not written (what was there is as it was): "
     "run with --resume latest to write it"),
    ("offload_trainer.runtime.engine:Engine.close:1",
     "after its last step; the swap files and partial files were removed; every step is saved (ckpt-000002) and "
     "the export is in {run}/model.safetensors: the run is complete"),
    ("offload_trainer.app.trainer:format_summary:1",
     "after its last step; the swap files and partial files were removed; every step is saved (ckpt-000002) and "
     "the export is in {run}/model.safetensors: the run is complete"),
]


@pytest.mark.slow  # three runs of offload-train; the import test above and test_run_dir's moments by default
@pytest.mark.parametrize("kill_at, said", LAST_MOMENTS, ids=["export", "engine-close", "summary"])
def test_a_signal_after_the_last_step_says_what_is_on_disk(tmp_path: Path, kill_at: str, said: str) -> None:
    """SIGTERM during the export, while the engine closes or while the summary is printed: one line
    that says whether the export is written (it said "during step 3" of a 2-step run, or nothing at
    all once the summary was being printed), exit 143, and a resume finishes the export."""
    launcher = (REPO / "tests" / "offload_trainer" / "app" / "test_kill_moments.py").read_text()
    launcher = launcher.split('LAUNCHER = r"""', 1)[1].split('"""', 1)[0]
    _corpus(tmp_path)
    env = {**os.environ, "KILL_AT": kill_at, "KILL_SIGNAL": "SIGTERM", "KILL_MARK": str(tmp_path / "killed")}
    done = subprocess.run(
        [sys.executable, "-c", launcher, *_args(tmp_path, 2)], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert (tmp_path / "killed").exists(), done.stderr[-3000:]
    assert done.returncode == 143, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines == [f"offload-train: interrupted by SIGTERM {said.format(run=tmp_path / 'run')}"], done.stderr
    assert _left(tmp_path) == []
    resumed = _train(tmp_path, 2, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "run" / "model.safetensors").is_file()


@pytest.mark.slow  # three runs of offload-train
@pytest.mark.parametrize("kill_at, said, newest", [
    ("offload_trainer.runtime.persist.checkpoint:_gather_range:2", "while loading ckpt-000002", "ckpt-000002"),
    ("offload_trainer.app.trainer:Trainer._evaluate:1", "after step 4", "ckpt-000003"),
], ids=["resume-load", "last-eval-before-save"])
def test_a_sigterm_in_a_resume_says_where_and_loses_nothing(tmp_path: Path, kill_at: str, said: str, newest: str) -> None:
    """A finished 2-step run resumed to 4 steps, SIGTERM while it loads ckpt-000002 (its homes half
    written) or in step 4's eval, before step 4's checkpoint (it said "during step 5"): one line naming
    the moment and the newest checkpoint as the way on, exit 143, that one `latest`, ckpt-000002
    intact, nothing left behind; the next resume ends with the uninterrupted run's checkpoint and metrics."""
    launcher = (REPO / "tests" / "offload_trainer" / "app" / "test_kill_moments.py").read_text()
    launcher = launcher.split('LAUNCHER = r"""', 1)[1].split('"""', 1)[0]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for root in (straight, killed):
        _corpus(root)
    assert _train(straight, 4).returncode == 0
    assert _train(killed, 2).returncode == 0
    before = _records(killed / "run", 2)
    env = {**os.environ, "KILL_AT": kill_at, "KILL_SIGNAL": "SIGTERM", "KILL_MARK": str(tmp_path / "mark")}
    done = subprocess.run(
        [sys.executable, "-c", launcher, *_args(killed, 4, "--resume", "latest")], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert (tmp_path / "mark").exists() and done.returncode == 143, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"offload-train: interrupted by SIGTERM {said}; the swap files and partial files were removed; resume "
        f"with --resume latest (the newest checkpoint is {newest})"
    ], done.stderr
    assert (killed / "run" / "latest").read_text() == newest and _records(killed / "run", 2) == before
    assert _left(killed) == []
    resumed = _train(killed, 4, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _records(killed / "run", 4) == _records(straight / "run", 4)
    assert _steps(killed / "run") == list(range(1, 5))
