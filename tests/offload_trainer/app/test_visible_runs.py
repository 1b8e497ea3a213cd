"""Runs a person can watch: per-step lines in a log, messages around evals, saves and exports,
metrics rows with time, learning rate and eval loss, TensorBoard events (each step once after a
resume), train.keep_last, the eval loss measured with dropout off, the loss of several ranks
averaged, and one trace per rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import List

import pytest

from tests.command_lines import argv_with
import torch
from torch import nn
from torch.nn import functional as F

import offload_trainer as ot
from offload_trainer.app.data import Batch
from offload_trainer.app.keep_last import checkpoints_to_delete, prune_checkpoints
from offload_trainer.app.loggers import check_loggers
from offload_trainer.app.run_dir import point_latest
from offload_trainer.app.trainer import evaluate

REPO = Path(__file__).resolve().parents[3]
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40


def _corpus(root: Path) -> Path:
    d = root / "corpus"
    d.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        (d / f"doc{i}.py").write_text(f"# document {i}\n" + TEXT)
    return d


def _args(root: Path, steps: int, *extra: str) -> List[str]:
    return argv_with([
        "--model.preset", "tiny", "--data.path", str(_corpus(root)), "--data.seq_len", "32",
        "--data.batch_size", "4", "--train.steps", str(steps), "--train.eval_batches", "1",
        "--train.out_dir", str(root / "run"), "--tiers.nvme_dir", str(root / "swap"),
    ], *extra)


def _rows(run: Path) -> List[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- evaluate() ------------------------------------------------------------------------------------


class DropoutLM(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(8, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.embed(tokens)))


class EvalData:
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 11, (4, 9), generator=g)

    def eval_batches(self, batch_size: int):
        for start in range(0, len(self.tokens), batch_size):
            rows = self.tokens[start : start + batch_size]
            yield Batch(rows[:, :-1], rows[:, 1:], None)


def _eval_loss(p: float, state: dict) -> tuple:
    model = DropoutLM(p)
    model.load_state_dict(state)
    lm = SimpleNamespace(
        model=model,
        loss=lambda engine, x, y, position_ids: F.cross_entropy(engine(x).flatten(0, 1), y.flatten()),
    )
    with ot.initialize(model, ot.OffloadConfig()) as engine:
        loss = evaluate(engine, lm, EvalData(), batch_size=2, max_batches=2)  # type: ignore[arg-type]
        return loss, model.training


def test_evaluate_runs_the_model_in_eval_mode_and_restores_train_mode() -> None:
    torch.manual_seed(0)
    state = DropoutLM(0.0).state_dict()
    with_dropout, training_after = _eval_loss(0.9, state)
    without_dropout, _ = _eval_loss(0.0, state)
    assert with_dropout == without_dropout, "eval loss was measured with dropout on"
    assert training_after, "evaluate() left the model in eval mode"


# -- train.keep_last ------------------------------------------------------------------------------


def test_keep_last_keeps_the_newest_and_never_the_one_latest_names(tmp_path: Path) -> None:
    names = [f"ckpt-{s:06d}" for s in (1, 2, 3, 4, 5)]
    assert checkpoints_to_delete(names, 2, "ckpt-000005") == names[:3]
    assert checkpoints_to_delete(names, 2, "ckpt-000002") == ["ckpt-000001", "ckpt-000003"]
    assert checkpoints_to_delete(names, 0, "ckpt-000005") == []
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    point_latest(tmp_path, "ckpt-000001")  # a run resumed from an old checkpoint, as latest says
    assert prune_checkpoints(tmp_path, 1) == ["ckpt-000002", "ckpt-000003", "ckpt-000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001", "ckpt-000005", "latest"]


def test_a_logger_whose_package_is_missing_is_one_clear_line(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r'"wandb".*pip install wandb'):
        check_loggers(["jsonl", "wandb"])
    check_loggers(["jsonl"])


# -- a whole run ----------------------------------------------------------------------------------


def test_a_logged_run_shows_every_step_and_phase_and_writes_rows_and_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    done = subprocess.run(
        [sys.executable, "-m", "offload_trainer", *_args(
            tmp_path, 4, "--train.eval_every", "2", "--train.checkpoint_every", "1", "--train.keep_last", "2",
            "--train.loggers", "jsonl,tensorboard", "--no-progress",
        )],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for step in range(1, 5):
        assert f"step {step}/4  loss " in out, out
    for said in ("tokenizing ", "\ntokenized the corpus in ", "building the engine (", "\nbuilt the engine in ",
                 "placement: params nvme, grads host, optimizer nvme", "evaluating on 1 held-out batch...",
                 "saving ", "saved ckpt-000004 in", f"exporting the weights (fp32) to {tmp_path / 'run' / 'model.safetensors'}...",
                 "exported in"):
        assert said in out, out
    assert "\r" not in out and done.stderr == "", done.stderr
    run = tmp_path / "run"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["time"] > 1e9 and r["lr"] == pytest.approx(2e-3) and r["tokens_per_s"] == r["tokens"] / r["step_s"]
    assert [("eval_loss" in r) for r in rows] == [False, True, False, True]
    # keep_last = 2: the older checkpoints are gone, latest's kept.
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000003", "ckpt-000004"]
    assert json.loads((run / "config.json").read_text())["tiers"]["params"] == {"device": 0.0, "host": 0.0, "nvme": 1.0}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/lr", "eval/loss"} <= set(events.Tags()["scalars"])
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    assert [e.value for e in events.Scalars("train/lr")] == [pytest.approx(2e-3)] * 4

    # Resumed from ckpt-000003 (as after a kill during step 4): step 4 is run and logged again, and
    # TensorBoard, like metrics.jsonl, has it once.
    again = subprocess.run(
        [sys.executable, "-m", "offload_trainer", *_args(
            tmp_path, 4, "--resume", str(run / "ckpt-000003"), "--train.loggers", "jsonl,tensorboard",
            "--no-progress", "--train.export_dtype", "none",
        )],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    # The start-up's long parts get their lines too (a resume of a large model reads every state).
    assert f"resuming from {run / 'ckpt-000003'}...\nresumed from ckpt-000003 in " in again.stdout, again.stdout
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"])) for r in rows
    ]


def test_two_ranks_log_the_loss_of_the_whole_batch_and_write_a_trace_each(tmp_path: Path) -> None:
    common = ("--train.export_dtype", "none", "--train.checkpoint_every", "0", "--train.trace_step", "1",
              "--no-progress", "--optimizer.kind", "sgd")
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    one = subprocess.run(
        [sys.executable, "-m", "offload_trainer", *_args(one_dir, 2, *common)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "offload_trainer",
         *_args(two_dir, 2, *common)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    one_rows, two_rows = _rows(one_dir / "run"), _rows(two_dir / "run")
    # Each rank's mean over its half of the batch, averaged over the ranks: the full batch's mean.
    for a, b in zip(one_rows, two_rows):
        tol = 1e-6 if a["step"] == 1 else 1e-5  # step 1: the same weights; step 2: after one SGD update
        assert b["loss"] == pytest.approx(a["loss"], rel=0, abs=tol), (a["loss"], b["loss"])
        assert b["eval_loss" if "eval_loss" in a else "loss"] == pytest.approx(
            a.get("eval_loss", a["loss"]), rel=0, abs=tol
        )
    traces = sorted(p.name for p in (two_dir / "run").glob("trace*.json"))
    assert traces == ["trace-rank0.json", "trace-rank1.json"]
    for name in traces:
        assert json.loads((two_dir / "run" / name).read_text())["traceEvents"]
