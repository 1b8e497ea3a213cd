"""The rates bench_offload divides by: the disk's sequential GB/s, and the copy path's host<->device GB/s.

    disk = measure_disk(settings, cfg.io, progress)         # DiskResult: read_gbps, write_gbps
    copies = measure_copies(settings, progress)             # CopyRates: h2d_gbps, d2h_gbps

The disk is timed by bench_io_passes with the engine's own IOConfig; the copies through a fresh
accelerator of the same kind as the engine's (runtime/device/), between a host arena (pinned under
CUDA, as the engine's are) and device memory, exactly as the engine copies. The simulated
accelerator's copies are timed without their injected delay: its copy time is modelled as the
delay plus bytes / that rate, per copy (see bench_offload_report.StepBound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from io_engine import HostArena, IOConfig
from offload_trainer.app.bench import bench_io_passes, bench_io_settings
from offload_trainer.app.bench.bench_offload_settings import DeviceKind, Settings, format_bytes
from offload_trainer.runtime.device.accelerator import Accelerator
from offload_trainer.runtime.device.choose import accelerator_for
from offload_trainer.runtime.device.host import SimulatedAccelerator

GB = 10**9
COPY_PROBE_BYTES = 64 << 20
COPY_PROBE_REPEATS = 3


@dataclass
class DiskResult:
    """Sequential GB/s of the disk under --nvme-dir, best of the passes."""

    read_gbps: float
    write_gbps: float
    direct: bool
    """True if the passes used O_DIRECT (else the page cache was dropped before each read pass)."""
    size_bytes: int
    num_repeats: int


@dataclass
class CopyRates:
    """GB/s of one copy of probe_bytes through the copy path, each direction, best of the repeats."""

    h2d_gbps: float
    d2h_gbps: float
    probe_bytes: int


def measure_disk(settings: Settings, io_config: IOConfig, progress: Callable[[str], None]) -> DiskResult:
    """Sequential write and read GB/s of a --disk-size file under --nvme-dir (see disk_rates)."""
    return disk_rates(settings.nvme_dir, settings.disk_bytes, settings.num_disk_repeats, io_config, progress)


def disk_rates(
    nvme_dir: str, disk_bytes: int, num_repeats: int, io_config: IOConfig, progress: Callable[[str], None]
) -> DiskResult:
    """Sequential write and read GB/s of a `disk_bytes` file under `nvme_dir`, best of `num_repeats`.

    Timed by bench_io_passes.time_point with the engine's IOConfig: one block per request, queue_depth
    in flight, the file written once untimed first, writes timed up to their fsync, and the page
    cache dropped before each read pass where O_DIRECT is not used. The size is rounded up to
    whole blocks, as bench_io moves whole blocks.
    """
    point = bench_io_settings.Point(
        block_bytes=io_config.block_bytes, queue_depth=io_config.queue_depth, num_threads=io_config.worker_threads()
    )
    size = -(-disk_bytes // point.block_bytes) * point.block_bytes
    disk_settings = bench_io_settings.Settings(
        dir=nvme_dir,
        size_bytes=size,
        points=(point,),
        direct=io_config.direct,
        buffer=bench_io_settings.BufferKind.MMAP,
        pattern=bench_io_settings.Pattern.SEQUENTIAL,
        num_repeats=num_repeats,
        sweep=False,
        aiofiles=False,
        emit_json=False,
    )
    buffer = bench_io_passes.make_buffer(disk_settings.buffer, point.buffer_bytes)
    with bench_io_passes.scratch_file(
        nvme_dir, size, point.block_bytes, io_config.direct, dir_flag="--nvme-dir", size_flag="--disk-size",
        what="swap files",
    ) as path:
        # Only the summary line below is printed, not bench_io's line per pass.
        timed = bench_io_passes.time_point(disk_settings, point, path, buffer, fill=True, progress=lambda line: None)
    read_gbps = timed.best_gbps(bench_io_passes.PassKind.SEQ_READ, size)
    write_gbps = timed.best_gbps(bench_io_passes.PassKind.SEQ_WRITE, size)
    assert read_gbps is not None and write_gbps is not None  # a sequential pattern times both
    result = DiskResult(read_gbps, write_gbps, timed.direct_used, size, num_repeats)
    progress(f"disk: write {result.write_gbps:.2f} GB/s, read {result.read_gbps:.2f} GB/s "
             f"({format_bytes(size)}, {'O_DIRECT' if result.direct else 'buffered'}, "
             f"best of {num_repeats})")
    return result


def make_accelerator(settings: Settings, copy_delay_s: float) -> Accelerator:
    """A fresh accelerator of --device's kind; the simulated one with `copy_delay_s` per copy."""
    if settings.device is DeviceKind.SIM:
        return CountingSimulatedAccelerator(copy_delay_s)
    return accelerator_for(settings.device.value)


def measure_copies(settings: Settings, progress: Callable[[str], None]) -> CopyRates:
    """Host-to-device and device-to-host GB/s of COPY_PROBE_BYTES through a fresh accelerator of
    --device's kind (no injected delay), between a host arena and device memory, best of a few."""
    accel = make_accelerator(settings, copy_delay_s=0.0)
    nbytes = COPY_PROBE_BYTES
    arena = HostArena(nbytes)
    device_arena = HostArena(nbytes, pin=False) if accel.torch_device.type == "cpu" else None
    try:
        host = arena.slice(0, nbytes)
        host.fill_(1)
        on_device = (
            device_arena.slice(0, nbytes) if device_arena is not None
            else torch.empty(nbytes, dtype=torch.uint8, device=accel.torch_device)
        )

        def best_s(copy: Callable, dst: torch.Tensor, src: torch.Tensor) -> float:
            times = []
            for _ in range(COPY_PROBE_REPEATS + 1):  # the first is a warm-up
                start = time.perf_counter()
                accel.host_waits(copy(dst, src), "rate probe")
                times.append(time.perf_counter() - start)
            return min(times[1:])

        h2d_s = best_s(accel.h2d, on_device, host)
        d2h_s = best_s(accel.d2h, host, on_device)
    finally:
        accel.close()  # every copy is done before the arena is unpinned
        arena.close()
        if device_arena is not None:
            device_arena.close()
    rates = CopyRates(nbytes / h2d_s / GB, nbytes / d2h_s / GB, nbytes)
    progress(f"copies ({settings.device.value}, {format_bytes(nbytes)}): host to device {rates.h2d_gbps:.2f} GB/s, "
             f"device to host {rates.d2h_gbps:.2f} GB/s")
    return rates


class CountingSimulatedAccelerator(SimulatedAccelerator):
    """The simulated accelerator, counting its copies per direction: each costs the injected delay,
    so the step's copy bound needs their number as well as their bytes."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(h2d_delay_s=delay_s, d2h_delay_s=delay_s)
        self.delay_s = delay_s
        self.num_h2d = 0
        """Host-to-device copies issued so far."""
        self.num_d2h = 0
        """Device-to-host copies issued so far."""

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after=()):  # type: ignore[no-untyped-def]
        self.num_h2d += 1
        return super().h2d(dst, src, after)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after=(), written_by=None):  # type: ignore[no-untyped-def]
        self.num_d2h += 1
        return super().d2h(dst, src, after, written_by)
