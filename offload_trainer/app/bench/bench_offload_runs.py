"""bench_offload's timed runs: plain PyTorch in memory (the baseline) and the engine, on the same batches.

    result = run_steps(settings, cfg)       # RunResult: every timed step of each side asked for

Both sides compute on --device: the baseline's model, gradients and AdamW moments live there (on
the CPU for --device cpu and sim), the engine's state in the homes of the placement. With
--only both (the default) the two take their steps in turn, which one goes first alternating, so
that a change in the machine's load hits both alike; a baseline step that follows an engine step
starts once the loads the engine prefetched for its next step have landed (settle()), so it is
not timed alongside them. Under CUDA every timed step ends with a
synchronize, so a step's time includes its kernels. bf16: the engine computes in bf16 over fp32
masters (precision.compute_dtype), the baseline under torch.autocast(bf16): the same compute
rate, not the same numbers.
"""

from __future__ import annotations

import contextlib
import copy
import math
import resource
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch

import offload_trainer as ot
from io_engine import DirectIOUnsupportedError, NotEnoughSpaceError
from offload_trainer.app.bench.bench_cli import UsageError
from offload_trainer.app.bench.bench_offload_rates import CountingSimulatedAccelerator, make_accelerator
from offload_trainer.app.bench.bench_offload_settings import DeviceKind, Settings, Side
from offload_trainer.models.meta_init import on_meta
from offload_trainer.app.bench.heap_threshold import fix_mmap_threshold
from offload_trainer.app.bench.thread_cpu import ThreadCpu
from offload_trainer.app.bench.token_batches import Batch, random_token_batches
from offload_trainer.models import DecoderLM, init_weights
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.optimizer import torch_param_groups

_SEED_DATA_OFFSET = 1
T = TypeVar("T")


@dataclass
class BaselineStep:
    step_s: float
    forward_backward_s: float
    optimizer_s: float
    peak_device_bytes: Optional[int]
    """Under CUDA: the most GPU memory the baseline held during this step (the engine's resident
    memory not counted); None elsewhere."""
    cpu_s: Dict[str, float] = field(default_factory=dict)
    """CPU seconds this step used, by kind of thread (thread_cpu.ThreadCpu)."""


@dataclass
class EngineStep:
    step_s: float
    stats: StepStats
    """The engine's own breakdown of this step."""
    num_h2d_copies: int
    """Host-to-device copies this step (counted on the simulated accelerator only; else 0)."""
    num_d2h_copies: int
    peak_device_bytes: Optional[int]
    """Under CUDA: the most GPU memory the engine held during this step (the baseline's resident
    memory not counted); None elsewhere."""
    cpu_s: Dict[str, float] = field(default_factory=dict)
    """CPU seconds this step used, by kind of thread (thread_cpu.ThreadCpu): the update pass that
    runs behind it counts in the step it overlaps (or in this one, with finish_updates)."""


@dataclass
class RunResult:
    """Every timed step of the sides that ran, and what was measured after them."""

    base_steps: List[BaselineStep] = field(default_factory=list)
    eng_steps: List[EngineStep] = field(default_factory=list)
    max_abs_diff: Optional[float] = None
    """Largest |engine - baseline| over the parameters after the run; None unless both ran."""
    bitwise_equal: Optional[bool] = None
    engine_direct: Optional[bool] = None
    """The engine's swap files used O_DIRECT (None when the engine did not run)."""
    tier_peak_bytes: Dict[str, int] = field(default_factory=dict)
    """The engine's tracked peak per tier."""
    peak_rss_bytes: int = 0
    """This process's peak resident set (both sides, when both ran here)."""


def make_batches(settings: Settings) -> List[List[Batch]]:
    """(tokens, targets) of every micro-batch of every step, made once, on --device; both runs train on them."""
    steps = random_token_batches(
        settings.model.vocab_size, settings.batch_size, settings.seq_len, settings.grad_accum,
        settings.num_warmup_steps + settings.num_steps, settings.seed + _SEED_DATA_OFFSET,
    )
    if settings.device is DeviceKind.CUDA:
        steps = [[(x.cuda(), y.cuda()) for x, y in micro] for micro in steps]
    return steps


def _autocast(settings: Settings) -> contextlib.AbstractContextManager:
    if settings.compute_dtype is ot.ComputeDtype.FP32:
        return contextlib.nullcontext()
    device_type = "cuda" if settings.device is DeviceKind.CUDA else "cpu"
    return torch.autocast(device_type, dtype=settings.compute_dtype.torch_dtype)


def _sync(settings: Settings) -> None:
    if settings.device is DeviceKind.CUDA:
        torch.cuda.synchronize()


def _cuda_peak(
    settings: Settings, not_counted_bytes: Callable[[], int], fn: Callable[[], T]
) -> Tuple[T, Optional[int]]:
    """fn() and, under CUDA, the peak GPU memory during it less `not_counted_bytes()` (what the other
    side keeps resident); None elsewhere."""
    if settings.device is not DeviceKind.CUDA:
        return fn(), None
    torch.cuda.synchronize()
    other = not_counted_bytes()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - other


class Baseline:
    """The model trained in memory by plain PyTorch on --device: what the engine's step is compared with."""

    def __init__(self, model: DecoderLM, cfg: ot.OffloadConfig, settings: Settings) -> None:
        self.settings = settings
        self.model = model.cuda() if settings.device is DeviceKind.CUDA else model
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            torch_param_groups(self.model, opt), lr=opt.lr, betas=opt.betas, eps=opt.eps, fused=True
        )
        self.grad_clip_norm = opt.grad_clip_norm

    def resident_device_bytes(self) -> int:
        """GPU bytes the baseline keeps between steps: parameters, gradients if any, AdamW moments."""
        tensors = [p for p in self.model.parameters()] + [p.grad for p in self.model.parameters() if p.grad is not None]
        tensors += [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values() if t.is_cuda)

    def _step(self, batches: Sequence[Batch]) -> Tuple[float, float, float]:
        start = time.perf_counter()
        for tokens, targets in batches:
            with _autocast(self.settings):
                _, loss = self.model(tokens, targets)
            (loss / len(batches)).backward()
        if self.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        _sync(self.settings)
        middle = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        _sync(self.settings)
        end = time.perf_counter()
        return end - start, middle - start, end - middle

    def step(self, batches: Sequence[Batch], engine_resident: Callable[[], int]) -> BaselineStep:
        with ThreadCpu() as cpu:
            (total, fwd_bwd, opt), peak = _cuda_peak(self.settings, engine_resident, lambda: self._step(batches))
        return BaselineStep(total, fwd_bwd, opt, peak, cpu.seconds)


def _engine_step(engine: ot.Engine, batches: Sequence[Batch], settings: Settings,
                 baseline_resident: Callable[[], int], finish_updates: bool) -> EngineStep:
    """One timed step. The optimizer's updates run behind the next forward; with `finish_updates`
    (something else runs before the engine's next step, or it is the last) the step's time
    includes the wait for the rest of them, so no update is left out of the time or runs beside
    the baseline."""
    accel = engine.accelerator
    counting = isinstance(accel, CountingSimulatedAccelerator)
    h2d_before, d2h_before = (accel.num_h2d, accel.num_d2h) if counting else (0, 0)

    def step() -> float:
        start = time.perf_counter()
        if settings.layer_major:
            engine.forward_backward_layer_major(
                [(tokens,) for tokens, _ in batches],
                lambda logits, m: DecoderLM.loss_of(logits, batches[m][1]),
            )
        else:
            for tokens, targets in batches:
                _, loss = engine(tokens, targets)
                engine.backward(loss / len(batches))
        engine.step()
        if finish_updates:
            engine.wait_for_updates()
        _sync(settings)
        return time.perf_counter() - start

    with ThreadCpu() as cpu:
        step_s, peak = _cuda_peak(settings, baseline_resident, step)
    h2d, d2h = (accel.num_h2d - h2d_before, accel.num_d2h - d2h_before) if counting else (0, 0)
    return EngineStep(step_s, engine.stats(), h2d, d2h, peak, cpu.seconds)


def settle(engine: ot.Engine) -> None:
    """Return once the parameter loads the engine left in flight (step() prefetches the next step's
    first groups) have finished, so that a baseline step timed next does not share the machine with
    them. Polls Pending.done(), which never blocks and changes nothing."""
    while any(not group.pending.done() for group in engine.groups):
        time.sleep(0.001)


def max_abs_diff(reference: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Tuple[float, bool]:
    """Largest |engine - baseline| over every parameter, and whether all are bitwise equal."""
    worst, equal = 0.0, True
    for name, p in reference.named_parameters(remove_duplicate=False):
        ref = p.detach().cpu()
        got = state[name]
        if ref.shape != got.shape:
            return math.inf, False
        equal &= torch.equal(ref, got)
        if ref.numel():
            worst = max(worst, (ref.double() - got.double()).abs().max().item())
    return worst, equal


@contextlib.contextmanager
def _engine(
    settings: Settings, cfg: ot.OffloadConfig, model: DecoderLM, init_fn: Optional[Callable[[torch.nn.Module], None]]
) -> Iterator[ot.Engine]:
    """ot.initialize on --device, its refusals as UsageError; closed at exit."""
    device = make_accelerator(settings, settings.copy_delay_s)
    try:
        engine = ot.initialize(model, cfg, device=device, init_fn=init_fn)
    except ot.PlanError as exc:
        device.close()
        raise UsageError(f"{exc} (flags --device-budget, --host-budget, placements)") from None
    except NotEnoughSpaceError as exc:
        device.close()
        raise UsageError(f"{exc}; or pass another --nvme-dir") from None
    except DirectIOUnsupportedError as exc:
        device.close()
        raise UsageError(str(exc)) from None
    try:
        yield engine
    finally:
        engine.close()


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_steps(settings: Settings, cfg: ot.OffloadConfig, progress: Callable[[str], None]) -> RunResult:
    """Warm-up and timed steps of the sides settings.side names; see the module docstring."""
    if settings.malloc_mmap_threshold_bytes is not None and not fix_mmap_threshold(settings.malloc_mmap_threshold_bytes):
        raise UsageError("--malloc-mmap-threshold needs glibc's mallopt, which this C library lacks; drop the flag")
    if settings.num_threads is not None:
        torch.set_num_threads(settings.num_threads)
    run_base = settings.side in (Side.BOTH, Side.BASELINE)
    run_engine = settings.side in (Side.BOTH, Side.ENGINE)
    torch.manual_seed(settings.seed)
    # The engine alone builds the model on the meta device: its parameters are created one module at a
    # time straight into their homes (bitwise as if built directly), so its peak RSS is its own.
    init_fn = init_weights if not run_base else None
    with on_meta() if init_fn is not None else contextlib.nullcontext():
        model = DecoderLM(settings.model)
    batches = make_batches(settings)
    result = RunResult()
    num_total = settings.num_warmup_steps + settings.num_steps
    baseline = Baseline(copy.deepcopy(model) if run_engine else model, cfg, settings) if run_base else None
    if not run_engine:
        del model
        for i, step_batches in enumerate(batches):
            b = baseline.step(step_batches, lambda: 0)
            if i >= settings.num_warmup_steps:
                result.base_steps.append(b)
            progress(f"step {i + 1}/{num_total}{'' if i >= settings.num_warmup_steps else ' (warmup)'}: "
                     f"baseline {b.step_s:.3f} s")
        result.peak_rss_bytes = peak_rss_bytes()
        return result

    with _engine(settings, cfg, model, init_fn) as engine:
        del model
        base_resident = baseline.resident_device_bytes if baseline is not None else (lambda: 0)
        # Under CUDA, GPU memory the engine holds outside the baseline's step is the rest of what is allocated.
        def engine_resident() -> int:
            if settings.device is not DeviceKind.CUDA:
                return 0
            return torch.cuda.memory_allocated() - base_resident()

        for i, step_batches in enumerate(batches):
            b: Optional[BaselineStep] = None
            # Alternate who goes first, so neither always runs on a cache the other warmed.
            if baseline is not None and i % 2 == 0:
                b = baseline.step(step_batches, engine_resident)
            e = _engine_step(engine, step_batches, settings, base_resident,
                             finish_updates=baseline is not None or i == num_total - 1)
            if baseline is not None and i % 2 == 1:
                settle(engine)
                b = baseline.step(step_batches, engine_resident)
            timed = i >= settings.num_warmup_steps
            if timed:
                result.eng_steps.append(e)
                if b is not None:
                    result.base_steps.append(b)
            base_text = f"baseline {b.step_s:.3f} s, " if b is not None else ""
            progress(f"step {i + 1}/{num_total}{'' if timed else ' (warmup)'}: {base_text}"
                     f"engine {e.step_s:.3f} s (compute {e.stats.compute_s:.3f}, io wait {e.stats.io_wait_s:.3f}, "
                     f"copy wait {e.stats.copy_wait_s:.3f}, optimizer {e.stats.optimizer_s:.3f})")
        state = engine.full_state_dict() if baseline is not None else None
        result.engine_direct = not engine.io.buffered_fallback
        result.tier_peak_bytes = {tier.value: engine.peak_bytes(tier) for tier in ot.Tier}
    if baseline is not None and state is not None:
        result.max_abs_diff, result.bitwise_equal = max_abs_diff(baseline.model, state)
        del state
    result.peak_rss_bytes = peak_rss_bytes()
    return result
