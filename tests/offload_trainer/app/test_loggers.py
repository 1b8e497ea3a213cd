"""The loggers of a resumed run: the steps a killed run logged past its checkpoint, run again, are
in metrics.jsonl and in TensorBoard once each, with the resumed run's values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload_trainer.app import run_dir
from offload_trainer.app.loggers import TENSORBOARD_DIR, open_loggers


def _log(out_dir: Path, steps: range, scale: float, resumed_step=None) -> None:
    loggers = open_loggers(["jsonl", "tensorboard"], out_dir, resumed_step=resumed_step)
    try:
        for step in steps:
            loggers.log({"step": step, "loss": scale * step, "lr": 1e-3})
    finally:
        loggers.close()


def test_a_resumed_run_logs_the_steps_it_runs_again_once_in_metrics_and_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log(tmp_path, range(1, 6), 1.0)  # killed after step 5; its last checkpoint was step 2
    run_dir.truncate_metrics(tmp_path, 2)  # what the trainer does at resume, before the loggers open
    _log(tmp_path, range(3, 6), 10.0, resumed_step=2)  # steps 3 to 5 again, other values
    expected = [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == expected
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == expected
    assert [e.step for e in events.Scalars("train/lr")] == [1, 2, 3, 4, 5]


def test_a_fresh_run_purges_nothing(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log(tmp_path, range(1, 4), 1.0)
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_sync_makes_metrics_jsonl_durable(tmp_path: Path, monkeypatch) -> None:
    """Called before each checkpoint: the rows of the steps it holds are fsynced, so a machine crash
    after the checkpoint cannot lose rows that a resume from it would never log again."""
    import os

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real_fsync(fd)))
    loggers = open_loggers(["jsonl"], tmp_path)
    try:
        loggers.log({"step": 1, "loss": 1.0})
        assert synced == []
        loggers.sync()
        assert synced == [os.stat(tmp_path / "metrics.jsonl").st_ino]
    finally:
        loggers.close()


@pytest.mark.parametrize("how", ["out_dir removed", "out_dir moved", "metrics replaced"])
def test_sync_refuses_a_metrics_file_no_longer_in_out_dir(tmp_path: Path, how: str) -> None:
    """out_dir removed mid-run: the rows went to an unlinked file and the next checkpoint made out_dir
    again around itself (a run dir with checkpoints but no metrics.jsonl or config.json, exit 0)."""
    import shutil

    out_dir = tmp_path / "run"
    out_dir.mkdir()
    loggers = open_loggers(["jsonl"], out_dir)
    try:
        loggers.log({"step": 1, "loss": 1.0})
        loggers.sync()  # in place: fine
        if how == "out_dir removed":
            shutil.rmtree(out_dir)
        elif how == "out_dir moved":
            out_dir.rename(tmp_path / "elsewhere")
            out_dir.mkdir()
        else:
            (out_dir / "metrics.jsonl").unlink()
            (out_dir / "metrics.jsonl").write_text("")
        loggers.log({"step": 2, "loss": 1.0})
        with pytest.raises(ValueError, match=r"metrics.jsonl was removed or replaced while this run was appending"):
            loggers.sync()
    finally:
        loggers.close()


def test_a_value_that_is_not_finite_is_logged_as_null(tmp_path: Path) -> None:
    """metrics.jsonl held `"eval_loss": NaN` (a run with data.eval_fraction = 0) and would hold Infinity
    (a skipped step's gradient norm): no JSON, which jq and every strict reader refuse."""

    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    loggers = open_loggers(["jsonl"], tmp_path)
    try:
        loggers.log({"step": 1, "loss": 2.0, "eval_loss": float("nan"), "grad_norm": float("inf"),
                     "per_tier": {"nvme": float("-inf")}})
    finally:
        loggers.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line, parse_constant=strict) == {
        "step": 1, "loss": 2.0, "eval_loss": None, "grad_norm": None, "per_tier": {"nvme": None}
    }


def test_wandb_gets_the_configs_paths_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hyperparameters W&B shows beside other runs: `runs/x` there names no directory of any machine."""
    import sys
    import types

    from offload_trainer.app.run_config import DEFAULT_RUN, RunConfig

    given = {}

    class FakeRun:
        def finish(self) -> None:
            pass

    def init(**kwargs):
        given.update(kwargs)
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig.from_dict(DEFAULT_RUN).with_overrides(
        {"train.out_dir": "runs/x", "data.path": "corpus", "tiers.nvme_dir": "swap"}
    )
    loggers = open_loggers(["jsonl", "wandb"], tmp_path, cfg)
    loggers.close()
    hparams = given["config"]
    assert hparams["train"]["out_dir"] == str(tmp_path / "runs" / "x")
    assert hparams["data"]["path"] == str(tmp_path / "corpus")
    assert hparams["tiers"]["nvme_dir"] == str(tmp_path / "swap")
    assert {k: v for k, v in hparams["optimizer"].items()} == cfg.to_dict()["optimizer"]  # the rest as it was
