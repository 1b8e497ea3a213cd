"""offload-plan: where a model's training state should live on this machine, and how fast it will train.

    offload-plan --model.preset 350m --tiers.host_budget_bytes 3GiB --tiers.nvme_dir /nvme
    offload-plan --config run.toml --world-size 8 --json
    offload-plan --hf-config path/to/config.json --write-config planned.toml

It reads the same config as offload-train (file, then --section.field overrides), measures the
machine once (cached; --refresh measures again), and prints the ZeRO bytes per rank, the chosen
placement and lookahead, bytes moved per step, the predicted time per phase, the bottleneck and
why. A model that cannot fit ends with the numbers and the smallest changes that would make it
fit (exit 2). --write-config saves the planned config, which offload-train --config accepts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from io_engine.atomic_file import write_atomic

from offload_trainer.app.cli import _split_overrides, resolve_config
from offload_trainer.app.run_config import RunConfig
from offload_trainer.errors import PlanError
from offload_trainer.planning.model_spec import MicroBatch, ModelSpec, activations, plan_for_model
from offload_trainer.planning.report import as_dict, render


def _spec(cfg: RunConfig, hf_config: Optional[str]) -> ModelSpec:
    ckpt = cfg.model.activation_checkpointing
    if hf_config is not None:
        return ModelSpec.from_hf_config(hf_config, ckpt)
    if cfg.model.hf_path is not None:
        return ModelSpec.from_hf_config(Path(cfg.model.hf_path), ckpt)
    return ModelSpec.from_preset(cfg.model.preset, ckpt, max_seq_len=max(cfg.data.seq_len, 1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="offload-plan",
        description="Plan where a model's parameters, gradients and optimizer states live, and predict the step time.",
        epilog="Any config field: --section.field VALUE (e.g. --model.preset 350m --tiers.host_budget_bytes 3GiB).",
    )
    parser.add_argument("--config", help="a TOML or JSON config file, as offload-train reads it")
    parser.add_argument("--hf-config", help="plan for a Hugging Face model: its config.json (or the directory)")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks sharing the state (default 1)")
    parser.add_argument("--device", default=None, help="compute device (default cuda if available, else cpu)")
    parser.add_argument("--refresh", action="store_true", help="measure the machine again instead of using the cache")
    parser.add_argument("--write-config", metavar="PATH", help="write the planned config (TOML) for offload-train --config")
    parser.add_argument("--json", action="store_true", help="also print the plan as one JSON object on the last line")
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.world_size < 1:
            raise ValueError(f"--world-size {args.world_size} must be at least 1")
        cfg = resolve_config(args.config, _split_overrides(rest))
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        spec = _spec(cfg, args.hf_config)
        progress = (lambda msg: print(f"offload-plan: {msg}", file=sys.stderr)) if not args.json else None
        micro_batch = MicroBatch(cfg.data.batch_size, cfg.data.seq_len)
        choice = plan_for_model(
            spec, cfg, micro_batch, device, world_size=args.world_size, refresh=args.refresh, progress=progress
        )
    except (ValueError, TypeError, PlanError, FileNotFoundError) as exc:
        print(f"offload-plan: {exc}", file=sys.stderr)
        return 2
    numel = sum(p.numel() for p in spec.module.parameters())  # parameters() yields a tied weight once
    ckpt_acts = None if spec.activation_checkpointing else activations(spec, cfg, micro_batch, True)
    title = (
        f"offload-plan: {spec.name}, {numel / 1e6:.2f} M parameters, {cfg.precision.compute_dtype.value}, "
        f"{cfg.optimizer.kind.value}; {args.world_size} rank(s); micro-batch {cfg.data.batch_size} x "
        f"{cfg.data.seq_len} tokens, {cfg.grad_accum_steps} per step"
    )
    print(render(choice, title, numel, args.world_size, cfg, ckpt_acts))
    if args.world_size > 1:
        print("  (communication between ranks is not in the prediction)")
    if args.write_config:
        write_atomic(args.write_config, choice.apply(cfg).to_toml())
        print(f"wrote {args.write_config}")
    if args.json:
        print(json.dumps(as_dict(choice, numel, args.world_size, cfg, ckpt_acts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
