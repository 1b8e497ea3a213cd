"""offload-train: the command line of the trainer (also `python -m offload_trainer`).

    offload-train                                   # the default run: built-in model and corpus
    offload-train --config run.toml --optimizer.lr 3e-4 --train.steps 1000
    offload-train --resume latest                   # continue the run in train.out_dir

Every config field can be overridden as `--section.field value` (see README's config reference).
With no config file the run offloads parameters and optimizer states to NVMe under
.offload-scratch/swap. Mistakes end with one message naming the value and the fix, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from offload_trainer.app.run_config import DEFAULT_RUN, RunConfig
from offload_trainer.errors import CheckpointError, PlanError

def _split_overrides(rest: Sequence[str]) -> Dict[str, str]:
    overrides: Dict[str, str] = {}
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"unexpected argument {arg!r}: overrides are written --section.field value")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(rest):
                raise ValueError(f"--{key} needs a value: write --{key} VALUE")
            value = rest[i + 1]
            i += 1
        overrides[key.replace("-", "_")] = value
        i += 1
    return overrides


def resolve_config(config_path: Optional[str], overrides: Dict[str, str]) -> RunConfig:
    """DEFAULT_RUN, then the file (if any) on top, then the command line's overrides."""
    if config_path is None:
        return RunConfig.from_dict(DEFAULT_RUN).with_overrides(overrides)
    return RunConfig.from_file(config_path, defaults=DEFAULT_RUN).with_overrides(overrides)


def parse_args(argv: Sequence[str]) -> Tuple[argparse.Namespace, Dict[str, str]]:
    parser = argparse.ArgumentParser(
        prog="offload-train",
        description="Fine-tune a causal LM with parameters, gradients and optimizer states offloaded.",
        epilog="Any config field: --section.field VALUE (e.g. --optimizer.lr 3e-4 --train.steps 500).",
    )
    parser.add_argument("--config", help="a TOML or JSON config file (README: configuration reference)")
    parser.add_argument("--resume", help='"latest" (newest checkpoint in train.out_dir) or a checkpoint directory')
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args, rest = parser.parse_known_args(argv)
    return args, _split_overrides(rest)


def main(argv: Optional[List[str]] = None) -> int:
    from offload_trainer.app.trainer import format_summary, run, summary_json

    argv = sys.argv[1:] if argv is None else argv
    try:
        args, overrides = parse_args(argv)
        cfg = resolve_config(args.config, overrides)
        summary = run(cfg, resume=args.resume, progress=not args.no_progress)
        rank = _rank()
    except (ValueError, TypeError, CheckpointError, PlanError, FileNotFoundError) as exc:
        print(f"offload-train: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("offload-train: interrupted; the last complete checkpoint is intact (resume with --resume latest)", file=sys.stderr)
        return 130
    finally:
        _leave_ranks()
    if rank == 0:
        print(format_summary(summary))
        if args.json:
            print(json.dumps(summary_json(summary)))
    return 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _leave_ranks() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
