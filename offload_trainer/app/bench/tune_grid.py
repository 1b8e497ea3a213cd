"""The prefetch tuner's grid: the points around the run's own settings, the planner's prediction of
each, and which of them are measured.

A GridPoint is the few settings one point changes (prefetch, grouping, io); predict_grid() asks
the planner for each point's step time, and select_points() keeps the defaults and the fastest
predicted. Run the tuner as `python3 scripts/tune_prefetch.py` (the grid is described in
tune_prefetch.py's docstring).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from io_engine import IOConfig
from offload_trainer.app.run_config import RunConfig
from offload_trainer.config import Tier
from offload_trainer.planning.machine import MachineRates
from offload_trainer.errors import PlanError
from offload_trainer.planning.model_spec import MicroBatch, ModelSpec, predict_config

LOOKAHEAD_GROUPS = (0, 1, 2, 4)
LOOKAHEAD_GROUP_MULTIPLES = (1, 2)
"""prefetch.lookahead_bytes tried, in the largest group's parameter bytes (besides no cap)."""
GROUP_BLOCKS = 2
"""grouping.max_group_bytes tried: this many of the largest group's parameter bytes (besides none)."""
IO_NUM_THREADS = (4, 8)
IO_QUEUE_DEPTHS = (16, 32)
TIE_TOLERANCE = 1e-3
"""Predictions within this fraction of the fastest one's time are ties."""


@dataclass(frozen=True)
class GridPoint:
    """The settings one point changes; everything else is the run's resolved config."""

    lookahead_groups: int
    lookahead_bytes: Optional[int]
    max_group_bytes: Optional[int]
    io_num_threads: int
    io_queue_depth: int

    @classmethod
    def of(cls, config: RunConfig) -> GridPoint:
        return cls(config.prefetch.lookahead_groups, config.prefetch.lookahead_bytes, config.grouping.max_group_bytes,
                   config.io.worker_threads(), config.io.queue_depth)

    def io(self, base: IOConfig) -> IOConfig:
        return dataclasses.replace(base, num_threads=self.io_num_threads, queue_depth=self.io_queue_depth)

    def apply(self, config: RunConfig) -> RunConfig:
        return dataclasses.replace(
            config,
            prefetch=dataclasses.replace(config.prefetch, lookahead_groups=self.lookahead_groups,
                                         lookahead_bytes=self.lookahead_bytes),
            grouping=dataclasses.replace(config.grouping, max_group_bytes=self.max_group_bytes),
            io=self.io(config.io),
        )

    def num_changes(self, other: GridPoint) -> int:
        return sum(a != b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other)))

    def as_dict(self) -> Dict[str, Optional[int]]:
        return {
            "prefetch.lookahead_groups": self.lookahead_groups,
            "prefetch.lookahead_bytes": self.lookahead_bytes,
            "grouping.max_group_bytes": self.max_group_bytes,
            "io.num_threads": self.io_num_threads,
            "io.queue_depth": self.io_queue_depth,
        }


def _with_base(values: Sequence[Any], base: Any) -> List[Any]:
    """`values` and `base`, each once, in the order given (base last if new)."""
    out = list(dict.fromkeys(values))
    return out if base in out else out + [base]


def micro_batch(config: RunConfig) -> MicroBatch:
    """The micro-batch the planner predicts for: one rank's data.batch_size x data.seq_len."""
    return MicroBatch(config.data.batch_size, config.data.seq_len)


def largest_group_bytes(spec: ModelSpec, config: RunConfig) -> Tuple[int, int]:
    """(parameter bytes in the model's dtype, in the compute dtype) of the largest group with one block per group."""
    one_block = dataclasses.replace(config, grouping=dataclasses.replace(config.grouping, max_group_bytes=None))
    group = max(spec.partition(one_block, 1).groups, key=lambda g: g.flat_numel)
    return group.flat_bytes, group.flat_numel * config.precision.compute_dtype.torch_dtype.itemsize


def make_grid(config: RunConfig, spec: ModelSpec) -> List[GridPoint]:
    """Every point of the grid around `config` (its own settings are one of them)."""
    base = GridPoint.of(config)
    model_bytes, compute_bytes = largest_group_bytes(spec, config)
    lookaheads = _with_base(LOOKAHEAD_GROUPS, base.lookahead_groups)
    caps = _with_base([None] + [k * compute_bytes for k in LOOKAHEAD_GROUP_MULTIPLES], base.lookahead_bytes)
    groupings = _with_base([None, GROUP_BLOCKS * model_bytes], base.max_group_bytes)
    if config.tiers.uses(Tier.NVME):
        io_pairs = _with_base([(t, q) for t in IO_NUM_THREADS for q in IO_QUEUE_DEPTHS],
                              (base.io_num_threads, base.io_queue_depth))
        io_pairs = [(t, q) for t, q in io_pairs if q >= t]  # IOConfig refuses a queue shallower than its threads
    else:
        io_pairs = [(base.io_num_threads, base.io_queue_depth)]  # nothing moves through io_engine
    points = []
    for lookahead in lookaheads:
        # Without lookahead there is nothing to cap: the run's own cap stands.
        for cap in caps if lookahead > 0 else [base.lookahead_bytes]:
            for group_bytes in groupings:
                for threads, depth in io_pairs:
                    points.append(GridPoint(lookahead, cap, group_bytes, threads, depth))
    return list(dict.fromkeys(points))


@dataclass(frozen=True)
class Prediction:
    point: GridPoint
    grid_index: int
    step_s: Optional[float]
    """The planner's predicted step time; None when the point does not fit."""
    refusal: Optional[str]
    """Why the point does not fit (PlanError's message), else None."""


def effective_lookahead(point: GridPoint, spec: ModelSpec, config: RunConfig) -> int:
    """Groups the scheduler fetches ahead under the point's lookahead_bytes cap (prefetch.py stops at the
    first group past the cap); counted in the largest group, so a lower bound for smaller ones."""
    if point.lookahead_bytes is None:
        return point.lookahead_groups
    itemsize = config.precision.compute_dtype.torch_dtype.itemsize
    largest = max(g.shard_numel for g in spec.partition(config, 1).groups) * itemsize
    return min(point.lookahead_groups, point.lookahead_bytes // max(largest, 1))


def predict_grid(
    grid: Sequence[GridPoint], config: RunConfig, spec: ModelSpec, device: torch.device,
    rates: Dict[IOConfig, MachineRates], cache_path: Path,
) -> List[Prediction]:
    out = []
    for i, point in enumerate(grid):
        cfg = point.apply(config)
        # The cost model has no term for lookahead_bytes: predict the depth the cap leaves.
        depth = effective_lookahead(point, spec, cfg)
        as_predicted = dataclasses.replace(cfg, prefetch=dataclasses.replace(cfg.prefetch, lookahead_groups=depth))
        try:
            candidate = predict_config(spec, as_predicted, micro_batch(config), device, rates[cfg.io], cache_path)
        except PlanError as exc:
            out.append(Prediction(point, i, None, str(exc)))
            continue
        out.append(Prediction(point, i, candidate.cost.step_s, None))
    return out


def select_points(predictions: Sequence[Prediction], defaults: GridPoint, max_points: int) -> List[Prediction]:
    """The defaults first, then the `max_points` fastest predicted (ties toward the fewest changes)."""
    fitting = [p for p in predictions if p.step_s is not None]
    fastest = min(p.step_s for p in fitting)  # type: ignore[type-var]

    def rank(p: Prediction) -> Tuple[float, int, int]:
        assert p.step_s is not None
        return (round((p.step_s - fastest) / fastest / TIE_TOLERANCE), p.point.num_changes(defaults), p.grid_index)

    best = sorted(fitting, key=rank)[:max_points]
    base = next(p for p in predictions if p.point == defaults)
    return [base] + [p for p in best if p is not base]
