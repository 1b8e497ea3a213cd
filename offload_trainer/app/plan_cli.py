"""offload-plan: where a model's training state should live on this machine, and how fast it will train.

    offload-plan --model.preset 350m --tiers.host_budget_bytes 3GiB --tiers.nvme_dir /nvme
    offload-plan --config run.toml --world-size 8 --json
    offload-plan --hf-config path/to/model_dir --write-config planned.toml
    offload-plan --model.preset 70b --tiers.nvme_dir /nvme --no-measure     # the fit check alone: seconds

It reads the same config as offload-train (file, then --section.field overrides). Its first line
is the fit check, which needs no timing: a model that cannot fit ends there, once, with the
numbers and the smallest changes that would make it fit (exit 2). Then it measures the machine
once (cached; --refresh measures again) and prints the ZeRO bytes per rank, the chosen placement
and lookahead, bytes moved per step, the predicted time per phase (forward and backward per
micro-batch, the optimizer per step), the bottleneck and why, and the config's own placement
beside the planned one. --no-measure stops before measuring: bytes only, no times. --write-config
saves the planned config (with --hf-config, model.hf_path names that model), which offload-train
--config accepts; under --no-measure it saves placement = "auto", which offload-train plans at start.

Every mistake (a flag, a setting, a path, a file that is not what it should be) ends with one line
on stderr and exit status 2; Ctrl-C, SIGTERM and SIGHUP end it with the machine's test files
removed (130, 143, 129).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from io_engine.atomic_file import write_atomic

from offload_trainer.app.causal_lm import library_refusal, library_warnings_as_python_warnings, refuse_non_causal
from offload_trainer.app.cli import ConfigHelpParser, _split_overrides, refuse_misspelt_flags, resolve_config
from offload_trainer.app.hub_names import looks_like_hub_name, model_download_hint
from offload_trainer.app.run_checks import (
    check_batch_over_ranks,
    check_directory_to_write,
    check_io,
    check_num_threads,
    check_seq_len,
    read_hf_config,
    with_real_nvme_dir,
)
from offload_trainer.app.lora import LoraModel
from offload_trainer.app.run_config import MicroBatchOrder, RunConfig
from offload_trainer.app.signals import Terminated, ending_signals
from offload_trainer.app.std_streams import escape_unencodable_output, stdout_gone
from offload_trainer.app.torch_threads import use_run_threads
from offload_trainer.app.user_errors import (
    EXIT_USAGE,
    PathRole,
    describe_user_error,
    naming_path,
    warnings_as_lines,
)
from offload_trainer.models.decoder import DecoderConfig
from offload_trainer.config import PlacementMode
from offload_trainer.planning.model_spec import (
    MicroBatch,
    ModelSpec,
    activations,
    plan_for_model,
    refuse_if_nothing_fits,
)
from offload_trainer.planning.layer_major_estimate import estimate_layer_major
from offload_trainer.planning.zero_memory import check_hf_sizes
from offload_trainer.planning.planner import Candidate, PlacementChoice, evaluate
from offload_trainer.planning.report import as_dict, compare_lines, fit_line, render, same_placement

PROG = "offload-plan"
MAX_WORLD_SIZE = 2**31 - 1
"""The most ranks torch.distributed counts (a rank is an int32)."""


def _spec(cfg: RunConfig, hf_config: Optional[str]) -> ModelSpec:
    """The model offload-train would train: with [lora] on, wrapped with its adapters, the base frozen (no
    gradients or optimizer states for it, as the engine keeps none), as causal_lm.py wraps it."""
    ckpt = cfg.model.activation_checkpointing
    hugging_face = hf_config is not None or cfg.model.hf_path is not None
    if hugging_face:
        path = Path(hf_config) if hf_config is not None else Path(str(cfg.model.hf_path))
        setting = "--hf-config" if hf_config is not None else "model.hf_path"
        # transformers' own refusals (no model_type, an unknown one) name neither the setting nor the fix;
        # its warnings (logged straight to stderr) are shown only for a model that is then planned: a
        # refusal stays one line
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with library_refusal(f"{setting} {str(path)!r}: its config.json cannot be built into a causal LM", path):
                with library_warnings_as_python_warnings():
                    spec = ModelSpec.from_hf_config(path, ckpt)
            refuse_non_causal(spec.module, f"{setting} {str(path)!r}")  # as offload-train refuses it
        for warning in {str(w.message): w for w in caught}:
            warnings.warn(warning, stacklevel=2)
    else:
        spec = ModelSpec.from_preset(cfg.model.preset, ckpt, max_seq_len=max(cfg.data.seq_len, 1))
    if not cfg.lora.enabled:
        return spec
    lora = LoraModel.wrap(spec.module, cfg.lora, cfg.seed, causal_lm=hugging_face)
    return dataclasses.replace(spec, name=f"{spec.name} with LoRA adapters (rank {cfg.lora.rank})", module=lora.model)


def _device(text: Optional[str]) -> torch.device:
    """--device as a torch.device that exists on this machine."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {text!r} is not a device: use cpu or cuda (cuda:N for one GPU)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text!r}: offload-plan plans for cpu or cuda only")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text!r}: this machine has no CUDA device; use --device cpu")
    return device


def _check_inputs(args: argparse.Namespace, cfg: RunConfig) -> None:
    """What can be checked before the model is built or anything measured."""
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:  # 10**30 planned, and printed sizes of 10**19 PiB
        raise ValueError(
            f"--world-size {args.world_size} must be from 1 to {MAX_WORLD_SIZE} (torch.distributed's int32)"
        )
    check_batch_over_ranks(cfg.data.batch_size, args.world_size)  # as offload-train refuses it
    if args.write_config is not None:
        out = Path(args.write_config)
        if not args.write_config.strip() or out.suffix.lower() != ".toml":
            raise ValueError(
                f"--write-config {args.write_config!r} must name a .toml file (offload-train --config reads it)"
            )
        parent = out.parent if str(out.parent) else Path(".")
        if not parent.is_dir():
            raise ValueError(
                f"--write-config {args.write_config!r}: the directory {str(parent)!r} does not exist; create it first"
            )
        if out.is_dir():
            raise ValueError(f"--write-config {args.write_config!r} is a directory; name a file such as planned.toml")
        check_directory_to_write(str(parent), "--write-config")
    if cfg.tiers.nvme_dir is not None:
        check_directory_to_write(cfg.tiers.nvme_dir, "tiers.nvme_dir")
    check_io(cfg.io, None)  # the planner itself weighs the budgets
    check_num_threads(cfg.train.num_threads)  # as offload-train refuses it
    hf = args.hf_config if args.hf_config is not None else cfg.model.hf_path
    if hf is not None:
        setting = "--hf-config" if args.hf_config is not None else "model.hf_path"
        if looks_like_hub_name(hf):
            raise ValueError(f"{setting}: {hf} does not exist{model_download_hint(hf, setting)}")
        file = Path(hf) / "config.json" if Path(hf).is_dir() else Path(hf)
        raw = read_hf_config(file, setting)
        if file.name != "config.json":
            # The plan (and the config --write-config saves, as model.hf_path) names the file's directory,
            # where config.json is read: another name passed this check, then failed naming the directory.
            raise ValueError(
                f"{setting} {hf!r} is a file named {file.name!r}: give the model's directory, or its file named "
                "config.json (rename it so)"
            )
        check_hf_sizes(raw)  # as offload-train does: an impossible size is named before anything is built from it
        longest = raw.get("max_position_embeddings")
        if isinstance(longest, int) and not isinstance(longest, bool):
            check_seq_len(cfg.data.seq_len, longest, f"the model of {file}", "max_position_embeddings")
    else:
        longest = DecoderConfig.preset(cfg.model.preset).max_seq_len
        check_seq_len(cfg.data.seq_len, longest, f"the {cfg.model.preset} preset", "max_seq_len")


def _with_hf_path(cfg: RunConfig, hf_config: Optional[str]) -> RunConfig:
    """With --hf-config, the config names that model (model.hf_path, absolute), so that the config
    --write-config saves trains it."""
    if hf_config is None:
        return cfg
    path = Path(hf_config)
    directory = path if path.is_dir() else path.parent
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=str(directory.resolve())))


def _yours(cfg: RunConfig, spec: ModelSpec, choice: PlacementChoice, world_size: int) -> Optional[Candidate]:
    """The config's own placement (placement = "manual") through the planner's cost model, with the
    rates and compute times the plan used; None when it has no path for this device."""
    placement = (cfg.tiers.params, cfg.tiers.grads, cfg.tiers.optimizer)
    return evaluate(
        spec.partition(cfg, world_size), cfg, choice.machine, choice.compute, choice.activation_bytes, placement,
        cfg.prefetch.lookahead_groups,
    )


def _plan(args: argparse.Namespace, cfg: RunConfig, device: torch.device) -> int:
    """The fit check (printed first, nothing timed), then unless --no-measure the measured plan."""
    spec = _spec(cfg, args.hf_config)
    planned_cfg = with_real_nvme_dir(cfg)
    # One rank's share of the global micro-batch, as offload-train runs it (it planned the whole batch on each rank).
    micro_batch = MicroBatch(cfg.data.batch_size // args.world_size, cfg.data.seq_len)
    partition = spec.partition(planned_cfg, args.world_size)
    ckpt_acts = None if spec.activation_checkpointing else activations(spec, cfg, micro_batch, True, device)
    fit = refuse_if_nothing_fits(
        spec, planned_cfg, micro_batch, device, partition, ckpt_acts, lambda w: spec.partition(planned_cfg, w)
    )
    print(f"{PROG}: {fit_line(fit)}", flush=True)
    timed = not args.no_measure
    if timed:
        use_run_threads(cfg.train.num_threads)  # compute is timed with the threads offload-train will use
        progress = (lambda msg: print(f"{PROG}: {msg}", file=sys.stderr)) if not args.json else None
        choice = plan_for_model(
            spec, planned_cfg, micro_batch, device, world_size=args.world_size, refresh=args.refresh,
            progress=progress, partition=partition,
        )
    else:
        choice = fit
    if choice.memory_note is not None:
        warnings.warn(choice.memory_note, stacklevel=1)
    yours = None
    if cfg.placement is PlacementMode.MANUAL:
        yours = _yours(planned_cfg, spec, choice, args.world_size)
        if yours is not None and same_placement(yours, choice.chosen):
            yours = None
    numel = sum(p.numel() for p in spec.module.parameters())  # parameters() yields a tied weight once
    title = (
        f"{PROG}: {spec.name}, {numel / 1e6:.2f} M parameters, {cfg.precision.compute_dtype.value}, "
        f"{cfg.optimizer.kind.value}; {args.world_size} rank(s); micro-batch {micro_batch.batch_size} x "
        f"{cfg.data.seq_len} tokens{' per rank' if args.world_size > 1 else ''}, {cfg.grad_accum_steps} per step"
    )
    print(render(choice, title, numel, args.world_size, cfg, ckpt_acts, timed=timed))
    layer_major = None
    if cfg.train.micro_batch_order is MicroBatchOrder.LAYER_MAJOR:
        layer_major = estimate_layer_major(
            spec, partition, choice.chosen.cost, micro_batch, cfg.grad_accum_steps,
            cfg.precision.compute_dtype.torch_dtype.itemsize, choice.activation_bytes, device,
        )
        print("\n" + "\n".join(layer_major.lines()))
    if cfg.placement is PlacementMode.MANUAL and (yours is not None):
        print("\n" + "\n".join(compare_lines(yours, choice, timed)))
    if args.world_size > 1 and timed:
        print("  (communication between ranks is not in the prediction)")
    if args.write_config:
        written = choice.apply(cfg) if timed else dataclasses.replace(cfg, placement=PlacementMode.AUTO)
        written = written.with_absolute_paths()  # relative ones meant this directory, not offload-train's
        with naming_path(args.write_config):
            write_atomic(args.write_config, written.to_toml())
        how = "the planned placement" if timed else 'placement = "auto" (offload-train plans at start)'
        print(f"wrote {args.write_config} ({how})")
    if args.json:
        out = as_dict(choice, numel, args.world_size, cfg, ckpt_acts, timed=timed, yours=yours)
        if layer_major is not None:
            out["layer_major"] = layer_major.as_dict()
        print(json.dumps(out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ConfigHelpParser(
        prog=PROG,
        description="Plan where a model's parameters, gradients and optimizer states live, and predict the step time.",
        epilog="Any config field: --section.field VALUE (e.g. --model.preset 350m --tiers.host_budget_bytes 3GiB).",
    )
    parser.add_argument("--config", help="a TOML or JSON config file, as offload-train reads it")
    parser.add_argument("--hf-config", help="plan for a Hugging Face model: its config.json (or the directory)")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks sharing the state (default 1)")
    parser.add_argument("--device", default=None, help="compute device (default cuda if available, else cpu)")
    parser.add_argument("--refresh", action="store_true", help="measure the machine again instead of using the cache")
    parser.add_argument(
        "--no-measure", action="store_true",
        help="check the fit and count bytes only; time nothing (seconds even for a 70b model)",
    )
    parser.add_argument(
        "--write-config", metavar="PATH", help="write the planned config (TOML) for offload-train --config"
    )
    parser.add_argument("--json", action="store_true", help="also print the plan as one JSON object on the last line")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    escape_unencodable_output()
    roles: List[PathRole] = []
    with ending_signals(), warnings_as_lines(PROG):
        try:
            parser = build_parser()
            args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
            for path, setting in ((args.config, "--config"), (args.hf_config, "--hf-config"),
                                  (args.write_config, "--write-config")):
                if path is not None:
                    roles.append(PathRole(path, setting))
            refuse_misspelt_flags(parser, rest)
            cfg = resolve_config(
                args.config, _split_overrides(rest), "--hf-config" if args.hf_config is not None else None
            )
            if cfg.tiers.nvme_dir is not None:
                roles.append(PathRole(cfg.tiers.nvme_dir, "tiers.nvme_dir"))
            device = _device(args.device)
            _check_inputs(args, cfg)
            cfg = _with_hf_path(cfg, args.hf_config)
            return _plan(args, cfg, device)
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted by Ctrl-C; the machine's test files were removed", file=sys.stderr)
            return 130
        except Terminated as stopped:
            print(
                f"{PROG}: interrupted by {stopped.signal_name}; the machine's test files were removed", file=sys.stderr
            )
            return stopped.exit_status
        except BrokenPipeError:  # `offload-plan | head`: the reader has what it wanted
            return stdout_gone()
        except (OSError, ValueError, TypeError) as exc:
            message = describe_user_error(exc, roles)
            print(f"{PROG}: {message}", file=sys.stderr)
            return EXIT_USAGE
        except Exception as exc:  # noqa: BLE001 - only a safetensors error is the user's; the rest re-raised
            message = describe_user_error(exc, roles)
            if message is None:
                raise
            print(f"{PROG}: {message}", file=sys.stderr)
            return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
