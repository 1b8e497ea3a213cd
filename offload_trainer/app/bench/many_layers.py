"""Benchmark of the engine's per-group cost: a deep, thin decoder, engine and plain PyTorch step by step.

    python scripts/bench_many_layers.py                      # 128 layers x dim 64, all on host, then all on NVMe
    python scripts/bench_many_layers.py --placements host --steps 12 --json
    python scripts/bench_many_layers.py --profile            # ...and cProfile's top entries of the engine's steps

The model (issue 16): the built-in decoder with 128 blocks of width 64 (4 heads, SwiGLU 256, vocabulary
256), batch 2 x 32, cut by the engine into about 131 groups. Its compute is tiny, so what the engine
adds per step is almost all per-group work: Python in the hooks, the scheduler and the gradient and
optimizer bookkeeping, and the latency of many small transfers.

For each placement (params, grads and optimizer states all homed on `host`, or all on `nvme`) the
same model (one copy made before the engine takes it) is trained by plain PyTorch (fused AdamW)
and by the engine on the same batches, their steps alternating (who goes first alternates too),
so that a change in the machine's load hits both alike. Every step is split into phases:

- forward: the engine's forward less plain PyTorch's (the engine's acquisitions and releases);
- backward: the engine's backward less plain's, less the gradient handling below;
- gradients: time inside the engine's gradient accumulator (each gradient into its home, the
  flushes at the end of backward, the drain at the start of step());
- optimizer: the engine's step() less the gradient drain, less plain's clip + step + zero_grad.

Each is divided by the number of groups and reported as the median over the timed steps (ms per
group per step), next to the ratio of the engine's step to plain's (median of per-step ratios).
On a shared machine the absolute times are noisy; the ratios and per-group differences, taken
from interleaved steps, are the numbers to compare. The engine's parameters are compared with
plain PyTorch's at the end: in fp32 they must be bitwise equal.

With everything on NVMe the engine's step also moves bytes: parameters (forward and backward),
gradients and every AdamW state. Before that placement the disk's sequential rates are measured
(a --disk-size file under --nvme-dir; 0 skips it), and the "disk floor" column is the engine's
NVMe bytes of its median step at those rates, per group. Since each step here waits for its
update pass (so that plain PyTorch's step never runs beside it), that floor is part of the
engine's extra time however little per-group work is left; in training the pass runs behind the
next forward instead.

A third copy of the model is trained by plain PyTorch under the engine's own hooks with empty
callbacks (app/bench/hook_floor.py), its steps between the other two: the "hook floor" column is
its extra time over plain PyTorch per group, what the module, tensor, saved-tensor and
gradient hook calls cost by themselves. The engine's extra time less that floor is what its own
per-group work (acquisition, copies, eviction, gradient and optimizer bookkeeping) costs. A fourth
copy runs under the same hooks without the saved-tensor ones: the "saved-tensor hooks" column is
what those add (called for every tensor autograd saves, activations included), the part of the
floor that an engine whose saved tensors stay valid by themselves (FSDP2 keeps each parameter's
storage and resizes it) would not pay.

--profile runs cProfile over the engine's timed steps only and prints its top entries by own time
(--profile-top N), for each placement.

Exit status: 0 done, 1 an IO failure, 2 bad input (one line naming the value and the fix), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import offload_trainer as ot
from io_engine import DirectIOUnsupportedError, NotEnoughSpaceError
from io_engine.usable_cpus import usable_cpus
from offload_trainer.app.bench.bench_cli import UsageError, parse_directory, parse_int, parse_size, run_cli
from offload_trainer.app.bench.bench_offload_rates import GB, DiskResult, disk_rates
from offload_trainer.app.bench.bench_offload_settings import (
    BASELINE_BYTES_PER_PARAM,
    MAX_BASELINE_SHARE_OF_AVAILABLE,
    format_bytes,
)
from offload_trainer.app.bench.hook_floor import EngineHooksOnly
from offload_trainer.app.bench.token_batches import Batch, random_token_batches
from offload_trainer.app.run_checks import micro_batch_memory_problem
from offload_trainer.app.user_errors import OneLineParser
from offload_trainer.models import DecoderConfig, DecoderLM, num_params
from offload_trainer.planning.host_memory import memory_available_bytes
from offload_trainer.planning.zero_memory import DecoderShape
from offload_trainer.runtime.layout.partition import plan_partition
from offload_trainer.runtime.optimizer import torch_param_groups

PLACEMENTS = ("host", "nvme")
PHASES = ("forward", "backward", "gradients", "optimizer")
GRADIENT_METHODS = ("on_grad", "end_backward", "drain")
"""The GradAccumulator's entry points from the engine: the time spent inside them is 'gradients'."""


@dataclass(frozen=True)
class Settings:
    """A validated command line."""

    num_layers: int
    dim: int
    ffn_dim: int
    num_heads: int
    vocab_size: int
    batch_size: int
    seq_len: int
    num_steps: int
    """Timed steps per placement (the medians are over these)."""
    num_warmup_steps: int
    placements: Tuple[str, ...]
    nvme_dir: str
    lookahead: int
    num_threads: Optional[int]
    profile: bool
    profile_top: int
    min_group_bytes: Optional[int]
    """grouping.min_group_bytes: merge consecutive small groups (None: one group per block)."""
    seed: int
    emit_json: bool
    disk_bytes: int = 256 << 20
    """Size of the file the disk's sequential rates are measured with before the nvme placement
    (0: not measured, no disk floor)."""

    def model_config(self) -> DecoderConfig:
        return DecoderConfig(
            vocab_size=self.vocab_size, dim=self.dim, n_layers=self.num_layers, n_heads=self.num_heads,
            n_kv_heads=self.num_heads, ffn_dim=self.ffn_dim, max_seq_len=max(self.seq_len, 64),
        )

    def offload_config(self, placement: str) -> ot.OffloadConfig:
        tier = ot.Placement.parse(placement)
        return ot.OffloadConfig(
            tiers=ot.TierConfig(
                params=tier, grads=tier, optimizer=tier, nvme_dir=self.nvme_dir if placement == "nvme" else None,
            ),
            prefetch=ot.PrefetchConfig(lookahead_groups=self.lookahead),
            grouping=ot.GroupingConfig(min_group_bytes=self.min_group_bytes),
            seed=self.seed,
        )


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="offload-bench-many-layers",
                      description="The engine's extra time per group per step on a deep thin decoder "
                      "(see the module docstring).")
    p.add_argument("--layers", default="128", help="decoder blocks (default 128)")
    p.add_argument("--dim", default="64", help="model width (default 64)")
    p.add_argument("--ffn-dim", default="256", help="MLP hidden size (default 256)")
    p.add_argument("--heads", default="4", help="attention heads (default 4)")
    p.add_argument("--vocab", default="256", help="vocabulary size (default 256)")
    p.add_argument("--batch-size", default="2", help="sequences per batch (default 2)")
    p.add_argument("--seq-len", default="32", help="tokens per sequence (default 32)")
    p.add_argument("--steps", default="8", help="timed steps per placement (default 8)")
    p.add_argument("--warmup-steps", default="2", help="untimed steps first (default 2)")
    p.add_argument("--placements", default=",".join(PLACEMENTS),
                   help=f"comma-separated homes of all state, run in turn: {', '.join(PLACEMENTS)} (default both)")
    p.add_argument("--nvme-dir", default="./.offload-scratch", help="directory for swap files (made if missing)")
    p.add_argument("--disk-size", default="256MiB",
                   help="file the disk's sequential GB/s are measured with before the nvme placement, for the "
                   "disk floor column (default 256MiB; 0 skips it)")
    p.add_argument("--lookahead", default=str(ot.PrefetchConfig().lookahead_groups),
                   help=f"prefetch.lookahead_groups (default {ot.PrefetchConfig().lookahead_groups})")
    p.add_argument("--min-group-bytes", help="grouping.min_group_bytes, e.g. 4MiB: consecutive small groups merged "
                   "(default none: one group per block)")
    p.add_argument("--threads", help="torch.set_num_threads (default torch's own choice)")
    p.add_argument("--profile", action="store_true", help="cProfile the engine's timed steps; print the top entries")
    p.add_argument("--profile-top", default="25", help="entries of the profile to print (default 25)")
    p.add_argument("--seed", default="0", help="seed of the model's init and of the batches (default 0)")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last stdout line")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    placements = tuple(p.strip() for p in args.placements.split(",") if p.strip())
    for p in placements:
        if p not in PLACEMENTS:
            raise UsageError(f"--placements {args.placements!r} names {p!r}; use host, nvme or host,nvme")
    if not placements:
        raise UsageError(f"--placements {args.placements!r} names no placement; use host, nvme or host,nvme")
    dim = parse_int(args.dim, "--dim", 2)
    heads = parse_int(args.heads, "--heads", 1)
    if dim % heads or (dim // heads) % 2:
        raise UsageError(f"--dim {dim} / --heads {heads} must give an even head size; for example --heads 4")
    nvme_dir = parse_directory(args.nvme_dir, "--nvme-dir")
    settings = Settings(
        num_layers=parse_int(args.layers, "--layers", 1),
        dim=dim,
        ffn_dim=parse_int(args.ffn_dim, "--ffn-dim", 1),
        num_heads=heads,
        vocab_size=parse_int(args.vocab, "--vocab", 2),
        batch_size=parse_int(args.batch_size, "--batch-size", 1),
        seq_len=parse_int(args.seq_len, "--seq-len", 1),
        num_steps=parse_int(args.steps, "--steps", 1),
        num_warmup_steps=parse_int(args.warmup_steps, "--warmup-steps", 1),
        placements=placements,
        nvme_dir=nvme_dir,
        lookahead=parse_int(args.lookahead, "--lookahead", 0),
        num_threads=parse_int(args.threads, "--threads", 1) if args.threads is not None else None,
        profile=args.profile,
        profile_top=parse_int(args.profile_top, "--profile-top", 1),
        min_group_bytes=parse_size(args.min_group_bytes, "--min-group-bytes") if args.min_group_bytes is not None else None,
        seed=parse_int(args.seed, "--seed", 0),
        emit_json=args.json,
        disk_bytes=parse_size(args.disk_size, "--disk-size", minimum=0),  # 0 (in any unit): not measured
    )
    check_machine_fits(settings)
    return settings


NUM_MODEL_COPIES = 4
"""Copies of the model a placement holds in memory at once: three plain ones (Plain, hooked and without
saved-tensor hooks), each with its gradients and AdamW moments, and the engine's."""


def check_machine_fits(settings: Settings) -> None:
    """UsageError for what this machine cannot run, found before any placement runs (a 1e9 batch was a
    traceback, a model larger than memory was killed by the kernel, 100000 threads crashed torch)."""
    cpus = usable_cpus()
    if settings.num_threads is not None and settings.num_threads > cpus:
        raise UsageError(
            f"--threads {settings.num_threads} is more than the {cpus} CPUs this process may run on; use at most {cpus}"
        )
    model = settings.model_config()
    need = NUM_MODEL_COPIES * BASELINE_BYTES_PER_PARAM * num_params(model)
    available = memory_available_bytes()
    if need > MAX_BASELINE_SHARE_OF_AVAILABLE * available:
        raise UsageError(
            f"--layers {settings.num_layers} x --dim {settings.dim} (--ffn-dim {settings.ffn_dim}, --vocab "
            f"{settings.vocab_size}) is {num_params(model) / 1e6:.1f} M parameters, and the {NUM_MODEL_COPIES} copies "
            f"this benchmark trains need about {format_bytes(need)} with their gradients and AdamW moments, more "
            f"than {MAX_BASELINE_SHARE_OF_AVAILABLE:.0%} of the {format_bytes(available)} available; lower --layers "
            "or --dim"
        )
    problem = micro_batch_memory_problem(
        DecoderShape.from_decoder_config(model), settings.batch_size, settings.seq_len, 4, False,
        f"--batch-size {settings.batch_size} x --seq-len {settings.seq_len}", "lower --batch-size or --seq-len",
    )
    if problem is not None:
        raise UsageError(problem)


# -- one step of each -----------------------------------------------------------------------------


@dataclass
class PhaseTimes:
    """Seconds of one step by phase; `gradients` is 0 for plain PyTorch (its gradients stay in .grad)."""

    forward: float = 0.0
    backward: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.gradients + self.optimizer


class Plain:
    """The model trained in memory by plain PyTorch with fused AdamW and the engine's weight-decay
    groups; with `hooked`, under the engine's hooks with nothing behind them (hook_floor.py)."""

    def __init__(
        self, model: DecoderLM, cfg: ot.OffloadConfig, hooked: bool = False, saved_tensor_hooks: bool = True
    ) -> None:
        self.model = model
        self.hooks = EngineHooksOnly(model) if hooked else None
        self.saved_tensor_hooks = saved_tensor_hooks
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            torch_param_groups(model, opt), lr=opt.lr, betas=opt.betas, eps=opt.eps, fused=True
        )
        self.grad_clip_norm = opt.grad_clip_norm

    def step(self, batch: Batch) -> PhaseTimes:
        t0 = time.perf_counter()
        if self.hooks is not None and self.saved_tensor_hooks:
            with self.hooks.forward_context():
                _, loss = self.model(*batch)
        else:
            _, loss = self.model(*batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if self.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        t3 = time.perf_counter()
        return PhaseTimes(t1 - t0, t2 - t1, 0.0, t3 - t2)


@dataclass
class GradientClock:
    """Time spent inside the engine's gradient accumulator: its entry points wrapped on the instance."""

    seconds: float = 0.0
    in_drain: float = 0.0
    _depth: int = field(default=0, repr=False)

    def wrap(self, accumulator: Any) -> None:
        for name in GRADIENT_METHODS:
            method = getattr(accumulator, name, None)
            if method is not None:
                setattr(accumulator, name, self._timed(method, name == "drain"))

    def _timed(self, method: Callable[..., Any], is_drain: bool) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self._depth -= 1
                self.seconds += spent
                if is_drain:
                    self.in_drain += spent

        return timed

    def take(self) -> Tuple[float, float]:
        out = (self.seconds, self.in_drain)
        self.seconds = self.in_drain = 0.0
        return out


def engine_step(engine: ot.Engine, batch: Batch, clock: GradientClock, profiler: Optional[cProfile.Profile]) -> PhaseTimes:
    """One step of the engine by phase; under `profiler` if given (its times then include the profiler's)."""
    if profiler is not None:
        profiler.enable()
    try:
        return _engine_step(engine, batch, clock)
    finally:
        if profiler is not None:
            profiler.disable()


def _engine_step(engine: ot.Engine, batch: Batch, clock: GradientClock) -> PhaseTimes:
    clock.take()
    t0 = time.perf_counter()
    _, loss = engine(*batch)
    t1 = time.perf_counter()
    engine.backward(loss)
    t2 = time.perf_counter()
    in_backward, _ = clock.take()
    engine.step()
    # Plain PyTorch's step runs next: the updates running behind are this step's optimizer time.
    engine.wait_for_updates()
    t3 = time.perf_counter()
    in_step, in_drain = clock.take()
    return PhaseTimes(t1 - t0, t2 - t1 - in_backward, in_backward + in_step, t3 - t2 - in_step)


# -- a run ----------------------------------------------------------------------------------------


@dataclass
class PlacementResult:
    placement: str
    num_groups: int
    """The model's groups before any merging (one per block, and one per other module with
    parameters): the per-group figures divide by this, so runs with and without merging compare."""
    num_engine_groups: int
    """The groups the engine moves (fewer under --min-group-bytes)."""
    plain: List[PhaseTimes]
    engine: List[PhaseTimes]
    bitwise_equal: bool
    max_abs_diff: float
    profile_text: str
    python_calls: int
    """Python function calls cProfile counted in the engine's timed steps (0 without --profile): a
    measure of the per-group Python work that the machine's load does not change."""
    nvme_bytes: Tuple[int, int] = (0, 0)
    """NVMe bytes (read, written) of the engine's median step (its StepStats)."""
    disk: Optional[DiskResult] = None
    """The disk's sequential rates, measured before this placement (nvme only)."""
    hooked: List[PhaseTimes] = field(default_factory=list)
    """Plain PyTorch under the engine's hooks with nothing behind them (hook_floor.py), its steps
    interleaved with the other two."""
    unsaved: List[PhaseTimes] = field(default_factory=list)
    """The same without the saved-tensor hooks (module, tensor and gradient hooks only)."""

    def hook_floor_ms_per_group(self) -> Optional[float]:
        """Median over steps of (hooked plain - plain) seconds, in ms per group: what the hook calls
        alone add, the least any engine on these hooks can add per group here."""
        if not self.hooked:
            return None
        return 1e3 * statistics.median((h.total - p.total) / self.num_groups for h, p in zip(self.hooked, self.plain))

    def saved_tensor_hooks_ms_per_group(self) -> Optional[float]:
        """Median over steps of (hooked - hooked without saved-tensor hooks) seconds, in ms per group:
        the saved-tensor hooks' part of the hook floor."""
        if not self.unsaved:
            return None
        return 1e3 * statistics.median((h.total - u.total) / self.num_groups for h, u in zip(self.hooked, self.unsaved))

    def disk_floor_ms_per_group(self) -> Optional[float]:
        """The engine's NVMe bytes of a step at the disk's sequential rates, in ms per group: what
        no overlap can take away from the engine's extra time while the bench serializes its
        update pass (see the module docstring)."""
        if self.disk is None:
            return None
        read, written = self.nvme_bytes
        seconds = read / (self.disk.read_gbps * GB) + written / (self.disk.write_gbps * GB)
        return 1e3 * seconds / self.num_groups

    def extra_ms_per_group(self, phase: str) -> float:
        """Median over steps of (engine - plain) seconds of `phase`, in ms per group."""
        return 1e3 * statistics.median(
            (getattr(e, phase) - getattr(p, phase)) / self.num_groups for e, p in zip(self.engine, self.plain)
        )

    def extra_total_ms_per_group(self) -> float:
        return 1e3 * statistics.median((e.total - p.total) / self.num_groups for e, p in zip(self.engine, self.plain))

    def ratio(self) -> float:
        return statistics.median(e.total / p.total for e, p in zip(self.engine, self.plain))

    def as_dict(self) -> Dict[str, Any]:
        return {
            "placement": self.placement,
            "num_groups": self.num_groups,
            "num_engine_groups": self.num_engine_groups,
            "plain_step_s": statistics.median(p.total for p in self.plain),
            "engine_step_s": statistics.median(e.total for e in self.engine),
            "ratio": self.ratio(),
            "extra_ms_per_group": {
                "total": self.extra_total_ms_per_group(), **{ph: self.extra_ms_per_group(ph) for ph in PHASES}
            },
            "bitwise_equal": self.bitwise_equal,
            "max_abs_diff": self.max_abs_diff,
            "python_calls_per_group_step": self.python_calls / len(self.engine) / self.num_groups,
            "nvme_read_bytes_per_step": self.nvme_bytes[0],
            "nvme_written_bytes_per_step": self.nvme_bytes[1],
            "disk_read_gbps": None if self.disk is None else self.disk.read_gbps,
            "disk_write_gbps": None if self.disk is None else self.disk.write_gbps,
            "disk_floor_ms_per_group": self.disk_floor_ms_per_group(),
            "hook_floor_ms_per_group": self.hook_floor_ms_per_group(),
            "saved_tensor_hooks_ms_per_group": self.saved_tensor_hooks_ms_per_group(),
        }


def max_abs_diff(reference: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Tuple[float, bool]:
    worst, equal = 0.0, True
    for name, p in reference.named_parameters():
        got = state[name]
        equal = equal and torch.equal(got, p.detach())
        worst = max(worst, (got - p.detach()).abs().max().item() if got.numel() else 0.0)
    return worst, equal


def run_placement(settings: Settings, placement: str, progress: Callable[[str], None]) -> PlacementResult:
    cfg = settings.offload_config(placement)
    disk = None
    if placement == "nvme" and settings.disk_bytes:
        os.makedirs(settings.nvme_dir, exist_ok=True)
        disk = disk_rates(settings.nvme_dir, settings.disk_bytes, 1, cfg.io, progress)
    torch.manual_seed(settings.seed)
    model = DecoderLM(settings.model_config())
    plain = Plain(copy.deepcopy(model), cfg)
    hooked = Plain(copy.deepcopy(model), cfg, hooked=True)
    unsaved = Plain(copy.deepcopy(model), cfg, hooked=True, saved_tensor_hooks=False)
    total = settings.num_warmup_steps + settings.num_steps
    batches = [s[0] for s in random_token_batches(settings.vocab_size, settings.batch_size, settings.seq_len, 1,
                                                  total, settings.seed + 1)]
    try:
        engine = ot.initialize(model, cfg)
    except ot.PlanError as exc:
        raise UsageError(f"{exc} (flags --placements, --lookahead)") from None
    except NotEnoughSpaceError as exc:
        raise UsageError(f"{exc}; or pass another --nvme-dir") from None
    except DirectIOUnsupportedError as exc:
        raise UsageError(str(exc)) from None
    num_groups = len(plan_partition(model, ot.GroupingConfig()).groups)
    del model
    clock = GradientClock()
    clock.wrap(engine.grads)
    profiler = cProfile.Profile() if settings.profile else None
    plain_steps: List[PhaseTimes] = []
    engine_steps: List[PhaseTimes] = []
    hooked_steps: List[PhaseTimes] = []
    unsaved_steps: List[PhaseTimes] = []
    nvme_bytes: List[Tuple[int, int]] = []
    try:
        num_engine_groups = len(engine.groups)
        for i, batch in enumerate(batches):
            timed = i >= settings.num_warmup_steps
            profile = profiler if timed else None
            # Who goes first alternates; the hooked plain models always run between the two.
            if i % 2 == 0:
                p = plain.step(batch)
                h = hooked.step(batch)
                u = unsaved.step(batch)
                e = engine_step(engine, batch, clock, profile)
            else:
                e = engine_step(engine, batch, clock, profile)
                u = unsaved.step(batch)
                h = hooked.step(batch)
                p = plain.step(batch)
            if timed:
                plain_steps.append(p)
                engine_steps.append(e)
                hooked_steps.append(h)
                unsaved_steps.append(u)
                stats = engine.stats()
                nvme_bytes.append((stats.bytes_read.get(ot.Tier.NVME, 0), stats.bytes_written.get(ot.Tier.NVME, 0)))
            progress(f"{placement} step {i + 1}/{total}{'' if timed else ' (warmup)'}: plain {p.total:.3f} s, "
                     f"engine {e.total:.3f} s ({(e.total - p.total) / num_groups * 1e3:.2f} ms/group)")
        state = engine.full_state_dict()
    finally:
        engine.close()
    diff, equal = max_abs_diff(plain.model, state)
    profile_text = ""
    python_calls = 0
    if profiler is not None:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        python_calls = stats.total_calls  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(settings.profile_top)
        profile_text = out.getvalue()
    totals = [e.total for e in engine_steps]
    median_bytes = nvme_bytes[totals.index(statistics.median_low(totals))]
    return PlacementResult(
        placement, num_groups, num_engine_groups, plain_steps, engine_steps, equal, diff, profile_text, python_calls,
        median_bytes, disk, hooked_steps, unsaved_steps,
    )


def run(settings: Settings) -> Dict[str, Any]:
    def progress(line: str) -> None:
        print(f"bench_many_layers: {line}", file=sys.stderr, flush=True)

    if settings.num_threads is not None:
        torch.set_num_threads(settings.num_threads)
    if "nvme" in settings.placements:  # an unusable --nvme-dir found now, not after the host placement's minutes
        os.makedirs(settings.nvme_dir, exist_ok=True)
    results = [run_placement(settings, p, progress) for p in settings.placements]
    print(report(settings, results))
    return {
        "model": {"layers": settings.num_layers, "dim": settings.dim, "ffn_dim": settings.ffn_dim,
                  "heads": settings.num_heads, "vocab": settings.vocab_size},
        "batch": [settings.batch_size, settings.seq_len],
        "steps": settings.num_steps,
        "lookahead": settings.lookahead,
        "min_group_bytes": settings.min_group_bytes,
        "placements": [r.as_dict() for r in results],
    }


def report(settings: Settings, results: Sequence[PlacementResult]) -> str:
    lines = [
        f"many-layer decoder: {settings.num_layers} layers x dim {settings.dim} (ffn {settings.ffn_dim}), "
        f"batch {settings.batch_size} x {settings.seq_len}, {settings.num_steps} timed steps, engine and plain "
        "PyTorch interleaved; medians; per group = per group of the unmerged model",
        f"grouping.min_group_bytes: {settings.min_group_bytes}, lookahead {settings.lookahead}",
        "",
        f"{'placement':<10}{'groups/moved':>13}{'plain s':>9}{'engine s':>10}{'ratio':>7}   extra ms/group/step: "
        f"{'total':>7}" + "".join(f"{ph:>11}" for ph in PHASES) + f"{'hook floor':>12}{'saved-tensor':>14}{'disk floor':>12}{'bitwise':>9}",
    ]
    for r in results:
        d = r.as_dict()
        extra = d["extra_ms_per_group"]
        lines.append(
            f"{r.placement:<10}{f'{r.num_groups}/{r.num_engine_groups}':>13}{d['plain_step_s']:>9.3f}{d['engine_step_s']:>10.3f}{d['ratio']:>7.2f}"
            f"   {'':<21}{extra['total']:>7.3f}" + "".join(f"{extra[ph]:>11.3f}" for ph in PHASES)
            + f"{d['hook_floor_ms_per_group']:>12.3f}{d['saved_tensor_hooks_ms_per_group']:>14.3f}"
            + (f"{d['disk_floor_ms_per_group']:>12.3f}" if d["disk_floor_ms_per_group"] is not None else f"{'-':>12}")
            + f"{'yes' if r.bitwise_equal else 'NO':>9}"
        )
    lines.append(
        "hook floor: plain PyTorch under the engine's hooks with nothing behind them, less plain PyTorch, per "
        "group (app/bench/hook_floor.py): the hook calls' own cost, in every engine step above; saved-tensor: the "
        "part of it the saved-tensor hooks take (the same hooks without them, less the hook floor)"
    )
    for r in results:
        if r.disk is not None:
            read, written = r.nvme_bytes
            lines.append(
                f"disk floor ({r.placement}): the engine's NVMe bytes of a step ({format_bytes(read)} read, "
                f"{format_bytes(written)} written) at the disk's sequential {r.disk.read_gbps:.2f} GB/s read, "
                f"{r.disk.write_gbps:.2f} GB/s write, per group"
            )
    for r in results:
        if r.profile_text:
            calls = r.as_dict()["python_calls_per_group_step"]
            lines += ["", f"cProfile of the engine's timed steps, {r.placement}: {calls:.0f} calls per group per step; "
                      f"top {settings.profile_top} by own time:",
                      r.profile_text.rstrip()]
    return "\n".join(lines)


VALUE_FLAGS = ("--disk-size", "--min-group-bytes", "--layers", "--dim", "--ffn-dim", "--heads", "--vocab", "--batch-size", "--seq-len", "--steps",
               "--warmup-steps", "--lookahead", "--threads", "--profile-top", "--seed")


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(argv, build_parser(), VALUE_FLAGS, settings_from_args, run,
                   cleaned_up="the swap files were removed", path_flags={"nvme_dir": "--nvme-dir"})


if __name__ == "__main__":
    sys.exit(main())
