"""bench_offload's report: achieved TFLOPS, the step's lower bound and its terms, the table and the JSON object.

    out = report(settings, cfg, disk, copies, result)        # prints the table, returns the --json object

The bound. A step cannot be faster than the slowest of three things it must do:
- compute: the same model's step trained in memory by plain PyTorch on the same device (the
  baseline's median step);
- copies: host<->device bytes the engine counted this step, each direction at the copy path's
  measured rate (the two directions run on their own streams or workers, so the larger one); on
  the simulated accelerator each copy also costs its injected delay;
- NVMe: bytes read / read GB/s + bytes written / write GB/s (one disk moves both).
ratio = engine step / bound; 1.0 means the offloaded step is as fast as its slowest necessary part.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from io_engine.usable_cpus import usable_cpus

import offload_trainer as ot
from offload_trainer.app.bench.bench_offload_rates import GB, CopyRates, DiskResult
from offload_trainer.app.bench.bench_offload_runs import EngineStep, RunResult
from offload_trainer.app.bench.bench_offload_settings import DeviceKind, Settings, format_bytes
from offload_trainer.app.bench.thread_cpu import ThreadCpu
from offload_trainer.models import DecoderConfig, num_params


def median_index(times: Sequence[float]) -> int:
    """Index of the median time: the lower middle one for an even count."""
    order = sorted(range(len(times)), key=lambda i: times[i])
    return order[(len(times) - 1) // 2]


def model_flops_per_step(model: DecoderConfig, tokens: int, seq_len: int) -> float:
    """Training FLOPs of one step: 3 x forward (backward costs two forwards), forward = 2 x tokens x
    the matmul weights (blocks and lm_head; the embedding lookup is free) + causal attention's two
    seq x seq products (2 x tokens x seq_len x dim per block, half of the square). Recomputation
    under activation checkpointing is not counted: these are the model's FLOPs."""
    head_dim = model.dim // model.n_heads
    attn = model.dim * (2 * model.dim + 2 * model.n_kv_heads * head_dim)
    mlp = 3 * model.dim * model.ffn_dim
    matmul_numel = model.n_layers * (attn + mlp) + model.vocab_size * model.dim
    forward = 2.0 * tokens * matmul_numel + model.n_layers * 2.0 * tokens * seq_len * model.dim
    return 3.0 * forward


@dataclass
class StepBound:
    """The least time one engine step can take, and each of its terms (seconds)."""

    compute_s: float
    copy_s: float
    nvme_s: float

    @property
    def bound_s(self) -> float:
        return max(self.compute_s, self.copy_s, self.nvme_s)

    @property
    def limiting(self) -> str:
        terms = {"compute": self.compute_s, "copies": self.copy_s, "NVMe": self.nvme_s}
        return max(terms, key=lambda k: terms[k])


def copy_seconds(e: EngineStep, copies: CopyRates, delay_s: float) -> float:
    """The copy term of one step: the slower direction, bytes at the measured rate plus the injected
    delay per copy (simulated accelerator only)."""
    h2d = e.stats.h2d_bytes / (copies.h2d_gbps * GB) + e.num_h2d_copies * delay_s
    d2h = e.stats.d2h_bytes / (copies.d2h_gbps * GB) + e.num_d2h_copies * delay_s
    return max(h2d, d2h)


def nvme_seconds(e: EngineStep, disk: Optional[DiskResult]) -> float:
    if disk is None:
        return 0.0
    nvme = ot.Tier.NVME
    read = e.stats.bytes_read.get(nvme, 0)
    written = e.stats.bytes_written.get(nvme, 0)
    return read / (disk.read_gbps * GB) + written / (disk.write_gbps * GB)


def placement_text(p: ot.Placement) -> str:
    parts = [(t.value, p.fraction(t)) for t in ot.Tier if p.fraction(t) > 0]
    if len(parts) == 1:
        return parts[0][0]
    return ",".join(f"{name}:{fraction:g}" for name, fraction in parts)


def _seconds(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _fraction(part: Optional[float], whole: float) -> str:
    if part is None:
        return "n/a"
    return f"{part:.3f} s of {whole:.3f} s ({part / whole:.0%})" if whole > 0 else f"{part:.3f} s"


def describe_settings(settings: Settings) -> List[str]:
    m = settings.model
    placement = {kind: placement_text(p) for kind, p in settings.placement.items()}
    delay = f", copy delay {settings.copy_delay_s * 1000:g} ms" if settings.device is DeviceKind.SIM else ""
    return [
        f"offload benchmark ({settings.config_name}{', preset ' + settings.preset if settings.preset else ''}): "
        f"decoder {m.dim} wide, {m.n_layers} layers, {m.n_heads}/{m.n_kv_heads} heads, ffn {m.ffn_dim}, vocab "
        f"{m.vocab_size}{', tied' if m.tie_embeddings else ''}; {num_params(m) / 1e6:.2f} M parameters; "
        f"{settings.compute_dtype.value} on {settings.device.value}{delay}",
        f"  batch {settings.batch_size} x {settings.seq_len} tokens x {settings.grad_accum} micro-batch(es)"
        f"{' (layer-major)' if settings.layer_major else ''} = "
        f"{settings.tokens_per_step} tokens per step; {settings.num_steps} timed step(s) after "
        f"{settings.num_warmup_steps} warmup; torch threads {settings.num_threads or torch.get_num_threads()}",
        f"  placement: params {placement['params']}, grads {placement['grads']}, optimizer "
        f"{placement['optimizer']}; lookahead {settings.lookahead}; device budget "
        f"{format_bytes(settings.device_budget_bytes) if settings.device_budget_bytes else 'none'}, host budget "
        f"{format_bytes(settings.host_budget_bytes) if settings.host_budget_bytes else 'none'}",
        *([f"  glibc mmap threshold fixed at {format_bytes(settings.malloc_mmap_threshold_bytes)} (both sides)"]
          if settings.malloc_mmap_threshold_bytes is not None else []),
    ]


def settings_fields(settings: Settings, cfg: ot.OffloadConfig) -> Dict[str, Any]:
    """The run's settings as the JSON object carries them."""
    return {
        "config": settings.config_name,
        "preset": settings.preset,
        "device": settings.device.value,
        "copy_delay_s": settings.copy_delay_s,
        "compute_dtype": settings.compute_dtype.value,
        "num_params": num_params(settings.model),
        "placement": {kind: placement_text(p) for kind, p in settings.placement.items()},
        "tokens_per_step": settings.tokens_per_step,
        "model": dataclasses.asdict(settings.model),
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "steps": settings.num_steps,
        "warmup_steps": settings.num_warmup_steps,
        "grad_accum": settings.grad_accum,
        "micro_batch_order": "layer_major" if settings.layer_major else "micro_batch_major",
        "lookahead": settings.lookahead,
        "threads": settings.num_threads or torch.get_num_threads(),
        "grad_clip": settings.grad_clip_norm,
        "device_budget_bytes": settings.device_budget_bytes,
        "host_budget_bytes": settings.host_budget_bytes,
        "nvme_dir": settings.nvme_dir,
        "seed": settings.seed,
        "optimizer_states": list(cfg.optimizer.state_names),
        "verify_checksums": cfg.io.verify_checksums,
        "release_idle_memory": cfg.tiers.release_idle_memory,
        "malloc_mmap_threshold_bytes": settings.malloc_mmap_threshold_bytes,
    }


def engine_fields(settings: Settings, result: RunResult) -> Dict[str, Any]:
    """The engine's median step: its breakdown, the exposed parts, bytes and peaks (JSON keys)."""
    e = result.eng_steps[median_index([s.step_s for s in result.eng_steps])]
    stats = e.stats
    flops = model_flops_per_step(settings.model, settings.tokens_per_step, settings.seq_len)
    other_s = e.step_s - stats.compute_s - stats.io_wait_s - stats.optimizer_s - stats.communication_s
    cuda_peaks = [s.peak_device_bytes for s in result.eng_steps if s.peak_device_bytes is not None]
    stats_dict = stats.as_dict()
    return {
        "step_s": e.step_s,
        "tflops": flops / e.step_s / 1e12,
        "model_flops_per_step": flops,
        "compute_s": stats.compute_s,
        "io_wait_s": stats.io_wait_s,
        "copy_wait_s": stats.copy_wait_s,
        "optimizer_s": stats.optimizer_s,
        "communication_s": stats.communication_s,
        # Exposed: what the training thread waited for, of the work's whole time (most of the update
        # pass runs behind the next forward, the collectives behind compute).
        "optimizer_exposed_s": stats.optimizer_exposed_s,
        "optimizer_total_s": stats.optimizer_total_s,
        "comm_exposed_s": stats.communication_s,
        "comm_total_s": stats.comm_total_s,
        "other_s": other_s,
        "nvme_read_bytes_per_step": stats.bytes_read.get(ot.Tier.NVME, 0),
        "nvme_written_bytes_per_step": stats.bytes_written.get(ot.Tier.NVME, 0),
        "param_bytes_read_per_step": getattr(stats, "param_bytes_read", None),
        "h2d_bytes_per_step": stats.h2d_bytes,
        "d2h_bytes_per_step": stats.d2h_bytes,
        "h2d_copies_per_step": e.num_h2d_copies if settings.device is DeviceKind.SIM else None,
        "d2h_copies_per_step": e.num_d2h_copies if settings.device is DeviceKind.SIM else None,
        "bytes_read": stats_dict["bytes_read"],
        "bytes_written": stats_dict["bytes_written"],
        "peak_bytes": result.tier_peak_bytes,
        "peak_device_bytes": max(cuda_peaks) if cuda_peaks else result.tier_peak_bytes.get(ot.Tier.DEVICE.value, 0),
        "peak_device_source": "torch.cuda.max_memory_allocated" if cuda_peaks else "engine device-tier peak",
        "peak_rss_bytes": result.peak_rss_bytes,
        "prefetch_hits": stats.prefetch_hits,
        "prefetch_misses": stats.prefetch_misses,
        "unpack_refetches": stats.unpack_refetches,
        "re_records": stats.re_records,
        "step_times_s": [s.step_s for s in result.eng_steps],
        "engine_direct": result.engine_direct,
    }


def mean_cpu_s(steps: Sequence[Any]) -> Dict[str, float]:
    """CPU seconds per step by kind of thread, the mean over `steps` (each with a `cpu_s`)."""
    total: Dict[str, float] = {}
    for step in steps:
        for kind, seconds in step.cpu_s.items():
            total[kind] = total.get(kind, 0.0) + seconds
    return {kind: round(seconds / len(steps), 4) for kind, seconds in sorted(total.items(), key=lambda kv: -kv[1])}


def cpu_lines(result: RunResult, out: Dict[str, Any]) -> List[str]:
    """Where each side's CPU went (thread_cpu.py), and the step that CPU alone allows on this
    machine's cores; fills the JSON keys."""
    cores = usable_cpus()
    engine = mean_cpu_s(result.eng_steps) if result.eng_steps and ThreadCpu.available else None
    base = mean_cpu_s(result.base_steps) if result.base_steps and ThreadCpu.available else None
    out.update({
        "cpu_cores": cores,
        "engine_cpu_s_per_step": engine,
        "baseline_cpu_s_per_step": base,
        "engine_cpu_bound_s": None if engine is None else sum(engine.values()) / cores,
    })
    lines = []
    for label, cpu in (("engine", engine), ("baseline", base)):
        if cpu:
            parts = " + ".join(f"{kind} {seconds:.2f}" for kind, seconds in cpu.items())
            lines.append(f"  CPU per step, {label}: {sum(cpu.values()):.2f} s = {parts}")
    if engine:
        lines.append(f"  on {cores} cores the engine's CPU alone takes >= {sum(engine.values()) / cores:.3f} s a step")
    return lines


def report(
    settings: Settings,
    cfg: ot.OffloadConfig,
    disk: Optional[DiskResult],
    copies: Optional[CopyRates],
    result: RunResult,
) -> Dict[str, Any]:
    """Print the table of a run in one process (both sides, or one with --only); return the JSON object."""
    out: Dict[str, Any] = {}
    lines = describe_settings(settings)
    if disk is not None:
        lines.append(
            f"  disk under {settings.nvme_dir}: write {disk.write_gbps:.2f} GB/s, read {disk.read_gbps:.2f} GB/s "
            f"({format_bytes(disk.size_bytes)}, {'O_DIRECT' if disk.direct else 'buffered, page cache dropped'}, "
            f"best of {disk.num_repeats}); engine IO "
            f"{'O_DIRECT' if result.engine_direct else 'buffered (fallback)'}"
        )
    if copies is not None:
        lines.append(f"  copies ({settings.device.value}, {format_bytes(copies.probe_bytes)} each): host to device "
                     f"{copies.h2d_gbps:.2f} GB/s, device to host {copies.d2h_gbps:.2f} GB/s")
    lines.append(f"  {'':<30} {'seconds':>9}")
    flops = model_flops_per_step(settings.model, settings.tokens_per_step, settings.seq_len)
    b = None
    if result.base_steps:
        b = result.base_steps[median_index([s.step_s for s in result.base_steps])]
        lines += [
            f"  {'baseline step (in memory)':<30} {b.step_s:>9.3f}   median of "
            f"{[round(s.step_s, 3) for s in result.base_steps]}; {flops / b.step_s / 1e12:.4f} TFLOPS",
            f"  {'  forward+backward':<30} {b.forward_backward_s:>9.3f}",
            f"  {'  AdamW (fused)':<30} {b.optimizer_s:>9.3f}",
        ]
        base_peaks = [s.peak_device_bytes for s in result.base_steps if s.peak_device_bytes is not None]
        out.update({
            "baseline_step_s": b.step_s,
            "baseline_forward_backward_s": b.forward_backward_s,
            "baseline_optimizer_s": b.optimizer_s,
            "baseline_tflops": flops / b.step_s / 1e12,
            "baseline_step_times_s": [s.step_s for s in result.base_steps],
            "baseline_peak_device_bytes": max(base_peaks) if base_peaks else None,
        })
    if result.eng_steps:
        eng = engine_fields(settings, result)
        e = result.eng_steps[median_index([s.step_s for s in result.eng_steps])]
        out.update(eng)
        lines += [
            f"  {'engine step':<30} {e.step_s:>9.3f}   median of {[round(s, 3) for s in eng['step_times_s']]}; "
            f"{eng['tflops']:.4f} TFLOPS ({flops / 1e9:.2f} GFLOP per step)",
            f"  {'  compute':<30} {eng['compute_s']:>9.3f}   forward+backward less IO waits",
            f"  {'  io wait':<30} {eng['io_wait_s']:>9.3f}   exposed IO (prefetch late)",
            f"  {'  copy wait':<30} {eng['copy_wait_s']:>9.3f}   exposed host-to-device copies",
            f"  {'  optimizer':<30} {eng['optimizer_s']:>9.3f}   step(): updates and their IO",
            f"  {'  other':<30} {eng['other_s']:>9.3f}   outside the engine's calls",
            f"  exposed: optimizer {_fraction(eng['optimizer_exposed_s'], eng['optimizer_total_s'])} of its work; "
            f"communication {_fraction(eng['comm_exposed_s'], eng['comm_total_s'])}",
        ]
    bound: Optional[StepBound] = None
    if b is not None and result.eng_steps:
        e = result.eng_steps[median_index([s.step_s for s in result.eng_steps])]
        bound = StepBound(
            compute_s=b.step_s,
            copy_s=copy_seconds(e, copies, settings.copy_delay_s) if copies is not None else 0.0,
            nvme_s=nvme_seconds(e, disk),
        )
        ratio = e.step_s / bound.bound_s
        lines += [
            f"  {'bound: compute (baseline)':<30} {bound.compute_s:>9.3f}",
            f"  {'bound: copies':<30} {bound.copy_s:>9.3f}   to device {format_bytes(e.stats.h2d_bytes)}, "
            f"off it {format_bytes(e.stats.d2h_bytes)}"
            + (f"; {e.num_h2d_copies} + {e.num_d2h_copies} copies x {settings.copy_delay_s * 1000:g} ms"
               if settings.device is DeviceKind.SIM else ""),
            f"  {'bound: NVMe':<30} {bound.nvme_s:>9.3f}"
            + (f"   read {format_bytes(out['nvme_read_bytes_per_step'])} / {disk.read_gbps:.2f} GB/s + written "
               f"{format_bytes(out['nvme_written_bytes_per_step'])} / {disk.write_gbps:.2f} GB/s" if disk else ""),
            f"  ratio = engine / max(compute, copies, NVMe) = {ratio:.3f}   ({bound.limiting} is the largest)",
        ]
        out.update({
            "ratio": round(ratio, 4),
            "bound_s": bound.bound_s,
            "bound_compute_s": bound.compute_s,
            "bound_copy_s": bound.copy_s,
            "nvme_bound_s": bound.nvme_s,
            "bound_limit": bound.limiting,
        })
    else:
        out.update({"ratio": None, "bound_s": None, "bound_compute_s": None, "bound_copy_s": None,
                    "nvme_bound_s": None, "bound_limit": None})
    if result.eng_steps:
        e = result.eng_steps[median_index([s.step_s for s in result.eng_steps])]
        stats = e.stats
        tiers_read = ", ".join(f"{t.value} {format_bytes(n)}" for t, n in stats.bytes_read.items()) or "none"
        tiers_written = ", ".join(f"{t.value} {format_bytes(n)}" for t, n in stats.bytes_written.items()) or "none"
        param_read = out["param_bytes_read_per_step"]
        lines += [
            f"  bytes per step: read from {tiers_read}; written to {tiers_written}; parameters loaded "
            f"{'n/a' if param_read is None else format_bytes(param_read)}",
            "  peak resident (engine tiers): "
            + ", ".join(f"{t} {format_bytes(n)}" for t, n in result.tier_peak_bytes.items())
            + f"; peak device memory {format_bytes(out['peak_device_bytes'])} ({out['peak_device_source']})",
            f"  prefetch: {stats.prefetch_hits} hits, {stats.prefetch_misses} misses, "
            f"{stats.unpack_refetches} unpack refetches, {stats.re_records} re-records",
        ]
    lines += cpu_lines(result, out)
    both = "baseline and engine together" if result.base_steps and result.eng_steps else settings.side.value
    lines.append(f"  peak RSS of this process ({both}): {format_bytes(result.peak_rss_bytes)}")
    if result.max_abs_diff is not None:
        expect = "" if settings.compute_dtype is ot.ComputeDtype.FP32 else " (bf16: not expected to be equal)"
        lines.append(
            f"  parameters after {settings.num_warmup_steps + settings.num_steps} steps vs the baseline: max |diff| "
            f"{result.max_abs_diff:g} ({'bitwise equal' if result.bitwise_equal else 'NOT bitwise equal'}){expect}"
        )
    for line in lines:
        print(line)
    out.update({
        "peak_rss_bytes": result.peak_rss_bytes,
        "max_abs_diff": result.max_abs_diff,
        "bitwise_equal": result.bitwise_equal,
        "read_gbps": None if disk is None else round(disk.read_gbps, 3),
        "write_gbps": None if disk is None else round(disk.write_gbps, 3),
        "disk_direct": None if disk is None else disk.direct,
        "disk_size_bytes": None if disk is None else disk.size_bytes,
        "h2d_gbps": None if copies is None else round(copies.h2d_gbps, 3),
        "d2h_gbps": None if copies is None else round(copies.d2h_gbps, 3),
        "side": settings.side.value,
    })
    out.update(settings_fields(settings, cfg))
    return out
