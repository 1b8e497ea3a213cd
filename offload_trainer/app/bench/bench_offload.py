"""Benchmark of offload_trainer: a decoder LM trained under a placement, against the same model in memory.

    python scripts/bench_offload.py                         # "small" (9.6 M), 16 x 512 tokens, all on NVMe
    python scripts/bench_offload.py --json                  # ...and one JSON object on the last stdout line
    python scripts/bench_offload.py --preset 125m --batch-size 1 --seq-len 256 --steps 2
    python scripts/bench_offload.py --params host --grads host --optimizer host:0.2,nvme:0.8
    python scripts/bench_offload.py --dim 512 --layers 8 --heads 8 --host-budget 1GiB --lookahead 1
    python scripts/bench_offload.py --json --no-verify-checksums   # io.verify_checksums off: its cost

What one run measures, all in the same process on the same machine:
- the disk: sequential O_DIRECT write and read GB/s of --disk-size bytes (rounded up to whole
  blocks) through io_engine, in a FileStore under --nvme-dir with the engine's own IOConfig (1 MiB
  blocks, several in flight), best of --disk-repeat passes, timed by bench_io_passes.py (a write
  up to its fsync); the file is written once untimed first, so that timed writes overwrite
  allocated blocks as a swap file does. Skipped when no state is placed on NVMe.
- the in-memory baseline: the same model (one copy made before the engine takes it) trained by
  plain PyTorch with torch.optim.AdamW(fused=True) and the engine's weight-decay groups.
- the engine: ot.initialize(model, cfg) with the placement, trained on the same batches.
The baseline and the engine take their steps in turn (which one goes first alternates), so that
a change in the machine's load during the run hits both alike. The first --warmup-steps steps are
untimed (the engine records its schedule on the first one); then each of --steps steps is timed
from before its first forward to the end of its optimizer step. The step reported is the median
one (the lower middle for an even count), and the engine's breakdown (engine.stats()) is that
step's own, so its parts add up to its time.

The ratio. nvme_bound_s = NVMe bytes read per step / read GB/s + NVMe bytes written per step /
write GB/s, with the bytes the engine counted in that step: the least time the disk needs to move
them. ratio = engine step time / max(baseline step time, nvme_bound_s): 1.0 means the offloaded
step is as fast as the slower of computing in memory and moving its bytes at the disk's speed.

The default model is one where compute dominates on a 2-core CPU: a step computes for about 4 s
and moves about 370 MB through the disk (about 0.15 s at this project's disk speeds); a run takes
about a minute on a quiet machine. Every timed step of both runs is listed, so that noise from
other work on the machine can be told from the engine's cost (--steps 5 or more steadies the median).

Checksums: the engine's swap files carry a crc32 per chunk, checked on every read
(io.verify_checksums, on by default); --no-verify-checksums turns them off, so that runs with and
without, interleaved, measure what they cost. The disk measurement never computes them.

Correctness, cheaply: after the run every parameter of the engine (engine.full_state_dict()) is
compared with the baseline's; in fp32 they must be bitwise equal (max_abs_diff 0.0).

Exit status: 0 done, 1 an IO failure (the TransferError is printed), 2 bad input (one message
naming the value and the fix), 130 Ctrl-C, 143 SIGTERM. Swap files are removed on every exit path.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import psutil
import torch

from offload_trainer.app.bench import bench_io_passes, bench_io_settings
import offload_trainer as ot
from offload_trainer.app.bench.token_batches import Batch, random_token_batches
from offload_trainer.app.bench.bench_cli import UsageError, parse_int, parse_size, run_cli
from offload_trainer.app.user_errors import OneLineParser
from offload_trainer.app.run_checks import micro_batch_memory_problem
from offload_trainer.planning.zero_memory import DecoderShape
from io_engine import DirectIOUnsupportedError, IOConfig, NotEnoughSpaceError
from offload_trainer.config import byte_size
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.models import PRESETS, DecoderConfig, DecoderLM, num_params
from offload_trainer.runtime.optimizer import torch_param_groups

GB = 10**9
GiB = 1 << 30
DEFAULT_PRESET = "small"
DEFAULT_BATCH_SIZE = 16
DEFAULT_SEQ_LEN = 512
DEFAULT_STEPS = 3
DEFAULT_WARMUP_STEPS = 1
DEFAULT_DISK_BYTES = 1 * GiB
DEFAULT_DISK_REPEAT = 3
DEFAULT_PLACEMENT = "nvme"
PLACED_KINDS = ("params", "grads", "optimizer")
# The baseline holds parameters, gradients and two AdamW moments in memory (16 bytes per fp32
# parameter) next to the engine: refuse a model whose baseline alone would not fit this share.
MAX_BASELINE_SHARE_OF_AVAILABLE = 0.6
BASELINE_BYTES_PER_PARAM = 16
_SEED_DATA_OFFSET = 1


@dataclass(frozen=True)
class Settings:
    """Everything the command line asked for, validated."""

    preset: str
    model: DecoderConfig
    batch_size: int
    seq_len: int
    num_steps: int
    """Timed optimizer steps."""
    num_warmup_steps: int
    """Untimed optimizer steps before them (the engine records its schedule on the first)."""
    grad_accum: int
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
            ),
            prefetch=ot.PrefetchConfig(lookahead_groups=self.lookahead),
            optimizer=ot.OptimizerConfig(grad_clip_norm=self.grad_clip_norm),
            grad_accum_steps=self.grad_accum,
            seed=self.seed,
            io=IOConfig(verify_checksums=self.verify_checksums),
        )


# -- parsing -------------------------------------------------------------------------------------


def parse_placement(text: str, flag: str) -> ot.Placement:
    try:
        return ot.Placement.parse(text)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{flag}: {exc}") from None


def model_config(args: argparse.Namespace) -> DecoderConfig:
    """The preset, with the shape flags given; --dim without --ffn-dim takes Llama's ffn rule."""
    if args.preset not in PRESETS:
        raise UsageError(f"--preset {args.preset!r} is not a preset; choose one of {', '.join(PRESETS)}")
    base = dict(PRESETS[args.preset])
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
        raise UsageError(f"model shape ({args.preset} with the shape flags): {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="bench_offload.py",
        description="Step time of offloaded training against in-memory training and the disk "
        "(see the module docstring).",
    )
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"DecoderConfig preset (default {DEFAULT_PRESET}): "
                   + ", ".join(PRESETS))
    p.add_argument("--dim", help="override the preset's width (ffn size follows Llama's rule unless --ffn-dim)")
    p.add_argument("--layers", dest="n_layers", help="override the preset's number of blocks")
    p.add_argument("--heads", dest="n_heads", help="override the preset's query heads")
    p.add_argument("--kv-heads", dest="n_kv_heads", help="override the preset's key/value heads")
    p.add_argument("--vocab", dest="vocab_size", help="override the preset's vocabulary size")
    p.add_argument("--ffn-dim", dest="ffn_dim", help="override the MLP's hidden size")
    p.add_argument("--batch-size", default=str(DEFAULT_BATCH_SIZE), help=f"sequences per micro-batch "
                   f"(default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--seq-len", default=str(DEFAULT_SEQ_LEN), help=f"tokens per sequence (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--steps", default=str(DEFAULT_STEPS), help=f"timed optimizer steps (default {DEFAULT_STEPS})")
    p.add_argument("--warmup-steps", default=str(DEFAULT_WARMUP_STEPS),
                   help="untimed steps first; the engine records its schedule on the first "
                   f"(default {DEFAULT_WARMUP_STEPS})")
    p.add_argument("--grad-accum", default="1", help="micro-batches per optimizer step (default 1)")
    for kind in PLACED_KINDS:
        p.add_argument(f"--{kind}", default=DEFAULT_PLACEMENT,
                       help=f"home of the {kind}: a tier (device, host, nvme) or fractions such as host:0.2,nvme:0.8 "
                       f"(default {DEFAULT_PLACEMENT})")
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
    p.add_argument("--seed", default="0", help="seed of the model's init and of the batches (default 0)")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last stdout line")
    p.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                   help="io.verify_checksums = false: swap files read back unchecked (to measure what checking costs)")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate the command line; UsageError with the value and the fix for anything wrong."""
    model = model_config(args)
    seq_len = parse_int(args.seq_len, "--seq-len", 1)
    if seq_len > model.max_seq_len:
        # RoPE is computed on the fly, so a longer max_seq_len costs nothing.
        model = dataclasses.replace(model, max_seq_len=seq_len)
    nvme_dir = os.path.abspath(os.path.expanduser(args.nvme_dir))
    if os.path.islink(nvme_dir):  # followed here: the swap store never follows one (io_engine/swap_dirs.py)
        nvme_dir = os.path.realpath(nvme_dir)
    if os.path.exists(nvme_dir) and not os.path.isdir(nvme_dir):
        raise UsageError(f"--nvme-dir {args.nvme_dir!r} is a file, not a directory; pass a directory (made if missing)")
    grad_clip = None
    if args.grad_clip is not None:
        try:
            grad_clip = float(args.grad_clip)
        except ValueError:
            raise UsageError(f"--grad-clip {args.grad_clip!r} is not a number; for example --grad-clip 1.0") from None
        if not (math.isfinite(grad_clip) and grad_clip > 0):
            raise UsageError(f"--grad-clip {args.grad_clip!r} must be a number above 0; for example --grad-clip 1.0")
    settings = Settings(
        preset=args.preset,
        model=model,
        batch_size=parse_int(args.batch_size, "--batch-size", 1),
        seq_len=seq_len,
        num_steps=parse_int(args.steps, "--steps", 1),
        num_warmup_steps=parse_int(args.warmup_steps, "--warmup-steps", 0),
        grad_accum=parse_int(args.grad_accum, "--grad-accum", 1),
        placement={kind: parse_placement(getattr(args, kind), f"--{kind}") for kind in PLACED_KINDS},
        nvme_dir=nvme_dir,
        device_budget_bytes=parse_size(args.device_budget, "--device-budget") if args.device_budget else None,
        host_budget_bytes=parse_size(args.host_budget, "--host-budget") if args.host_budget else None,
        lookahead=parse_int(args.lookahead, "--lookahead", 0),
        num_threads=parse_int(args.threads, "--threads", 1) if args.threads is not None else None,
        grad_clip_norm=grad_clip,
        disk_bytes=parse_size(args.disk_size, "--disk-size") if args.disk_size else DEFAULT_DISK_BYTES,
        num_disk_repeats=parse_int(args.disk_repeat, "--disk-repeat", 1),
        seed=parse_int(args.seed, "--seed", 0),
        emit_json=args.json,
        verify_checksums=args.verify_checksums,
    )
    try:
        settings.offload_config()
    except (TypeError, ValueError) as exc:
        raise UsageError(f"engine config: {exc}") from None
    baseline_bytes = BASELINE_BYTES_PER_PARAM * num_params(model)
    available = psutil.virtual_memory().available
    if baseline_bytes > MAX_BASELINE_SHARE_OF_AVAILABLE * available:
        raise UsageError(
            f"the in-memory baseline of this model ({num_params(model) / 1e6:.1f} M parameters) needs about "
            f"{format_bytes(baseline_bytes)} for parameters, gradients and AdamW moments, more than "
            f"{MAX_BASELINE_SHARE_OF_AVAILABLE:.0%} of the {format_bytes(available)} available; "
            "pick a smaller --preset or shape"
        )
    cpus = os.cpu_count() or 1
    if settings.num_threads is not None and settings.num_threads > cpus:
        raise UsageError(
            f"--threads {settings.num_threads} is more than the {cpus} CPUs of this machine; use at most {cpus}"
        )
    problem = micro_batch_memory_problem(
        DecoderShape.from_decoder_config(model), settings.batch_size, seq_len, 4, False,
        f"--batch-size {settings.batch_size} x --seq-len {seq_len}", "lower --batch-size or --seq-len",
    )
    if problem is not None:
        raise UsageError(problem)
    return settings


def format_bytes(num_bytes: float) -> str:
    """'1.50 GiB', '38.60 MiB', '1.00 GiB', '512 B': this report keeps two decimals on whole units too."""
    return byte_size.format_bytes(num_bytes, whole_without_decimals=False)


# -- the disk ------------------------------------------------------------------------------------


@dataclass
class DiskResult:
    """Sequential GB/s of the disk under --nvme-dir, best of the passes."""

    read_gbps: float
    write_gbps: float
    direct: bool
    """True if the passes used O_DIRECT (else the page cache was dropped before each read pass)."""
    size_bytes: int
    num_repeats: int


def measure_disk(settings: Settings, io_config: IOConfig, progress: Callable[[str], None]) -> DiskResult:
    """Sequential write and read GB/s of a --disk-size file in a FileStore under --nvme-dir.

    Timed by bench_io_passes.time_point with the engine's IOConfig: one block per request, queue_depth
    in flight, the file written once untimed first, writes timed up to their fsync, and the page
    cache dropped before each read pass where O_DIRECT is not used. The size is rounded up to
    whole blocks, as bench_io moves whole blocks.
    """
    point = bench_io_settings.Point(
        block_bytes=io_config.block_bytes, queue_depth=io_config.queue_depth, num_threads=io_config.num_threads
    )
    size = -(-settings.disk_bytes // point.block_bytes) * point.block_bytes
    disk_settings = bench_io_settings.Settings(
        dir=settings.nvme_dir,
        size_bytes=size,
        points=(point,),
        direct=io_config.direct,
        buffer=bench_io_settings.BufferKind.MMAP,
        pattern=bench_io_settings.Pattern.SEQUENTIAL,
        num_repeats=settings.num_disk_repeats,
        sweep=False,
        aiofiles=False,
        emit_json=False,
    )
    buffer = bench_io_passes.make_buffer(disk_settings.buffer, point.buffer_bytes)
    with bench_io_passes.scratch_file(
        settings.nvme_dir, size, point.block_bytes, io_config.direct, dir_flag="--nvme-dir", size_flag="--disk-size",
        what="swap files",
    ) as path:
        # Only the summary line below is printed, not bench_io's line per pass.
        timed = bench_io_passes.time_point(disk_settings, point, path, buffer, fill=True, progress=lambda line: None)
    read_gbps = timed.best_gbps(bench_io_passes.PassKind.SEQ_READ, size)
    write_gbps = timed.best_gbps(bench_io_passes.PassKind.SEQ_WRITE, size)
    assert read_gbps is not None and write_gbps is not None  # a sequential pattern times both
    result = DiskResult(read_gbps, write_gbps, timed.direct_used, size, settings.num_disk_repeats)
    progress(f"disk: write {result.write_gbps:.2f} GB/s, read {result.read_gbps:.2f} GB/s "
             f"({format_bytes(size)}, {'O_DIRECT' if result.direct else 'buffered'}, "
             f"best of {settings.num_disk_repeats})")
    return result


# -- training ------------------------------------------------------------------------------------




def make_batches(settings: Settings) -> List[List[Batch]]:
    """(tokens, targets) of every micro-batch of every step, made once; both runs train on them."""
    return random_token_batches(
        settings.model.vocab_size, settings.batch_size, settings.seq_len, settings.grad_accum,
        settings.num_warmup_steps + settings.num_steps, settings.seed + _SEED_DATA_OFFSET,
    )


@dataclass
class BaselineStep:
    step_s: float
    forward_backward_s: float
    optimizer_s: float


class Baseline:
    """The model trained in memory by plain PyTorch: what the engine's step is compared with."""

    def __init__(self, model: DecoderLM, cfg: ot.OffloadConfig) -> None:
        self.model = model
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            torch_param_groups(model, opt), lr=opt.lr, betas=opt.betas, eps=opt.eps, fused=True
        )
        self.grad_clip_norm = opt.grad_clip_norm

    def step(self, batches: Sequence[Batch]) -> BaselineStep:
        start = time.perf_counter()
        for tokens, targets in batches:
            _, loss = self.model(tokens, targets)
            (loss / len(batches)).backward()
        if self.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        middle = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        end = time.perf_counter()
        return BaselineStep(end - start, middle - start, end - middle)


@dataclass
class EngineStep:
    step_s: float
    stats: StepStats
    """The engine's own breakdown of this step."""


def engine_step(engine: ot.Engine, batches: Sequence[Batch]) -> EngineStep:
    start = time.perf_counter()
    for tokens, targets in batches:
        _, loss = engine(tokens, targets)
        engine.backward(loss / len(batches))
    engine.step()
    return EngineStep(time.perf_counter() - start, engine.stats())


def median_index(times: Sequence[float]) -> int:
    """Index of the median time: the lower middle one for an even count."""
    order = sorted(range(len(times)), key=lambda i: times[i])
    return order[(len(times) - 1) // 2]


def max_abs_diff(reference: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Tuple[float, bool]:
    """Largest |engine - baseline| over every parameter, and whether all are bitwise equal."""
    worst, equal = 0.0, True
    for name, p in reference.named_parameters(remove_duplicate=False):
        ref = p.detach()
        got = state[name]
        if ref.shape != got.shape:
            return math.inf, False
        equal &= torch.equal(ref, got)
        if ref.numel():
            worst = max(worst, (ref.double() - got.double()).abs().max().item())
    return worst, equal


def run(settings: Settings) -> Dict[str, Any]:
    def progress(line: str) -> None:
        print(f"bench_offload: {line}", file=sys.stderr, flush=True)

    if settings.num_threads is not None:
        torch.set_num_threads(settings.num_threads)
    cfg = settings.offload_config()
    disk = measure_disk(settings, cfg.io, progress) if settings.uses_nvme else None

    torch.manual_seed(settings.seed)
    model = DecoderLM(settings.model)
    baseline = Baseline(copy.deepcopy(model), cfg)
    batches = make_batches(settings)
    try:
        engine = ot.initialize(model, cfg)
    except ot.PlanError as exc:
        raise UsageError(f"{exc} (flags --device-budget, --host-budget, placements)") from None
    except NotEnoughSpaceError as exc:
        raise UsageError(f"{exc}; or pass another --nvme-dir") from None
    except DirectIOUnsupportedError as exc:
        raise UsageError(str(exc)) from None
    del model
    base_steps: List[BaselineStep] = []
    eng_steps: List[EngineStep] = []
    try:
        num_total = settings.num_warmup_steps + settings.num_steps
        for i, step_batches in enumerate(batches):
            # Alternate who goes first, so neither always runs on a cache the other warmed.
            if i % 2 == 0:
                b = baseline.step(step_batches)
                e = engine_step(engine, step_batches)
            else:
                e = engine_step(engine, step_batches)
                b = baseline.step(step_batches)
            timed = i >= settings.num_warmup_steps
            if timed:
                base_steps.append(b)
                eng_steps.append(e)
            progress(f"step {i + 1}/{num_total}{'' if timed else ' (warmup)'}: baseline {b.step_s:.3f} s, "
                     f"engine {e.step_s:.3f} s (compute {e.stats.compute_s:.3f}, io wait {e.stats.io_wait_s:.3f}, "
                     f"optimizer {e.stats.optimizer_s:.3f})")
        state = engine.full_state_dict()
        engine_direct = not engine.io.buffered_fallback
        peak = {tier.value: engine.peak_bytes(tier) for tier in ot.Tier}
    finally:
        engine.close()
    diff, equal = max_abs_diff(baseline.model, state)
    del state
    return report(settings, cfg, disk, base_steps, eng_steps, diff, equal, engine_direct, peak)


# -- reporting -----------------------------------------------------------------------------------


def placement_text(p: ot.Placement) -> str:
    parts = [(t.value, p.fraction(t)) for t in ot.Tier if p.fraction(t) > 0]
    if len(parts) == 1:
        return parts[0][0]
    return ",".join(f"{name}:{fraction:g}" for name, fraction in parts)


def report(
    settings: Settings,
    cfg: ot.OffloadConfig,
    disk: Optional[DiskResult],
    base_steps: List[BaselineStep],
    eng_steps: List[EngineStep],
    diff: float,
    equal: bool,
    engine_direct: bool,
    peak: Dict[str, int],
) -> Dict[str, Any]:
    b = base_steps[median_index([s.step_s for s in base_steps])]
    e = eng_steps[median_index([s.step_s for s in eng_steps])]
    stats = e.stats
    nvme = ot.Tier.NVME
    read_bytes = stats.bytes_read.get(nvme, 0)
    written_bytes = stats.bytes_written.get(nvme, 0)
    if disk is not None:
        bound_s = read_bytes / (disk.read_gbps * GB) + written_bytes / (disk.write_gbps * GB)
    else:
        bound_s = 0.0
    ratio = e.step_s / max(b.step_s, bound_s)
    other_s = e.step_s - stats.compute_s - stats.io_wait_s - stats.optimizer_s - stats.communication_s
    n_params = num_params(settings.model)
    m = settings.model
    placement = {kind: placement_text(p) for kind, p in settings.placement.items()}

    print(f"offload benchmark: {settings.preset} decoder ({m.dim} wide, {m.n_layers} layers, {m.n_heads}/"
          f"{m.n_kv_heads} heads, ffn {m.ffn_dim}, vocab {m.vocab_size}), {n_params / 1e6:.2f} M parameters, fp32")
    print(f"  batch {settings.batch_size} x {settings.seq_len} tokens x {settings.grad_accum} micro-batch(es) = "
          f"{settings.tokens_per_step} tokens per step; {settings.num_steps} timed step(s) after "
          f"{settings.num_warmup_steps} warmup; torch threads {torch.get_num_threads()}")
    print(f"  placement: params {placement['params']}, grads {placement['grads']}, optimizer "
          f"{placement['optimizer']}; lookahead {settings.lookahead}; device budget "
          f"{format_bytes(settings.device_budget_bytes) if settings.device_budget_bytes else 'none'}, host budget "
          f"{format_bytes(settings.host_budget_bytes) if settings.host_budget_bytes else 'none'}")
    if disk is not None:
        print(f"  disk under {settings.nvme_dir}: write {disk.write_gbps:.2f} GB/s, read {disk.read_gbps:.2f} GB/s "
              f"({format_bytes(disk.size_bytes)}, {'O_DIRECT' if disk.direct else 'buffered, page cache dropped'}, "
              f"best of {disk.num_repeats}); engine IO {'O_DIRECT' if engine_direct else 'buffered (fallback)'}")
    print(f"  {'':<28} {'seconds':>9}")
    print(f"  {'baseline step (in memory)':<28} {b.step_s:>9.3f}   median of {[round(s.step_s, 3) for s in base_steps]}")
    print(f"  {'  forward+backward':<28} {b.forward_backward_s:>9.3f}")
    print(f"  {'  AdamW (fused)':<28} {b.optimizer_s:>9.3f}")
    print(f"  {'engine step':<28} {e.step_s:>9.3f}   median of {[round(s.step_s, 3) for s in eng_steps]}")
    print(f"  {'  compute':<28} {stats.compute_s:>9.3f}   forward+backward less IO waits")
    print(f"  {'  io wait':<28} {stats.io_wait_s:>9.3f}   exposed IO (prefetch late)")
    print(f"  {'  optimizer':<28} {stats.optimizer_s:>9.3f}   step(): updates and their IO")
    print(f"  {'  other':<28} {other_s:>9.3f}   outside the engine's calls")
    if disk is not None:
        print(f"  {'NVMe bound':<28} {bound_s:>9.3f}   read {format_bytes(read_bytes)} / {disk.read_gbps:.2f} GB/s + "
              f"written {format_bytes(written_bytes)} / {disk.write_gbps:.2f} GB/s")
    which = "the baseline" if b.step_s >= bound_s else "the NVMe bound"
    print(f"  ratio = engine / max(baseline, NVMe bound) = {ratio:.3f}   ({which} is the larger)")
    tiers_read = ", ".join(f"{t.value} {format_bytes(n)}" for t, n in stats.bytes_read.items()) or "none"
    tiers_written = ", ".join(f"{t.value} {format_bytes(n)}" for t, n in stats.bytes_written.items()) or "none"
    print(f"  bytes per step: read from {tiers_read}; written to {tiers_written}")
    print("  peak resident: " + ", ".join(f"{t} {format_bytes(n)}" for t, n in peak.items()))
    print(f"  prefetch: {stats.prefetch_hits} hits, {stats.prefetch_misses} misses, "
          f"{stats.unpack_refetches} unpack refetches, {stats.re_records} re-records")
    print(f"  parameters after {settings.num_warmup_steps + settings.num_steps} steps vs the baseline: max |diff| "
          f"{diff:g} ({'bitwise equal' if equal else 'NOT bitwise equal'})")

    stats_dict = stats.as_dict()
    return {
        "ratio": round(ratio, 4),
        "step_s": e.step_s,
        "baseline_step_s": b.step_s,
        "baseline_forward_backward_s": b.forward_backward_s,
        "baseline_optimizer_s": b.optimizer_s,
        "nvme_bound_s": bound_s,
        "read_gbps": None if disk is None else round(disk.read_gbps, 3),
        "write_gbps": None if disk is None else round(disk.write_gbps, 3),
        "disk_direct": None if disk is None else disk.direct,
        "engine_direct": engine_direct,
        "nvme_read_bytes_per_step": read_bytes,
        "nvme_written_bytes_per_step": written_bytes,
        "compute_s": stats.compute_s,
        "io_wait_s": stats.io_wait_s,
        "optimizer_s": stats.optimizer_s,
        "other_s": other_s,
        "bytes_read": stats_dict["bytes_read"],
        "bytes_written": stats_dict["bytes_written"],
        "peak_bytes": peak,
        "prefetch_hits": stats.prefetch_hits,
        "prefetch_misses": stats.prefetch_misses,
        "unpack_refetches": stats.unpack_refetches,
        "re_records": stats.re_records,
        "step_times_s": [s.step_s for s in eng_steps],
        "baseline_step_times_s": [s.step_s for s in base_steps],
        "max_abs_diff": diff,
        "bitwise_equal": equal,
        "num_params": n_params,
        "placement": placement,
        "tokens_per_step": settings.tokens_per_step,
        "preset": settings.preset,
        "model": dataclasses.asdict(settings.model),
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "steps": settings.num_steps,
        "warmup_steps": settings.num_warmup_steps,
        "grad_accum": settings.grad_accum,
        "lookahead": settings.lookahead,
        "threads": torch.get_num_threads(),
        "grad_clip": settings.grad_clip_norm,
        "device_budget_bytes": settings.device_budget_bytes,
        "host_budget_bytes": settings.host_budget_bytes,
        "nvme_dir": settings.nvme_dir,
        "disk_size_bytes": None if disk is None else disk.size_bytes,
        "seed": settings.seed,
        "optimizer_states": list(cfg.optimizer.state_names),
        "verify_checksums": cfg.io.verify_checksums,
    }


# -- main ----------------------------------------------------------------------------------------


VALUE_FLAGS = ("--dim", "--layers", "--heads", "--kv-heads", "--vocab", "--ffn-dim", "--batch-size", "--seq-len",
               "--steps", "--warmup-steps", "--grad-accum", "--lookahead", "--threads", "--grad-clip", "--disk-size",
               "--disk-repeat", "--seed", "--device-budget", "--host-budget")
"""The flags that take a value: a negative one is attached to its flag (bench_cli.attach_negative_values)."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(argv, build_parser(), VALUE_FLAGS, settings_from_args, run,
                   cleaned_up="the swap files were removed")


if __name__ == "__main__":
    sys.exit(main())
