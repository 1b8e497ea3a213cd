"""bench_io's report: the table on stdout and the JSON object, for one Point or a sweep of them.

report_single() and report_sweep() print the table and return what --json prints as the last
stdout line (the keys are listed in bench_io.py's docstring). Run it as `python3 scripts/bench_io.py`.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import psutil
import torch

from offload_trainer.app.bench.bench_io_passes import PassKind, PointResult, address_alignment_bytes
from offload_trainer.app.bench.bench_io_settings import IO_DEFAULTS, BufferKind, Point, Settings
from offload_trainer.config.byte_size import format_bytes
from io_engine import DirectMode


def filesystem_of(path: str) -> str:
    """'ext4 on /dev/vda' for the mount holding `path` (best effort)."""
    real = os.path.realpath(path)
    best = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        if real == mount or real.startswith(mount.rstrip("/") + "/"):
            if best is None or len(mount) > len(best.mountpoint):
                best = part
    return f"{best.fstype} on {best.device}" if best is not None else "unknown"


def rate(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 3)


def fmt_rate(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def io_config_text(point: Point, direct: DirectMode) -> str:
    block = point.block_bytes
    block_text = f"1 << {block.bit_length() - 1}" if block & (block - 1) == 0 else str(block)
    return (
        f'IOConfig(num_threads={point.num_threads}, queue_depth={point.queue_depth}, '
        f'block_bytes={block_text}, direct="{direct.value}")'
    )


def direct_text(result: PointResult) -> str:
    if result.direct_used:
        return "O_DIRECT: used (reads cannot come from the page cache)"
    dropped = " page cache dropped (fsync + POSIX_FADV_DONTNEED) before every read pass" if (
        result.page_cache_dropped) else ""
    return f"O_DIRECT: not used ({result.fallback_reason});{dropped}"


def buffer_text(settings: Settings, buffer: torch.Tensor) -> str:
    alignment = address_alignment_bytes(buffer)
    if settings.buffer is BufferKind.MMAP:
        return f"mmap (io_engine.HostArena, address {format_bytes(alignment)}-aligned)"
    text = f"{settings.buffer.value} (torch.empty heap memory, address {format_bytes(alignment)}-aligned"
    if alignment < IO_DEFAULTS.alignment_bytes:
        text += ": every block is staged through the engine's aligned bounce buffer with a memcpy"
    else:
        text += ": O_DIRECT straight into it"
    return text + ")"


def common_json(settings: Settings, buffer: torch.Tensor) -> Dict[str, Any]:
    return {
        "size_bytes": settings.size_bytes,
        "direct_mode": settings.direct.value,
        "buffer": settings.buffer.value,
        "buffer_address_alignment_bytes": address_alignment_bytes(buffer),
        "pattern": settings.pattern.value,
        "repeat": settings.num_repeats,
        "dir": settings.dir,
        "filesystem": filesystem_of(settings.dir),
    }


def point_json(result: PointResult, size_bytes: int, with_medians: bool) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "block_bytes": result.point.block_bytes,
        "queue_depth": result.point.queue_depth,
        "threads": result.point.num_threads,
    }
    for kind in PassKind:
        if kind in result.seconds or kind in (PassKind.SEQ_READ, PassKind.SEQ_WRITE):
            out[kind.json_key] = rate(result.best_gbps(kind, size_bytes))
            if with_medians:
                out[kind.json_key.replace("_gbps", "_gbps_median")] = rate(result.median_gbps(kind, size_bytes))
            if kind in result.seconds:
                request_kib = result.median_disk_request_kib(kind)
                out[kind.json_key.replace("_gbps", "_disk_request_kib")] = (
                    None if request_kib is None else round(request_kib, 1)
                )
    out["direct"] = result.direct_used
    out["fallback_reason"] = result.fallback_reason
    out["page_cache_dropped"] = result.page_cache_dropped
    return out


def report_single(settings: Settings, result: PointResult, buffer: torch.Tensor) -> Dict[str, Any]:
    point, size = result.point, settings.size_bytes
    print(f"io_engine benchmark of {settings.dir} ({filesystem_of(settings.dir)})")
    print(
        f"  file {format_bytes(size)}, block {format_bytes(point.block_bytes)}, queue depth {point.queue_depth}, "
        f"{point.num_threads} threads, --direct {settings.direct.value}, pattern {settings.pattern.value}, "
        f"{settings.num_repeats} pass(es) of each kind"
    )
    print(f"  buffer: {buffer_text(settings, buffer)}")
    print(f"  {direct_text(result)}")
    print(f"  {'pass':<20} {'best GB/s':>10} {'median GB/s':>12} {'passes':>7} {'disk request KiB':>17}")
    for kind in PassKind:
        if kind in result.seconds:
            request_kib = result.median_disk_request_kib(kind)
            print(
                f"  {kind.value:<20} {fmt_rate(result.best_gbps(kind, size)):>10} "
                f"{fmt_rate(result.median_gbps(kind, size)):>12} {len(result.seconds[kind]):>7} "
                f"{'-' if request_kib is None else f'{request_kib:.0f}':>17}"
            )
    print(
        f"  (disk request KiB: mean size of what the disk completed, median over passes; "
        f"{format_bytes(point.block_bytes)} requests split by the kernel show less, merged ones more)"
    )
    if PassKind.AIOFILES_READ in result.seconds:
        print(
            f"  (aiofiles: {point.queue_depth} coroutines, each its own file object, seek + readinto through a "
            f"{point.num_threads}-thread executor; buffered IO, page cache dropped first)"
        )
    out = point_json(result, size, with_medians=True)
    out.update(common_json(settings, buffer))
    return out


def combined_s_per_byte(result: PointResult, size_bytes: int) -> float:
    """Seconds per byte to write a byte and read it back: what a swap file pays per byte it holds."""
    write, read = result.best_gbps(PassKind.SEQ_WRITE, size_bytes), result.best_gbps(PassKind.SEQ_READ, size_bytes)
    assert write is not None and read is not None  # every sweep point times both
    return 1 / write + 1 / read


def report_sweep(settings: Settings, results: List[PointResult], buffer: torch.Tensor) -> Dict[str, Any]:
    size = settings.size_bytes
    print(f"io_engine sweep of {settings.dir} ({filesystem_of(settings.dir)})")
    print(
        f"  file {format_bytes(size)} per point, --direct {settings.direct.value}, "
        f"buffer {buffer_text(settings, buffer)}, best of {settings.num_repeats} pass(es)"
    )
    print(f"  {'block':>8} {'threads':>7} {'qd':>4} {'write GB/s':>10} {'read GB/s':>10}  direct")
    for r in results:
        p = r.point
        print(
            f"  {format_bytes(p.block_bytes):>8} {p.num_threads:>7} {p.queue_depth:>4} "
            f"{fmt_rate(r.best_gbps(PassKind.SEQ_WRITE, size)):>10} "
            f"{fmt_rate(r.best_gbps(PassKind.SEQ_READ, size)):>10}  "
            f"{'O_DIRECT' if r.direct_used else 'buffered: ' + str(r.fallback_reason)}"
        )
    best = min(results, key=lambda r: combined_s_per_byte(r, size))
    best_read = max(results, key=lambda r: r.best_gbps(PassKind.SEQ_READ, size) or 0.0)
    best_write = max(results, key=lambda r: r.best_gbps(PassKind.SEQ_WRITE, size) or 0.0)
    print("best for this disk (least time to write the file and read it back):")
    print(
        f"  write {fmt_rate(best.best_gbps(PassKind.SEQ_WRITE, size))} GB/s, "
        f"read {fmt_rate(best.best_gbps(PassKind.SEQ_READ, size))} GB/s with"
    )
    print(f"  {io_config_text(best.point, settings.direct)}")
    for label, r, kind in (("read", best_read, PassKind.SEQ_READ), ("write", best_write, PassKind.SEQ_WRITE)):
        rate_text = fmt_rate(r.best_gbps(kind, size))
        print(f"  fastest {label}: {rate_text} GB/s with {io_config_text(r.point, settings.direct)}")

    def entry(r: PointResult) -> Dict[str, Any]:
        out = point_json(r, size, with_medians=False)
        out["ioconfig"] = io_config_text(r.point, settings.direct)
        return out

    out = point_json(best, size, with_medians=True)
    out.update(common_json(settings, buffer))
    out["best"] = entry(best)
    out["best_read"] = entry(best_read)
    out["best_write"] = entry(best_write)
    out["points"] = [entry(r) for r in results]
    return out
