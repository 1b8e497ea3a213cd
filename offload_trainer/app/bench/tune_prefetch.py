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
the machine's rates for its IO settings, measured once and cached: the NVMe rates per IO setting,
the copy and optimizer rates, which no IO setting changes, with the first; a lookahead_bytes cap enters
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

The code, one concept a file in this folder: tune_settings.py (the command line and its
Settings), tune_grid.py (the grid, its predictions and the points chosen), tune_measure.py (one
point run through the engine), tune_report.py (the table, the JSON object and the config file
written); run() here ties them together.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from tqdm import tqdm

from offload_trainer.app.bench.bench_cli import Terminated, UsageError, run_cli
from offload_trainer.app.bench.tune_grid import GridPoint, make_grid, micro_batch, predict_grid, select_points
from offload_trainer.app.bench.tune_measure import PointResult, make_batches, remove_left_swap, run_point
from offload_trainer.app.bench.tune_report import (
    best_index,
    bytes_or,
    check_round_trip,
    header_lines,
    placement_text,
    point_json,
    table_lines,
    write_config,
)
from offload_trainer.app.bench.tune_settings import PROG, VALUE_FLAGS, Settings, build_parser, settings_from_args
from io_engine import IOConfig, NotEnoughSpaceError
from offload_trainer.app.causal_lm import build_causal_lm
from offload_trainer.app.progress import draws_bars
from offload_trainer.app.run_config import RunConfig
from offload_trainer.config import PlacementMode
from offload_trainer.planning.machine import MachineRates, default_cache_path, machine_rates
from offload_trainer.errors import PlanError
from offload_trainer.planning.model_spec import ModelSpec, plan_for_model


def say(line: str) -> None:
    """A progress line on stderr, above the progress bar when there is one."""
    tqdm.write(f"tune_prefetch: {line}", file=sys.stderr)


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


def _say_measuring(io: IOConfig, index: int, count: int) -> Callable[[str], None]:
    """machine_rates' progress for the IO setting `index` of `count`, less its line per cache hit (the
    header counts them). Each line names the setting: the rates are measured (and cached) per setting,
    and the same lines for each read as one measurement printed several times."""
    threads = io.worker_threads()
    label = f"IO setting {index}/{count} ({threads} threads x {io.queue_depth} in flight): " if count > 1 else ""

    def show(line: str) -> None:
        if not line.startswith("machine rates from the cache"):
            say(label + line)

    return show


def rates_for(
    grid: Sequence[GridPoint], config: RunConfig, device: torch.device, cache_path: Path, size_bytes: Optional[int],
) -> Tuple[Dict[IOConfig, MachineRates], str]:
    """This machine's rates for each IO setting of the grid (cached per setting), and where they came from.

    The copy and optimizer rates are measured once, with the first setting measured: only the NVMe
    rates depend on the IO setting."""
    rates: Dict[IOConfig, MachineRates] = {}
    cached = 0
    settings = list(dict.fromkeys(p.io(config.io) for p in grid))
    for index, io in enumerate(settings, 1):
        try:
            rates[io], from_cache = machine_rates(config.tiers.nvme_dir, io, device, cache_path=cache_path,
                                                  progress=_say_measuring(io, index, len(settings)),
                                                  size_bytes=size_bytes, device_rates=next(iter(rates.values()), None))
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

    own = GridPoint.of(given)  # its IO threads as started here (an unset io.num_threads: this machine's count)
    base_rates, _ = rates_for([own], given, device, cache_path, settings.rates_size_bytes)
    config, placement_note = resolve_placement(given, spec, device, base_rates[own.io(given.io)], cache_path)
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
               disable=not draws_bars(sys.stderr), dynamic_ncols=True)
    try:
        for i, prediction in enumerate(selected):
            p = prediction.point
            say(f"point {i + 1}/{len(selected)}{' (defaults)' if i == 0 else ''}: lookahead {p.lookahead_groups}, "
                f"lookahead_bytes {bytes_or(p.lookahead_bytes, 'none')}, max_group_bytes "
                f"{bytes_or(p.max_group_bytes, 'none')}, io {p.io_num_threads} threads x {p.io_queue_depth} in "
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
