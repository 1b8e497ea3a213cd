"""Where a run's per-step metrics go: metrics.jsonl always, TensorBoard and Weights & Biases on request.

    check_loggers(cfg.train.loggers)               # before anything is built: a missing package is one line
    loggers = open_loggers(names, out_dir, cfg, resumed_step)      # rank 0 only, once out_dir is prepared
    loggers.log(row)                               # one dict per step: {"step": 3, "loss": 2.1, "lr": 1e-3, ...}
    loggers.close()

A row is what metrics.jsonl holds, one JSON object per line. TensorBoard and W&B get its numeric
fields as scalars under "train/" (and "eval/loss"), keyed by the step.

A resumed run runs again the steps after its checkpoint that a killed run had logged already. The
trainer cuts metrics.jsonl back to the checkpoint's step before the loggers open (run_dir.truncate_metrics);
the TensorBoard writer is opened with `purge_step` one past it, so TensorBoard hides the killed run's
events of those steps instead of showing two values for each.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Sequence

from offload_trainer.app.run_config import RunConfig
from offload_trainer.app.run_dir import open_metrics
from offload_trainer.app.user_errors import naming_path

TENSORBOARD_DIR = "tensorboard"
"""The directory under out_dir that the TensorBoard writer fills (`tensorboard --logdir out_dir/tensorboard`)."""

_SCALARS = {
    "loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s",
    "trained_tokens_per_s": "train/trained_tokens_per_s", "step_s": "train/step_s",
    "grad_norm": "train/grad_norm", "eval_loss": "eval/loss",
}
"""The row fields sent to TensorBoard and W&B, and their names there."""


def check_loggers(names: Sequence[str]) -> None:
    """ValueError naming the logger and the package to install, if one asked for cannot be imported."""
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            'train.loggers includes "tensorboard", but the tensorboard package is not installed: '
            "pip install 'offload-trainer[tensorboard]' (or tensorboard), or drop it from train.loggers"
        )
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            'train.loggers includes "wandb", but the wandb package is not installed: pip install wandb '
            "(then wandb login), or drop it from train.loggers"
        )


def _scalars(row: Dict[str, Any]) -> Dict[str, float]:
    out = {}
    for key, tag in _SCALARS.items():
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[tag] = float(value)
    return out


def json_values(value: Any) -> Any:
    """`value` with each float that is not finite (an eval loss over no held-out data, the gradient norm
    of a skipped step) made None: json.dumps wrote NaN and Infinity, which are no JSON, so jq, pandas'
    and every other strict reader refused the line. offload-train --json's summary goes through it too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_values(v) for v in value]
    return value


class JsonlLogger:
    """out_dir/metrics.jsonl: one JSON object per step, appended and flushed at once."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / "metrics.jsonl"
        with naming_path(self.path):
            self._file: IO[str] = open_metrics(out_dir)

    def log(self, row: Dict[str, Any]) -> None:
        with naming_path(self.path):
            self._file.write(json.dumps(json_values(row), allow_nan=False) + "\n")
            self._file.flush()

    def sync(self) -> None:
        """Make the rows logged so far durable (fsync): before a checkpoint, so that a machine that
        crashes once the checkpoint is on disk cannot lose the rows of its steps, which a resume
        from it never logs again (a killed process loses nothing: each row is flushed at once)."""
        os.fsync(self._file.fileno())
        self._check_in_place()

    def _check_in_place(self) -> None:
        """ValueError if metrics.jsonl is no longer the file this logger appends to: out_dir (or the
        file) was removed or replaced during the run. The rows went to a file no one can open, and the
        checkpoint about to be saved would make out_dir again around it, a run without its metrics or
        config.json that looks whole."""
        opened = os.fstat(self._file.fileno())
        try:
            now = os.stat(self.path, follow_symlinks=False)
            in_place = (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)
        except OSError:
            in_place = False
        if not in_place:
            raise ValueError(
                f"{self.path} was removed or replaced while this run was appending to it (was train.out_dir "
                "deleted or moved?), so the rows it logged since are lost and the run stopped before saving; keep "
                "train.out_dir in place while a run writes it, then resume with --resume latest from a checkpoint "
                "that is still there, or start again"
            )

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    """out_dir/tensorboard: an event file of the rows' scalars (torch.utils.tensorboard.SummaryWriter).

    `resumed_step`: the step of the checkpoint a resumed run started from. The new event file then
    begins with a SessionLog.START at the step after it, and TensorBoard drops every earlier file's
    events at that step or later (those of the steps the killed run logged past its checkpoint)."""

    def __init__(self, out_dir: Path, resumed_step: Optional[int] = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge_step = None if resumed_step is None else resumed_step + 1
        self._writer = SummaryWriter(log_dir=str(out_dir / TENSORBOARD_DIR), purge_step=purge_step)

    def log(self, row: Dict[str, Any]) -> None:
        for tag, value in _scalars(row).items():
            self._writer.add_scalar(tag, value, global_step=row["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A Weights & Biases run named after out_dir, with the whole config as its hyperparameters; wandb's
    own settings (WANDB_PROJECT, WANDB_MODE=offline, ...) apply.

    The config's paths go there absolute (with_absolute_paths): the hyperparameters are read on W&B's
    site, beside other runs, where `runs/x` or `data` says neither which machine directory nor which
    corpus the run used (they meant the directory offload-train was started in)."""

    def __init__(self, out_dir: Path, config: Optional[RunConfig]) -> None:
        import wandb

        hparams = config.with_absolute_paths().to_dict() if config is not None else {}
        self._run = wandb.init(name=out_dir.name, dir=str(out_dir), config=hparams)

    def log(self, row: Dict[str, Any]) -> None:
        self._run.log(_scalars(row), step=row["step"])

    def close(self) -> None:
        self._run.finish()


class Loggers:
    """Every logger a run writes to; log() and close() go to each."""

    def __init__(self, loggers: List[Any]) -> None:
        self._loggers = loggers

    def log(self, row: Dict[str, Any]) -> None:
        for logger in self._loggers:
            logger.log(row)

    def sync(self) -> None:
        """metrics.jsonl's rows made durable (JsonlLogger.sync); the others' are their services' to keep."""
        for logger in self._loggers:
            if isinstance(logger, JsonlLogger):
                logger.sync()

    def close(self) -> None:
        for logger in self._loggers:
            logger.close()


def open_loggers(
    names: Sequence[str], out_dir: Path, config: Optional[RunConfig] = None, resumed_step: Optional[int] = None,
) -> Loggers:
    """metrics.jsonl, then the other loggers `names` asks for (train.loggers). `resumed_step`: the step of
    the checkpoint this run resumed from (None for a fresh run); metrics.jsonl must already be cut back to it."""
    loggers: List[Any] = [JsonlLogger(out_dir)]
    try:
        if "tensorboard" in names:
            loggers.append(TensorBoardLogger(out_dir, resumed_step))
        if "wandb" in names:
            loggers.append(WandbLogger(out_dir, config))
    except BaseException:
        Loggers(loggers).close()
        raise
    return Loggers(loggers)


class NoLoggers(Loggers):
    """What ranks other than 0 log to: nothing."""

    def __init__(self) -> None:
        super().__init__([])
