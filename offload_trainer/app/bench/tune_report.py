"""What the prefetch tuner hands back: the table of points, the JSON object, and the config file written.

table_lines() and header_lines() are the table on stdout, point_json() a point of the --json
object, and write_config() writes the best point's config where offload-train --config reads
it (check_round_trip() first checks that it reads back the same). Run the tuner as
`python3 scripts/tune_prefetch.py` (usage in tune_prefetch.py's docstring).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from offload_trainer.app import cli
from offload_trainer.app.bench.bench_cli import UsageError
from offload_trainer.app.bench.tune_measure import PointResult
from offload_trainer.app.bench.tune_settings import Settings
from io_engine.atomic_file import write_atomic
from offload_trainer.app.run_config import RunConfig
from offload_trainer.config import Placement, Tier, format_bytes
from offload_trainer.planning.model_spec import ModelSpec


def placement_text(p: Placement) -> str:
    parts = [(t.value, p.fraction(t)) for t in Tier if p.fraction(t) > 0]
    if len(parts) == 1:
        return parts[0][0]
    return ",".join(f"{name}:{fraction:g}" for name, fraction in parts)


def bytes_or(value: Optional[int], none: str) -> str:
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
            mark, f"p{i + 1}", str(p.lookahead_groups), bytes_or(p.lookahead_bytes, "none"),
            bytes_or(p.max_group_bytes, "1 block"), str(p.io_num_threads), str(p.io_queue_depth),
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
        f"optimizer {placement_text(t.optimizer)}; budgets: device {bytes_or(t.device_budget_bytes, 'none')}, "
        f"host {bytes_or(t.host_budget_bytes, 'none')}; nvme_dir {t.nvme_dir}",
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
    """The config as `out`'s suffix writes it, its paths absolute: offload-train may read it from anywhere."""
    config = config.with_absolute_paths()
    return config.to_json() if out.suffix.lower() == ".json" else config.to_toml()


def check_round_trip(config: RunConfig, out: Path) -> None:
    """UsageError unless `offload-train --config out` would read `config` back as it is (its paths absolute)."""
    config = config.with_absolute_paths()
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
