"""One point of the prefetch tuner, run through the engine: a fresh engine, a few steps, its times and peaks.

run_point() measures one grid point's config on the same batches as every other point, and
says what went wrong if anything did (refused at initialize, over a budget, swap files left).
Run the tuner as `python3 scripts/tune_prefetch.py` (usage in tune_prefetch.py's docstring).
"""

from __future__ import annotations

import gc
import glob
import os
import shutil
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

import offload_trainer as ot
from offload_trainer.app.run_checks import with_real_nvme_dir
from offload_trainer.app.bench.tune_grid import Prediction
from offload_trainer.app.bench.tune_settings import Settings
from io_engine import DirectIOUnsupportedError, NotEnoughSpaceError
from io_engine.file_store import SWAP_DIR_PREFIX
from offload_trainer.app.causal_lm import CausalLM, build_causal_lm
from offload_trainer.app.bench.token_batches import Batch, random_token_batches
from offload_trainer.app.run_config import RunConfig
from offload_trainer.config import Tier
from offload_trainer.runtime.groups.freed_heap import give_back_freed_heap
from offload_trainer.errors import PlanError
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.groups.tiers import BudgetExceededError

_SEED_DATA_OFFSET = 1
"""The batches' generator is seeded with config.seed + this, apart from the model's init."""




def make_batches(config: RunConfig, vocab_size: int, num_steps: int) -> List[List[Batch]]:
    """(inputs, targets) of every micro-batch of every step: random token ids, the same for every point."""
    return random_token_batches(
        vocab_size, config.data.batch_size, config.data.seq_len, config.grad_accum_steps, num_steps,
        config.seed + _SEED_DATA_OFFSET,
    )


@dataclass
class Measurement:
    """One point's timed steps: the median one's time and breakdown, and the peaks over the whole run."""

    step_s: float
    io_wait_s: float
    compute_s: float
    optimizer_s: float
    step_times_s: List[float]
    peak_bytes: Dict[Tier, int]
    over_budget: Dict[Tier, int]
    """Bytes by which a tier's peak exceeded its budget (empty: within every budget)."""
    direct_io: bool


@dataclass
class PointResult:
    prediction: Prediction
    config: RunConfig
    measurement: Optional[Measurement] = None
    problem: Optional[str] = None
    """Why there is no measurement, or what went wrong (over a budget, swap files left)."""
    broke_invariant: bool = False
    """Over a budget or swap files left behind: never expected, a bug wherever it happens."""

    @property
    def ok(self) -> bool:
        return self.measurement is not None and self.problem is None


def median_index(times: Sequence[float]) -> int:
    """Index of the median time: the lower middle one for an even count."""
    order = sorted(range(len(times)), key=lambda i: times[i])
    return order[(len(times) - 1) // 2]


def swap_dirs(nvme_dir: Optional[str]) -> List[str]:
    """This process's swap directories (io_engine.FileStore's) under nvme_dir."""
    if nvme_dir is None:
        return []
    return sorted(glob.glob(os.path.join(glob.escape(os.path.abspath(nvme_dir)), f"{SWAP_DIR_PREFIX}{os.getpid()}-*")))


def remove_left_swap(nvme_dir: Optional[str]) -> List[str]:
    """Remove and return swap directories of this process still under nvme_dir (there should be none)."""
    gc.collect()  # an engine dropped without close() removes its files when collected
    left = swap_dirs(nvme_dir)
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    return left


def measure_point(
    config: RunConfig, batches: Sequence[Sequence[Batch]], num_warmup_steps: int, device: torch.device
) -> Measurement:
    """A fresh engine on a fresh meta model, trained on `batches`; always closed, its memory returned."""
    torch.manual_seed(config.seed)  # the initial weights, as offload-train draws them
    lm: CausalLM = build_causal_lm(config)
    engine: Optional[ot.Engine] = None
    times: List[float] = []
    stats: List[StepStats] = []
    try:
        engine = ot.initialize(lm.model, with_real_nvme_dir(config.engine_config()), init_fn=lm.init_fn)
        accum = config.grad_accum_steps
        for i, micro in enumerate(batches):
            start = time.perf_counter()
            for inputs, targets in micro:
                loss = lm.loss(engine, inputs.to(engine.device), targets.to(engine.device))
                engine.backward(loss / accum)
            engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= num_warmup_steps:
                times.append(time.perf_counter() - start)
                stats.append(engine.stats())
        peak = {tier: engine.peak_bytes(tier) for tier in Tier}
        direct = not engine.io.buffered_fallback
    finally:
        if engine is not None:
            engine.close()
        del engine, lm  # the last references: the collection below returns their memory
        gc.collect()
        give_back_freed_heap()
    budgets = {Tier.DEVICE: config.tiers.device_budget_bytes, Tier.HOST: config.tiers.host_budget_bytes}
    over = {t: peak[t] - b for t, b in budgets.items() if b is not None and peak[t] > b}
    m = median_index(times)
    s = stats[m]
    return Measurement(times[m], s.io_wait_s, s.compute_s, s.optimizer_s, times, peak, over, direct)


def run_point(
    prediction: Prediction, config: RunConfig, batches: Sequence[Sequence[Batch]], settings: Settings,
    device: torch.device,
) -> PointResult:
    result = PointResult(prediction, config)
    try:
        result.measurement = measure_point(config, batches, settings.num_warmup_steps, device)
    except (PlanError, NotEnoughSpaceError, DirectIOUnsupportedError) as exc:
        # Predicted to fit, refused by initialize: the planner and the engine disagree.
        result.problem = f"refused at initialize: {exc}"
    except BudgetExceededError as exc:
        result.problem = f"OVER BUDGET: {exc}"
        result.broke_invariant = True
    finally:
        left = remove_left_swap(config.tiers.nvme_dir)
    m = result.measurement
    if m is not None and m.over_budget:
        result.problem = "OVER BUDGET: " + ", ".join(
            f"{t.value} peak {m.peak_bytes[t]} bytes, {n} over" for t, n in m.over_budget.items())
        result.broke_invariant = True
    if left:
        result.problem = (result.problem + "; " if result.problem else "") + f"SWAP FILES LEFT (now removed): {left}"
        result.broke_invariant = True
    return result
