"""bench_offload's command line: the flags, the named configurations, and the validated Settings.

    settings = settings_from_args(build_parser().parse_args(["--config", "io-bound", "--device", "sim"]))

A configuration (--config) is a set of defaults for the shape, batch and placement flags; any of
those flags given on the command line wins over it. Run it as `python3 scripts/bench_offload.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import torch

import offload_trainer as ot
from io_engine import IOConfig
from io_engine.usable_cpus import usable_cpus
from offload_trainer.app.bench.bench_cli import UsageError, parse_directory, parse_int, parse_size
from offload_trainer.app.bench.heap_threshold import MAX_MMAP_THRESHOLD_BYTES
from offload_trainer.app.run_checks import micro_batch_memory_problem
from offload_trainer.app.user_errors import OneLineParser
from offload_trainer.config import byte_size
from offload_trainer.models import PRESETS, DecoderConfig, num_params
from offload_trainer.planning.host_memory import memory_available_bytes
from offload_trainer.planning.zero_memory import DecoderShape

GiB = 1 << 30
DEFAULT_DISK_BYTES = 1 * GiB
DEFAULT_DISK_REPEAT = 3
DEFAULT_COPY_DELAY_MS = 2.0
DEFAULT_ROUNDS = 2
PLACED_KINDS = ("params", "grads", "optimizer")
# The baseline holds parameters, gradients and two AdamW moments in memory (16 bytes per fp32
# parameter) next to the engine: refuse a model whose baseline alone would not fit this share.
MAX_BASELINE_SHARE_OF_AVAILABLE = 0.6
BASELINE_BYTES_PER_PARAM = 16


class DeviceKind(enum.Enum):
    """Where both runs compute."""

    CPU = "cpu"
    """The CPU; the device tier is host memory."""
    CUDA = "cuda"
    """The GPU: the baseline in GPU memory, the engine through its copy streams."""
    SIM = "sim"
    """The simulated accelerator (runtime/device/host.py): compute on the CPU, device memory kept
    apart, every copy finishing --copy-delay-ms late."""


class Side(enum.Enum):
    """Which run a process times: both interleaved (the default), or one of them (--compare-plain's workers)."""

    BOTH = "both"
    """The baseline and the engine in this process, steps interleaved."""
    BASELINE = "baseline"
    """Plain PyTorch in memory only."""
    ENGINE = "engine"
    """The engine only."""


@dataclass(frozen=True)
class NamedConfig:
    """Defaults of the shape, batch and placement flags under one name (--config)."""

    model: Mapping[str, object]
    """DecoderConfig fields."""
    batch_size: int
    seq_len: int
    placement: Mapping[str, str]
    """Placement text of "params", "grads" and "optimizer"."""
    description: str


CONFIGS: Dict[str, NamedConfig] = {
    "compute-bound": NamedConfig(
        model=PRESETS["small"], batch_size=16, seq_len=512,
        placement={"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
        description="the 9.6 M 'small' decoder, 16 x 512 tokens, all state on NVMe: compute dominates",
    ),
    "io-bound": NamedConfig(
        model=PRESETS["small"], batch_size=1, seq_len=16,
        placement={"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
        description="the same model, 1 x 16 tokens, all state on NVMe: the disk dominates",
    ),
    "gpt2-124m": NamedConfig(
        model=dict(vocab_size=50304, dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048,
                   max_seq_len=1024, tie_embeddings=True),
        batch_size=2, seq_len=256,
        placement={"params": "nvme", "grads": "host", "optimizer": "nvme"},
        description="GPT-2-style 124 M (12 x 768, tied, vocab 50304; SwiGLU 2048 = GPT-2's MLP numel), 2 x 256 "
        "tokens, parameters and optimizer states on NVMe",
    ),
}
DEFAULT_CONFIG = "compute-bound"
COMPARE_PLAIN_CONFIG = "gpt2-124m"


@dataclass(frozen=True)
class Settings:
    """Everything the command line asked for, validated."""

    config_name: str
    """The --config whose defaults the flags started from."""
    preset: Optional[str]
    """--preset, when given (its shape replaced the configuration's)."""
    model: DecoderConfig
    batch_size: int
    seq_len: int
    num_steps: int
    """Timed optimizer steps."""
    num_warmup_steps: int
    """Untimed optimizer steps before them (the engine records its schedule on the first)."""
    grad_accum: int
    layer_major: bool
    """--micro-batch-order layer_major: the engine's step runs every micro-batch through each block in
    turn (Engine.forward_backward_layer_major), each group fetched once per step each way."""
    placement: Dict[str, ot.Placement]
    """Placement of "params", "grads" and "optimizer"."""
    nvme_dir: str
    """Absolute path; swap files go into a private directory made under it."""
    device_budget_bytes: Optional[int]
    host_budget_bytes: Optional[int]
    lookahead: int
    num_threads: Optional[int]
    """torch.set_num_threads, or None for torch's default."""
    grad_clip_norm: Optional[float]
    disk_bytes: int
    num_disk_repeats: int
    seed: int
    emit_json: bool
    verify_checksums: bool
    """io.verify_checksums of the engine (--no-verify-checksums: False)."""
    release_idle_memory: bool
    """tiers.release_idle_memory of the engine (--release-idle-memory: True)."""
    device: DeviceKind
    copy_delay_s: float
    """Delay of every copy of the simulated accelerator (--device sim only; 0 elsewhere)."""
    compute_dtype: ot.ComputeDtype
    compare_plain: bool
    """Run plain PyTorch and the engine each in a process of its own, alternating, for num_rounds."""
    num_rounds: int
    side: Side
    """What this process times (--only; --compare-plain starts workers with it)."""
    worker_flags: tuple[str, ...]
    """The flags a --compare-plain worker gets (before its --only and --json)."""
    malloc_mmap_threshold_bytes: Optional[int] = None
    """--malloc-mmap-threshold: glibc's mmap threshold fixed in the process that trains (both
    workers under --compare-plain); None: glibc's own, rising threshold ([Note: Freed heap memory
    and peak RSS] in heap_threshold.py)."""

    @property
    def uses_nvme(self) -> bool:
        return any(p.nvme > 0.0 for p in self.placement.values())

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum

    def offload_config(self) -> ot.OffloadConfig:
        return ot.OffloadConfig(
            tiers=ot.TierConfig(
                params=self.placement["params"],
                grads=self.placement["grads"],
                optimizer=self.placement["optimizer"],
                device_budget_bytes=self.device_budget_bytes,
                host_budget_bytes=self.host_budget_bytes,
                nvme_dir=self.nvme_dir if self.uses_nvme else None,
                release_idle_memory=self.release_idle_memory,
            ),
            prefetch=ot.PrefetchConfig(lookahead_groups=self.lookahead),
            optimizer=ot.OptimizerConfig(grad_clip_norm=self.grad_clip_norm),
            precision=ot.PrecisionConfig(compute_dtype=self.compute_dtype),
            grad_accum_steps=self.grad_accum,
            seed=self.seed,
            io=IOConfig(verify_checksums=self.verify_checksums),
        )


def format_bytes(num_bytes: float) -> str:
    """'1.50 GiB', '38.60 MiB', '1.00 GiB', '512 B': this report keeps two decimals on whole units too."""
    return byte_size.format_bytes(num_bytes, whole_without_decimals=False)


# -- parsing -------------------------------------------------------------------------------------


def parse_placement(text: str, flag: str) -> ot.Placement:
    try:
        return ot.Placement.parse(text)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{flag}: {exc}") from None


def parse_choice(text: str, flag: str, choices: Mapping[str, object]) -> str:
    if text not in choices:
        first = next(iter(choices))
        raise UsageError(f"{flag} {text!r} is not one of {', '.join(choices)}; for example {flag} {first}")
    return text


def model_config(args: argparse.Namespace, named: NamedConfig) -> DecoderConfig:
    """The configuration's shape (or --preset's), with the shape flags given; --dim without --ffn-dim
    takes Llama's ffn rule."""
    if args.preset is not None and args.preset not in PRESETS:
        raise UsageError(f"--preset {args.preset!r} is not a preset; choose one of {', '.join(PRESETS)}")
    base = dict(PRESETS[args.preset] if args.preset is not None else named.model)
    flags = {"--dim": "dim", "--layers": "n_layers", "--heads": "n_heads", "--kv-heads": "n_kv_heads",
             "--vocab": "vocab_size", "--ffn-dim": "ffn_dim"}
    for flag, field in flags.items():
        text = getattr(args, field)
        if text is not None:
            base[field] = parse_int(text, flag, 1)
    if args.dim is not None and args.ffn_dim is None:
        base["ffn_dim"] = None  # DecoderConfig computes 8/3 * dim rounded up to 256
    if args.n_heads is not None and args.n_kv_heads is None and base["n_heads"] % base["n_kv_heads"]:
        base["n_kv_heads"] = base["n_heads"]  # the preset's key/value heads do not divide: plain MHA
    try:
        return DecoderConfig(**base)
    except ValueError as exc:
        raise UsageError(f"model shape (--config/--preset with the shape flags): {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="offload-bench",
        description="Step time of offloaded training against in-memory training, the disk and the copies "
        "(see offload_trainer/app/bench/bench_offload.py).",
    )
    p.add_argument("--config", help=f"named defaults for shape, batch and placement (default {DEFAULT_CONFIG}; "
                   f"{COMPARE_PLAIN_CONFIG} with --compare-plain): "
                   + "; ".join(f"{name}: {c.description}" for name, c in CONFIGS.items()))
    p.add_argument("--preset",
                   help="a DecoderConfig preset instead of the configuration's shape: " + ", ".join(PRESETS))
    p.add_argument("--dim", help="override the width (ffn size follows Llama's rule unless --ffn-dim)")
    p.add_argument("--layers", dest="n_layers", help="override the number of blocks")
    p.add_argument("--heads", dest="n_heads", help="override the query heads")
    p.add_argument("--kv-heads", dest="n_kv_heads", help="override the key/value heads")
    p.add_argument("--vocab", dest="vocab_size", help="override the vocabulary size")
    p.add_argument("--ffn-dim", dest="ffn_dim", help="override the MLP's hidden size")
    p.add_argument("--batch-size", help="sequences per micro-batch (default: the configuration's)")
    p.add_argument("--seq-len", help="tokens per sequence (default: the configuration's)")
    p.add_argument("--steps", default="3", help="timed optimizer steps (default 3)")
    p.add_argument("--warmup-steps", default="1",
                   help="untimed steps first; the engine records its schedule on the first (default 1)")
    p.add_argument("--grad-accum", default="1", help="micro-batches per optimizer step (default 1)")
    p.add_argument("--micro-batch-order", default=MICRO_BATCH_ORDERS[0],
                   help="the engine's order of a step's micro-batches: micro_batch_major (default) or layer_major "
                   "(every micro-batch through block k before block k+1: parameters fetched once per step); "
                   "compare param_bytes_read_per_step")
    for kind in PLACED_KINDS:
        p.add_argument(f"--{kind}", help=f"home of the {kind}: a tier (device, host, nvme) or fractions such as "
                       "host:0.2,nvme:0.8 (default: the configuration's)")
    p.add_argument("--nvme-dir", default="./.offload-scratch", help="directory for swap files (made if missing)")
    p.add_argument("--device-budget", help="tiers.device_budget_bytes, e.g. 2GiB (default no limit)")
    p.add_argument("--host-budget", help="tiers.host_budget_bytes, e.g. 4GiB (default no limit)")
    p.add_argument("--lookahead", default=str(ot.PrefetchConfig().lookahead_groups),
                   help=f"prefetch.lookahead_groups (default {ot.PrefetchConfig().lookahead_groups})")
    p.add_argument("--threads", help="torch.set_num_threads (default torch's own choice)")
    p.add_argument("--grad-clip", help="optimizer.grad_clip_norm for both runs (default no clipping)")
    p.add_argument("--disk-size", help="bytes of the disk test file (default 1GiB)")
    p.add_argument("--disk-repeat", default=str(DEFAULT_DISK_REPEAT),
                   help=f"timed disk passes of each kind, best kept (default {DEFAULT_DISK_REPEAT})")
    p.add_argument("--device", default=DeviceKind.CPU.value,
                   help="where both runs compute: cpu (default), cuda, or sim (the simulated accelerator)")
    p.add_argument("--copy-delay-ms",
                   help=f"--device sim: each copy finishes this late (default {DEFAULT_COPY_DELAY_MS:g})")
    p.add_argument("--compute-dtype", default=ot.ComputeDtype.FP32.value,
                   help="precision.compute_dtype of the engine, and autocast of the baseline: fp32 (default) or bf16")
    p.add_argument("--compare-plain", action="store_true",
                   help="plain PyTorch and the engine each in a process of its own, alternating, for --rounds rounds: "
                   "both step times, their ratio and both peak RSS")
    p.add_argument("--rounds", default=str(DEFAULT_ROUNDS), help=f"--compare-plain rounds (default {DEFAULT_ROUNDS})")
    p.add_argument("--only", default=Side.BOTH.value,
                   help="time one run in this process: baseline or engine (--compare-plain's workers); default both")
    p.add_argument("--seed", default="0", help="seed of the model's init and of the batches (default 0)")
    p.add_argument("--malloc-mmap-threshold",
                   help="fix glibc's mmap threshold (mallopt) in the process that trains, both sides alike, e.g. 1MiB: "
                   "freed tensors of that size or more leave the resident set (default glibc's rising threshold; "
                   "see heap_threshold.py)")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last stdout line")
    p.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                   help="io.verify_checksums = false: swap files read back unchecked (to measure what checking costs)")
    p.add_argument("--release-idle-memory", action="store_true",
                   help="tiers.release_idle_memory = true: idle gradient homes and staging buffers given back to "
                   "the OS between uses (lower peak RSS, pages faulted in again every step)")
    return p


VALUE_FLAGS = ("--dim", "--layers", "--heads", "--kv-heads", "--vocab", "--ffn-dim", "--batch-size", "--seq-len",
               "--steps", "--warmup-steps", "--grad-accum", "--lookahead", "--threads", "--grad-clip", "--disk-size",
               "--disk-repeat", "--seed", "--device-budget", "--host-budget", "--copy-delay-ms", "--rounds",
               "--malloc-mmap-threshold")
"""The flags that take a value: a negative one is attached to its flag (bench_cli.attach_negative_values)."""


def _parse_positive_float(text: str, flag: str, example: str, minimum_inclusive: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a number; for example {flag} {example}") from None
    ok = value >= 0 if minimum_inclusive else value > 0
    if not (math.isfinite(value) and ok):
        bound = "at least 0" if minimum_inclusive else "above 0"
        raise UsageError(f"{flag} {text!r} must be a number {bound}; for example {flag} {example}")
    return value


def _device(args: argparse.Namespace) -> tuple[DeviceKind, float]:
    names = {d.value: d for d in DeviceKind}
    device = names[parse_choice(args.device, "--device", names)]
    if device is DeviceKind.CUDA and not torch.cuda.is_available():
        raise UsageError("--device cuda but CUDA is not available here; use --device cpu or --device sim")
    if args.copy_delay_ms is not None and device is not DeviceKind.SIM:
        raise UsageError("--copy-delay-ms is for the simulated accelerator; add --device sim or drop it")
    delay_ms = DEFAULT_COPY_DELAY_MS if args.copy_delay_ms is None else _parse_positive_float(
        args.copy_delay_ms, "--copy-delay-ms", "2", minimum_inclusive=True
    )
    return device, delay_ms / 1000.0 if device is DeviceKind.SIM else 0.0


MICRO_BATCH_ORDERS = ("micro_batch_major", "layer_major")


def _layer_major(text: str) -> bool:
    return parse_choice(text, "--micro-batch-order", dict.fromkeys(MICRO_BATCH_ORDERS)) == "layer_major"


def _compute_dtype(text: str) -> ot.ComputeDtype:
    choices = {"fp32": ot.ComputeDtype.FP32, "bf16": ot.ComputeDtype.BF16}
    return choices[parse_choice(text, "--compute-dtype", choices)]


def _mmap_threshold(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    value = parse_size(text, "--malloc-mmap-threshold")
    if value > MAX_MMAP_THRESHOLD_BYTES:
        raise UsageError(
            f"--malloc-mmap-threshold {text!r} is above glibc's ceiling of {format_bytes(MAX_MMAP_THRESHOLD_BYTES)}; "
            "for example --malloc-mmap-threshold 1MiB"
        )
    return value


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate the command line; UsageError with the value and the fix for anything wrong."""
    if args.config is None:
        config_name = COMPARE_PLAIN_CONFIG if args.compare_plain else DEFAULT_CONFIG
    else:
        config_name = parse_choice(args.config, "--config", CONFIGS)
    named = CONFIGS[config_name]
    model = model_config(args, named)
    seq_len = parse_int(args.seq_len, "--seq-len", 1) if args.seq_len is not None else named.seq_len
    if seq_len > model.max_seq_len:
        # RoPE is computed on the fly, so a longer max_seq_len costs nothing.
        model = dataclasses.replace(model, max_seq_len=seq_len)
    nvme_dir = parse_directory(args.nvme_dir, "--nvme-dir")
    grad_clip = None if args.grad_clip is None else _parse_positive_float(args.grad_clip, "--grad-clip", "1.0")
    device, copy_delay_s = _device(args)
    sides = {s.value: s for s in Side}
    side = sides[parse_choice(args.only, "--only", sides)]
    if args.compare_plain and side is not Side.BOTH:
        raise UsageError(f"--only {args.only} times one run, --compare-plain both: drop one of them")
    placement = {
        kind: parse_placement(getattr(args, kind) if getattr(args, kind) is not None else named.placement[kind],
                              f"--{kind}")
        for kind in PLACED_KINDS
    }
    settings = Settings(
        config_name=config_name,
        preset=args.preset,
        model=model,
        batch_size=parse_int(args.batch_size, "--batch-size", 1) if args.batch_size is not None else named.batch_size,
        seq_len=seq_len,
        num_steps=parse_int(args.steps, "--steps", 1),
        num_warmup_steps=parse_int(args.warmup_steps, "--warmup-steps", 0),
        grad_accum=parse_int(args.grad_accum, "--grad-accum", 1),
        layer_major=_layer_major(args.micro_batch_order),
        placement=placement,
        nvme_dir=nvme_dir,
        device_budget_bytes=parse_size(args.device_budget, "--device-budget") if args.device_budget is not None else None,
        host_budget_bytes=parse_size(args.host_budget, "--host-budget") if args.host_budget is not None else None,
        lookahead=parse_int(args.lookahead, "--lookahead", 0),
        num_threads=parse_int(args.threads, "--threads", 1) if args.threads is not None else None,
        grad_clip_norm=grad_clip,
        disk_bytes=parse_size(args.disk_size, "--disk-size") if args.disk_size is not None else DEFAULT_DISK_BYTES,
        num_disk_repeats=parse_int(args.disk_repeat, "--disk-repeat", 1),
        seed=parse_int(args.seed, "--seed", 0),
        emit_json=args.json,
        verify_checksums=args.verify_checksums,
        release_idle_memory=args.release_idle_memory,
        device=device,
        copy_delay_s=copy_delay_s,
        compute_dtype=_compute_dtype(args.compute_dtype),
        compare_plain=args.compare_plain,
        num_rounds=parse_int(args.rounds, "--rounds", 1),
        side=side,
        worker_flags=_worker_flags(args, config_name),
        malloc_mmap_threshold_bytes=_mmap_threshold(args.malloc_mmap_threshold),
    )
    try:
        settings.offload_config()
    except (TypeError, ValueError) as exc:
        raise UsageError(f"engine config: {exc}") from None
    baseline_bytes = BASELINE_BYTES_PER_PARAM * num_params(model)
    available = memory_available_bytes()
    if baseline_bytes > MAX_BASELINE_SHARE_OF_AVAILABLE * available:
        raise UsageError(
            f"the in-memory baseline of this model ({num_params(model) / 1e6:.1f} M parameters) needs about "
            f"{format_bytes(baseline_bytes)} for parameters, gradients and AdamW moments, more than "
            f"{MAX_BASELINE_SHARE_OF_AVAILABLE:.0%} of the {format_bytes(available)} available; "
            "pick a smaller --preset or shape"
        )
    cpus = usable_cpus()
    if settings.num_threads is not None and settings.num_threads > cpus:
        raise UsageError(
            f"--threads {settings.num_threads} is more than the {cpus} CPUs this process may run on; use at most {cpus}"
        )
    problem = micro_batch_memory_problem(
        DecoderShape.from_decoder_config(model), settings.batch_size, seq_len, 4, False,
        f"--batch-size {settings.batch_size} x --seq-len {seq_len}", "lower --batch-size or --seq-len",
    )
    if problem is not None:
        raise UsageError(problem)
    return settings


def _worker_flags(args: argparse.Namespace, config_name: str) -> tuple[str, ...]:
    """The command line of a --compare-plain worker: the flags the user gave with their values, the
    configuration named explicitly, less --compare-plain, --rounds, --only and --json (the runner
    adds --only SIDE and --json)."""
    out = ["--config", config_name]
    skip = {"config", "compare_plain", "rounds", "only", "json"}
    for action in build_parser()._actions:
        flagless = isinstance(action, (argparse._HelpAction, argparse._VersionAction))  # no value to pass on
        if action.dest in skip or not action.option_strings or flagless:
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out.append(flag)
        else:
            out.append(f"{flag}={value}")
    return tuple(out)
