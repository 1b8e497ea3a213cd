"""The prefetch tuner's command line: its flags and the Settings they validate into.

The run is read as offload-train reads it (cli.resolve_config); bad input raises UsageError
naming the value and the fix. Run the tuner as `python3 scripts/tune_prefetch.py` (usage in
tune_prefetch.py's docstring).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from offload_trainer.app import cli, run_checks
from offload_trainer.app.bench.bench_cli import UsageError, parse_int
from offload_trainer.app.user_errors import OneLineParser
from offload_trainer.app.run_config import RunConfig
from offload_trainer.config import PlacementMode, format_bytes, parse_bytes
from offload_trainer.config.byte_size import BYTE_SIZE_HELP
from offload_trainer.planning.machine import DEFAULT_SIZE_BYTES

PROG = "offload-tune-prefetch"
DEFAULT_STEPS = 2
DEFAULT_WARMUP_STEPS = 1
DEFAULT_MAX_POINTS = 6
DEFAULT_OUT = "tuned.toml"


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
    rates_size_bytes: Optional[int]
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
    p = OneLineParser(
        prog=PROG,
        epilog=f"Sizes (--device-budget, --host-budget, --rates-size) are {BYTE_SIZE_HELP}.",
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
                   f"(default {format_bytes(DEFAULT_SIZE_BYTES)}, less on a disk with less room)")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last stdout line")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate the command line; UsageError with the value and the fix for anything wrong."""
    overrides = {key: getattr(args, flag) for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None}
    try:
        config = cli.resolve_config(args.config, overrides)
        # The checks offload-train makes of the same run before building it (paths are the tuner's own).
        if config.model.hf_path is not None:
            run_checks.check_hf_dir(config.model.hf_path)
        shape, longest, model = run_checks.model_limits(config)
        run_checks.check_seq_len(config.data.seq_len, longest, model, "max_seq_len" if config.model.hf_path is None
                                 else "max_position_embeddings")
        run_checks.check_io(config.io, None)  # the budgets: the planner's refusal names the fix
        run_checks.check_micro_batch_memory(config, shape, 1)
        if config.tiers.nvme_dir is not None:
            run_checks.check_directory_to_write(config.tiers.nvme_dir, "tiers.nvme_dir")
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    out = Path(args.out)
    if out.suffix.lower() not in (".toml", ".json"):
        raise UsageError(f"--out {args.out!r} must end in .toml or .json (offload-train --config reads those)")
    if out.is_dir():
        raise UsageError(f"--out {args.out!r} is a directory; name a file such as {DEFAULT_OUT}")
    try:  # before minutes of measuring: the config is written only at the end
        run_checks.check_directory_to_write(str(out.parent), "--out's directory")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    rates_size: Optional[int] = None  # the planner's default: what fits the disk
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
