"""Prefetch tuner: a few short steps of your offload-train run over a grid of prefetch, grouping and IO settings.

    python scripts/tune_prefetch.py --config run.toml               # the run `offload-train --config run.toml` makes
    python scripts/tune_prefetch.py --preset 125m --batch-size 4 --seq-len 512 --host-budget 8GiB --placement auto
    python scripts/tune_prefetch.py --config run.toml --json        # ...and one JSON object on the last stdout line
    offload-train --config tuned.toml                               # then train with the best settings found

The run is read as offload-train reads it (its defaults, then --config, then the flags --preset,
--batch-size, --seq-len, --nvme-dir, --device-budget, --host-budget, --placement) and its model is
built as offload-train builds it (on the meta device, materialised into its homes). With
placement "auto" the planner resolves the placement once, and every point keeps it: the grid
tunes how state moves, not where it lives.

The grid, around the run's own settings (always one of the points, "the defaults"):
- prefetch.lookahead_groups: 0, 1, 2, 4;
- prefetch.lookahead_bytes: none, one and two of the largest group's parameter bytes (only with
  a lookahead above 0);
- grouping.max_group_bytes: none (one block per group), and two of the largest group's
  parameter bytes (two blocks per group for a decoder);
- io.num_threads 4, 8 and io.queue_depth 16, 32 (only when some state is on NVMe; a pair whose
  queue is shallower than its threads is left out).
Buffer counts (device slots, host staging buffers) are not a knob of this version: memory_plan
derives them from the budgets and the lookahead, so they change with the lookahead here.

Every point is first predicted by the planner (offload_trainer.planning.model_spec.predict_config, with
the machine's rates for its IO settings, measured once and cached; a lookahead_bytes cap enters
the prediction as the lookahead depth it allows, since the cost model has no term for it). A
point that does not fit the budgets is never run. The --max-points fastest predicted are
measured, and the defaults with them; predictions within 0.1% are ties, broken toward the
fewest settings changed from the defaults.

Each measured point initialises a fresh engine, runs --warmup-steps untimed steps (the first
records the module order) and --steps timed ones on random token ids (a fixed seed, the same
batches for every point, grad_accum_steps micro-batches per step), and closes the engine. A
point reports its median step time and that step's exposed IO wait, compute and optimizer time,
the peak bytes per tier (checked against the budgets), and the planner's prediction next to
the measurement. The fastest measured point is marked '*' and its whole config, with the
placement written out ("manual"), goes to --out (TOML or JSON by its suffix), which
`offload-train --config` reads back to the same config (checked before anything is run). A
point predicted to fit that initialize refuses is listed with the engine's message. A Hugging
Face model is timed with its placeholder weights (its safetensors are not loaded: the values do
not change the step's time).

Exit status: 0 done; 1 a point went over a budget (a planner bug; the config is still written
from the best point within them) or an IO failure; 2 bad input (one line naming the value and
the fix); 130 Ctrl-C and 143 SIGTERM, after the table of the points measured so far, with no
config written. Swap files are removed on every path, and checked to be gone after each point.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from tqdm import tqdm

import offload_trainer as ot
from offload_trainer.app.bench.bench_cli import Terminated, UsageError, parse_int, run_cli
from io_engine import DirectIOUnsupportedError, IOConfig, NotEnoughSpaceError
from io_engine.atomic_file import write_atomic
from io_engine.file_store import SWAP_DIR_PREFIX
from offload_trainer.app import cli
from offload_trainer.app.causal_lm import CausalLM, build_causal_lm
from offload_trainer.app.run_config import RunConfig
from offload_trainer.config import Placement, PlacementMode, Tier, format_bytes, parse_bytes
from offload_trainer.runtime.engine import return_freed_heap
from offload_trainer.planning.machine import DEFAULT_SIZE_BYTES, MachineRates, default_cache_path, machine_rates
from offload_trainer.errors import PlanError
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.planning.model_spec import MicroBatch, ModelSpec, plan_for_model, predict_config
from offload_trainer.runtime.groups.tiers import BudgetExceededError

PROG = "tune_prefetch.py"
DEFAULT_STEPS = 2
DEFAULT_WARMUP_STEPS = 1
DEFAULT_MAX_POINTS = 6
DEFAULT_OUT = "tuned.toml"
LOOKAHEAD_GROUPS = (0, 1, 2, 4)
LOOKAHEAD_GROUP_MULTIPLES = (1, 2)
"""prefetch.lookahead_bytes tried, in the largest group's parameter bytes (besides no cap)."""
GROUP_BLOCKS = 2
"""grouping.max_group_bytes tried: this many of the largest group's parameter bytes (besides none)."""
IO_NUM_THREADS = (4, 8)
IO_QUEUE_DEPTHS = (16, 32)
TIE_TOLERANCE = 1e-3
"""Predictions within this fraction of the fastest one's time are ties."""
_SEED_DATA_OFFSET = 1
"""The batches' generator is seeded with config.seed + this, apart from the model's init."""


def say(line: str) -> None:
    """A progress line on stderr, above the progress bar when there is one."""
    tqdm.write(f"tune_prefetch: {line}", file=sys.stderr)


# -- the command line ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The command line, validated."""

    config: RunConfig
    """The run as offload-train would read it (placement not resolved yet)."""
    num_steps: int
    """Timed optimizer steps per point."""
    num_warmup_steps: int
    """Untimed steps before them (the engine records its schedule on the first)."""
    max_points: int
    """Best predicted points measured, besides the defaults."""
    out: Path
    rates_size_bytes: int
    """Bytes of the NVMe test file when the machine's rates are not cached yet."""
    emit_json: bool


FLAG_KEYS = {
    "preset": "model.preset",
    "batch_size": "data.batch_size",
    "seq_len": "data.seq_len",
    "nvme_dir": "tiers.nvme_dir",
    "device_budget": "tiers.device_budget_bytes",
    "host_budget": "tiers.host_budget_bytes",
    "placement": "placement",
}
"""Convenience flags and the config keys they override."""
VALUE_FLAGS = ("--batch-size", "--seq-len", "--device-budget", "--host-budget", "--steps", "--warmup-steps",
               "--max-points", "--rates-size")
"""The flags that take a value: a negative one is attached to its flag (bench_cli.attach_negative_values)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Measure an offload-train run over a grid of prefetch, grouping and IO settings, pruned by "
        "the planner's predictions, and write the best as a config file (see the module docstring).",
    )
    p.add_argument("--config", help="the run's TOML or JSON config file, as offload-train --config takes it")
    p.add_argument("--preset", help="model.preset (a built-in decoder: tiny, small, 125m, ...)")
    p.add_argument("--batch-size", help="data.batch_size: sequences per micro-batch")
    p.add_argument("--seq-len", help="data.seq_len: tokens per sequence")
    p.add_argument("--nvme-dir", help="tiers.nvme_dir: directory for swap files")
    p.add_argument("--device-budget", help="tiers.device_budget_bytes, e.g. 2GiB")
    p.add_argument("--host-budget", help="tiers.host_budget_bytes, e.g. 8GiB")
    p.add_argument("--placement", choices=[m.value for m in PlacementMode],
                   help="auto: the planner chooses the tiers (once, for every point); manual: the config's tiers")
    p.add_argument("--steps", default=str(DEFAULT_STEPS), help=f"timed steps per point (default {DEFAULT_STEPS})")
    p.add_argument("--warmup-steps", default=str(DEFAULT_WARMUP_STEPS),
                   help=f"untimed steps per point before them (default {DEFAULT_WARMUP_STEPS})")
    p.add_argument("--max-points", default=str(DEFAULT_MAX_POINTS),
                   help=f"best predicted points to measure, besides the defaults (default {DEFAULT_MAX_POINTS})")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"config file for the best point, .toml or .json (default {DEFAULT_OUT})")
    p.add_argument("--rates-size", default=None,
                   help="NVMe test file size when this machine's rates are not cached yet "
                   f"(default {format_bytes(DEFAULT_SIZE_BYTES)})")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last stdout line")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate the command line; UsageError with the value and the fix for anything wrong."""
    overrides = {key: getattr(args, flag) for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None}
    try:
        config = cli.resolve_config(args.config, overrides)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    out = Path(args.out)
    if out.suffix.lower() not in (".toml", ".json"):
        raise UsageError(f"--out {args.out!r} must end in .toml or .json (offload-train --config reads those)")
    if out.is_dir():
        raise UsageError(f"--out {args.out!r} is a directory; name a file such as {DEFAULT_OUT}")
    rates_size = DEFAULT_SIZE_BYTES
    if args.rates_size is not None:
        try:
            rates_size = parse_bytes(args.rates_size, "--rates-size")
        except (TypeError, ValueError) as exc:
            raise UsageError(str(exc)) from None
        if rates_size < 1:
            raise UsageError(
                f"--rates-size {args.rates_size!r} must be at least one byte; for example --rates-size 64MiB")
    return Settings(
        config=config,
        num_steps=parse_int(args.steps, "--steps", 1),
        num_warmup_steps=parse_int(args.warmup_steps, "--warmup-steps", 0),
        max_points=parse_int(args.max_points, "--max-points", 1),
        out=out,
        rates_size_bytes=rates_size,
        emit_json=args.json,
    )


# -- the grid ------------------------------------------------------------------------------------


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
                   config.io.num_threads, config.io.queue_depth)

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


# -- predictions ---------------------------------------------------------------------------------


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


# -- measuring -----------------------------------------------------------------------------------


Batch = Tuple[torch.Tensor, torch.Tensor]


def make_batches(config: RunConfig, vocab_size: int, num_steps: int) -> List[List[Batch]]:
    """(inputs, targets) of every micro-batch of every step: random token ids, the same for every point."""
    g = torch.Generator().manual_seed((config.seed + _SEED_DATA_OFFSET) % 2**64)
    shape = (config.data.batch_size, config.data.seq_len + 1)
    steps = []
    for _ in range(num_steps):
        micro = []
        for _ in range(config.grad_accum_steps):
            seq = torch.randint(0, vocab_size, shape, generator=g)
            micro.append((seq[:, :-1], seq[:, 1:]))
        steps.append(micro)
    return steps


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
        engine = ot.initialize(lm.model, config.engine_config(), init_fn=lm.init_fn)
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
        return_freed_heap()
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


# -- reporting -----------------------------------------------------------------------------------


def placement_text(p: Placement) -> str:
    parts = [(t.value, p.fraction(t)) for t in Tier if p.fraction(t) > 0]
    if len(parts) == 1:
        return parts[0][0]
    return ",".join(f"{name}:{fraction:g}" for name, fraction in parts)


def _bytes_or(value: Optional[int], none: str) -> str:
    return none if value is None else format_bytes(value)


def best_index(results: Sequence[PointResult]) -> Optional[int]:
    ok = [i for i, r in enumerate(results) if r.ok]
    return min(ok, key=lambda i: results[i].measurement.step_s) if ok else None  # type: ignore[union-attr]


TABLE_HEADER = ("", "point", "lookahead", "la bytes", "group bytes", "io thr", "q depth", "pred s", "meas s",
                "pred/meas", "io wait s", "peak device", "peak host", "peak nvme")


def table_lines(results: Sequence[PointResult], best: Optional[int], finished: bool = True) -> List[str]:
    rows = [TABLE_HEADER]
    for i, r in enumerate(results):
        p = r.prediction.point
        m = r.measurement
        mark = ("*" if i == best else "") + ("d" if i == 0 else "")
        pred = r.prediction.step_s
        rows.append((
            mark, f"p{i + 1}", str(p.lookahead_groups), _bytes_or(p.lookahead_bytes, "none"),
            _bytes_or(p.max_group_bytes, "1 block"), str(p.io_num_threads), str(p.io_queue_depth),
            f"{pred:.4f}" if pred is not None else "-",
            f"{m.step_s:.4f}" if m else "-",
            f"{pred / m.step_s:.2f}" if m and pred is not None and m.step_s > 0 else "-",
            f"{m.io_wait_s:.4f}" if m else "-",
            *(format_bytes(m.peak_bytes[t]) if m else "-" for t in Tier),
        ))
    widths = [max(len(row[c]) for row in rows) for c in range(len(TABLE_HEADER))]
    out = []
    for row in rows:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(w) for cell, w in zip(row[2:], widths[2:])]
        out.append("  " + "  ".join(cells))
    for i, r in enumerate(results):
        if r.problem:
            out.append(f"  p{i + 1}: {r.problem}")
    best_note = "written to the config file" if finished else "so far; no config written"
    out.append(f"  * fastest measured ({best_note})   d the run's own settings (the defaults)")
    return out


def header_lines(
    config: RunConfig, spec: ModelSpec, settings: Settings, device: torch.device, placement_note: str,
    rates_note: str, num_grid: int, num_fitting: int, num_selected: int,
) -> List[str]:
    n_params = sum(p.numel() for p in spec.module.parameters())
    t = config.tiers
    model = f"preset {config.model.preset}" if config.model.hf_path is None else f"{config.model.hf_path}"
    return [
        f"prefetch tuning: {model} ({n_params / 1e6:.2f} M parameters), {config.data.batch_size} x "
        f"{config.data.seq_len} tokens x {config.grad_accum_steps} micro-batch(es) per step, "
        f"{config.precision.compute_dtype.value}, device {device}, torch threads {torch.get_num_threads()}",
        f"  placement ({placement_note}): params {placement_text(t.params)}, grads {placement_text(t.grads)}, "
        f"optimizer {placement_text(t.optimizer)}; budgets: device {_bytes_or(t.device_budget_bytes, 'none')}, "
        f"host {_bytes_or(t.host_budget_bytes, 'none')}; nvme_dir {t.nvme_dir}",
        f"  machine rates: {rates_note}",
        f"  grid: {num_grid} points, {num_fitting} fit the budgets; measuring {num_selected}: the defaults and the "
        f"{num_selected - 1} other fastest predicted (--max-points {settings.max_points}), "
        f"{settings.num_warmup_steps} warmup + {settings.num_steps} timed step(s) each",
        "  buffer counts (device slots, host staging) follow from the budgets and the lookahead (memory_plan); "
        "they are not a separate setting in this version",
    ]


def point_json(i: int, r: PointResult, best: Optional[int]) -> Dict[str, Any]:
    m = r.measurement
    pred = r.prediction.step_s
    return {
        "index": i,
        "grid_index": r.prediction.grid_index,
        "settings": r.prediction.point.as_dict(),
        "predicted_s": pred,
        "measured_s": m.step_s if m else None,
        "predicted_over_measured": pred / m.step_s if m and pred is not None and m.step_s > 0 else None,
        "io_wait_s": m.io_wait_s if m else None,
        "compute_s": m.compute_s if m else None,
        "optimizer_s": m.optimizer_s if m else None,
        "step_times_s": m.step_times_s if m else None,
        "peak_bytes": {t.value: n for t, n in m.peak_bytes.items()} if m else None,
        "within_budgets": (not m.over_budget) if m else None,
        "direct_io": m.direct_io if m else None,
        "problem": r.problem,
        "is_best": i == best,
        "is_defaults": i == 0,
    }


# -- the config file -----------------------------------------------------------------------------


def config_text(config: RunConfig, out: Path) -> str:
    return config.to_json() if out.suffix.lower() == ".json" else config.to_toml()


def check_round_trip(config: RunConfig, out: Path) -> None:
    """UsageError unless `offload-train --config out` would read `config` back as it is."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"check{out.suffix.lower()}"
        path.write_text(config_text(config, out), encoding="utf-8")
        back = cli.resolve_config(str(path), {})
    if back != config:
        lost = sorted(k for k, v in _flat(config.to_dict()).items() if _flat(back.to_dict()).get(k) != v)
        raise UsageError(
            f"--out {str(out)!r}: a {out.suffix.lower()} file cannot carry {', '.join(lost)} as set here (TOML has no "
            "none, and offload-train's defaults would fill it in); write --out with a .json suffix"
        )


def _flat(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and prefix == "":
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def write_config(config: RunConfig, out: Path) -> None:
    """Write atomically (io_engine.atomic_file: a temporary file beside it, fsync, rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, config_text(config, out))


# -- the run -------------------------------------------------------------------------------------


def resolve_placement(
    config: RunConfig, spec: ModelSpec, device: torch.device, rates: MachineRates, cache_path: Path,
) -> Tuple[RunConfig, str]:
    """The config with placement "manual" and its tiers resolved (by the planner when "auto")."""
    if config.placement is PlacementMode.MANUAL:
        return config, "manual, as configured"
    try:
        choice = plan_for_model(spec, config, micro_batch(config), device, cache_path=cache_path, rates=rates, progress=say)
    except (PlanError, ValueError) as exc:
        raise UsageError(f"placement auto: {exc}") from None
    return choice.apply(config), f"auto, chosen by the planner with lookahead {choice.chosen.lookahead_groups}"


def _say_measuring(line: str) -> None:
    """machine_rates' progress, less its line per cache hit (the header counts them)."""
    if not line.startswith("machine rates from the cache"):
        say(line)


def rates_for(
    grid: Sequence[GridPoint], config: RunConfig, device: torch.device, cache_path: Path, size_bytes: int,
) -> Tuple[Dict[IOConfig, MachineRates], str]:
    """This machine's rates for each IO setting of the grid (cached per setting), and where they came from."""
    rates: Dict[IOConfig, MachineRates] = {}
    cached = 0
    for io in dict.fromkeys(p.io(config.io) for p in grid):
        try:
            rates[io], from_cache = machine_rates(config.tiers.nvme_dir, io, device, cache_path=cache_path,
                                                  progress=_say_measuring, size_bytes=size_bytes)
        except (ValueError, NotEnoughSpaceError) as exc:
            raise UsageError(f"measuring the machine's rates: {exc}") from None
        cached += from_cache
    return rates, (f"{len(rates)} IO setting(s), {cached} from the cache {cache_path}, "
                   f"{len(rates) - cached} measured now")


def run(settings: Settings) -> Dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache_path = default_cache_path()
    given = settings.config
    try:
        lm = build_causal_lm(given)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    spec = ModelSpec.from_module(lm.model, activation_checkpointing=given.model.activation_checkpointing)
    vocab_size = lm.tokenizer.vocab_size
    del lm

    base_rates, _ = rates_for([GridPoint.of(given)], given, device, cache_path, settings.rates_size_bytes)
    config, placement_note = resolve_placement(given, spec, device, base_rates[given.io], cache_path)
    config = dataclasses.replace(config, placement=PlacementMode.MANUAL)
    check_round_trip(config, settings.out)
    defaults = GridPoint.of(config)
    (base,) = predict_grid([defaults], config, spec, device, base_rates, cache_path)
    if base.step_s is None:
        raise UsageError(f"the run as configured: {base.refusal}")
    grid = make_grid(config, spec)
    rates, rates_note = rates_for(grid, config, device, cache_path, settings.rates_size_bytes)
    predictions = predict_grid(grid, config, spec, device, rates, cache_path)
    selected = select_points(predictions, defaults, settings.max_points)
    num_fitting = sum(p.step_s is not None for p in predictions)
    header = header_lines(config, spec, settings, device, placement_note, rates_note, len(grid), num_fitting,
                          len(selected))

    batches = make_batches(config, vocab_size, settings.num_warmup_steps + settings.num_steps)
    results: List[PointResult] = []
    bar = tqdm(total=len(selected), desc="tune_prefetch", unit="point", file=sys.stderr,
               disable=not sys.stderr.isatty(), dynamic_ncols=True)
    try:
        for i, prediction in enumerate(selected):
            p = prediction.point
            say(f"point {i + 1}/{len(selected)}{' (defaults)' if i == 0 else ''}: lookahead {p.lookahead_groups}, "
                f"lookahead_bytes {_bytes_or(p.lookahead_bytes, 'none')}, max_group_bytes "
                f"{_bytes_or(p.max_group_bytes, 'none')}, io {p.io_num_threads} threads x {p.io_queue_depth} in "
                f"flight; predicted {prediction.step_s:.4f} s")
            result = run_point(prediction, p.apply(config), batches, settings, device)
            results.append(result)
            m = result.measurement
            say(f"point {i + 1}/{len(selected)}: " + (
                f"{m.step_s:.4f} s per step, io wait {m.io_wait_s:.4f} s" if m else "not measured")
                + (f" ({result.problem})" if result.problem else ""))
            best = best_index(results)
            if best is not None:
                bar.set_postfix(best=f"p{best + 1} {results[best].measurement.step_s:.4f}s")  # type: ignore[union-attr]
            bar.update(1)
    except (KeyboardInterrupt, Terminated):
        bar.close()
        left = remove_left_swap(config.tiers.nvme_dir)
        if left:
            print(f"{PROG}: SWAP FILES LEFT after the interrupted point (a bug; now removed): {left}", file=sys.stderr)
        print("\n".join(header + [f"  interrupted after {len(results)} of {len(selected)} point(s)"]
                        + table_lines(results, best_index(results), finished=False)), flush=True)
        raise
    bar.close()

    best = best_index(results)
    violations = sum(r.broke_invariant for r in results)
    if best is None:
        problems = "; ".join(f"p{i + 1}: {r.problem}" for i, r in enumerate(results))
        raise UsageError(f"no point could be measured: {problems}")
    best_result = results[best]
    write_config(best_result.config, settings.out)
    defaults_m = results[0].measurement if results[0].ok else None
    speedup = defaults_m.step_s / best_result.measurement.step_s if defaults_m else None  # type: ignore[union-attr]
    lines = header + table_lines(results, best)
    lines.append(
        f"best: p{best + 1}, {best_result.measurement.step_s:.4f} s per step"  # type: ignore[union-attr]
        + (f", {speedup:.2f}x the defaults' speed" if speedup is not None else "")
    )
    lines.append(f"wrote {settings.out} (train with: offload-train --config {settings.out})")
    print("\n".join(lines), flush=True)
    if violations:
        print(f"{PROG}: {violations} point(s) broke a budget or left swap files: a bug, see the table", file=sys.stderr)
    return {
        "points": [point_json(i, r, best) for i, r in enumerate(results)],
        "best": best,
        "defaults": 0,
        "speedup": speedup,
        "out": str(settings.out),
        "placement": {k: placement_text(getattr(config.tiers, k)) for k in ("params", "grads", "optimizer")},
        "num_grid_points": len(grid),
        "num_fitting": num_fitting,
        "steps": settings.num_steps,
        "warmup_steps": settings.num_warmup_steps,
        "device": str(device),
        "num_violations": violations,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    # A point that broke a budget or left swap files is a bug: exit 1 after the table.
    return run_cli(
        argv, build_parser(), VALUE_FLAGS, settings_from_args, run, "no config written, the swap files were removed",
        exit_status=lambda out: 1 if out["num_violations"] else 0,
    )


if __name__ == "__main__":
    sys.exit(main())
