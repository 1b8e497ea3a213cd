"""BoundarySpill across steps: a step whose boundaries need a larger NVMe extent replaces the old
one, so the swap files and the NVMe account hold one extent, the largest a step needed, never the
sum of every size a step ever needed; so do the host staging buffers on an accelerator
(MemoryTiers.free). The boundaries read back as written.

Run: pytest tests/offload_trainer/runtime/test_boundary_store.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from io_engine import IOConfig, IOEngine
from io_engine.buffers import round_up
from offload_trainer.config import Tier
from offload_trainer.runtime.boundary_store import NUM_STAGING, BoundarySpill, BoundaryStore
from offload_trainer.runtime.device.host import CpuAccelerator, SimulatedAccelerator
from offload_trainer.runtime.groups.tiers import ARENA_ALIGN_BYTES, MemoryTiers


def _one_step_on_nvme(tiers: MemoryTiers, spill: BoundarySpill, step: int, numel: int) -> None:
    """One step's boundaries, two blocks of two micro-batches of `numel` floats, all on NVMe: put,
    taken back in backward's order equal to what was put, then the store closed."""
    store = BoundaryStore(tiers, [numel * 4, numel * 4], [1, 0], spill)
    assert store.tier_of == {0: Tier.NVME, 1: Tier.NVME}
    g = torch.Generator().manual_seed(step)
    h = {(k, m): torch.randn(numel, generator=g) for k in (0, 1) for m in (0, 1)}
    for k in (0, 1):
        for m in (0, 1):
            store.put(k, m, h[k, m].clone())
    for k in (1, 0):
        for m in (0, 1):
            assert torch.equal(store.take(k, m), h[k, m])
    store.close()


def test_a_larger_step_replaces_the_extent_and_frees_the_old_one(tmp_path: Path) -> None:
    accel = CpuAccelerator()
    io = IOEngine(IOConfig(num_threads=2, queue_depth=4, block_bytes=8192))
    # No room on the device or the host: every boundary goes to NVMe.
    tiers = MemoryTiers(accel, 0, 0, io, str(tmp_path / "nvme"))
    try:
        spill = BoundarySpill(tiers)
        store_of_tiers = tiers.store
        assert store_of_tiers is not None
        largest = 0
        # Micro-batches of 1, then 3, then 2, then 5 thousand floats (as a changing sequence length
        # would make them): two blocks of two micro-batches each step.
        for step, numel in enumerate([1000, 3000, 2000, 5000]):
            _one_step_on_nvme(tiers, spill, step, numel)
            needed = 4 * round_up(numel * 4, ARENA_ALIGN_BYTES)
            largest = max(largest, needed)
            assert spill.extent_bytes == largest
            assert list(store_of_tiers.extents) == [spill.key]
            assert store_of_tiers.allocated_bytes == round_up(largest, io.config.alignment_bytes)
            assert tiers.accounts[Tier.NVME].resident_bytes == largest
        assert tiers.accounts[Tier.NVME].peak_bytes == largest, "the old extent was freed before the new one was made"
    finally:
        accel.close()
        tiers.close()
        io.close()


def test_larger_staging_replaces_the_old_buffers(tmp_path: Path) -> None:
    """On an accelerator (the simulated one) NVMe boundaries pass through host staging: a step
    that needs larger staging gives the old buffers back (budget and arena), so the host account
    and the arenas hold the largest staging a step needed, not the sum."""
    accel = SimulatedAccelerator(h2d_delay_s=0.0, d2h_delay_s=0.0)
    io = IOEngine(IOConfig(num_threads=2, queue_depth=4, block_bytes=8192))
    largest_staging = NUM_STAGING * round_up(5000 * 4, ARENA_ALIGN_BYTES)
    # Room on the host for the staging only: every boundary goes to NVMe.
    tiers = MemoryTiers(accel, 0, largest_staging, io, str(tmp_path / "nvme"))
    try:
        spill = BoundarySpill(tiers)
        for step, numel in enumerate([3000, 4000, 3500, 5000, 4500]):
            _one_step_on_nvme(tiers, spill, step, numel)
            held = max(round_up(n * 4, ARENA_ALIGN_BYTES) for n in [3000, 4000, 3500, 5000, 4500][: step + 1])
            assert [b.numel() for b in spill.staging] == [held] * NUM_STAGING
            assert tiers.accounts[Tier.HOST].resident_bytes == NUM_STAGING * held
            assert len(tiers._loose_arenas) == NUM_STAGING
        assert tiers.accounts[Tier.HOST].peak_bytes == largest_staging
    finally:
        accel.close()
        tiers.close()
        io.close()


def test_free_refuses_a_buffer_of_a_shared_arena(tmp_path: Path) -> None:
    accel = CpuAccelerator()
    tiers = MemoryTiers(accel, None, None, None, None)
    try:
        tiers.reserve(Tier.HOST, 1 << 16)
        shared = tiers.allocate(Tier.HOST, 4096, torch.uint8, "x")
        with pytest.raises(ValueError, match="own_arena"):
            tiers.free(Tier.HOST, shared)
        own = tiers.allocate(Tier.HOST, 4096, torch.uint8, "y", own_arena=True)
        tiers.free(Tier.HOST, own)
        assert tiers.accounts[Tier.HOST].resident_bytes == 4096
    finally:
        accel.close()
        tiers.close()


def test_a_ctrl_c_in_the_wait_for_the_writes_leaves_them_to_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Backward's first NVMe take waits for every boundary write: a Ctrl-C landing there marked the
    writes finished all the same, so the close() at the step's end waited for none, and the next
    step wrote the same extent (or the engine closed its files) while they were in flight. Each
    write here takes 0.2 s; close() must return with all of them done."""
    import os
    import threading
    import time

    import io_engine.handle

    pwritev, wait = os.pwritev, io_engine.handle.IOHandle.wait
    interrupt = {"on": False}

    def slow_pwritev(*args: object) -> int:
        time.sleep(0.2)
        return pwritev(*args)  # type: ignore[arg-type]

    def interrupted_wait(self: io_engine.handle.IOHandle, timeout: "float | None" = None) -> int:
        if interrupt["on"] and threading.current_thread() is threading.main_thread():
            interrupt["on"] = False
            raise KeyboardInterrupt()
        return wait(self, timeout)

    accel = CpuAccelerator()
    io = IOEngine(IOConfig(num_threads=2, queue_depth=4, block_bytes=8192))
    tiers = MemoryTiers(accel, 0, 0, io, str(tmp_path / "nvme"))
    try:
        store = BoundaryStore(tiers, [4000, 4000], [1, 0], BoundarySpill(tiers))
        monkeypatch.setattr(os, "pwritev", slow_pwritev)
        for k in (0, 1):
            for m in (0, 1):
                store.put(k, m, torch.full((1000,), float(k * 2 + m)))
        writes = [handle for handle, _ in store._writing]
        monkeypatch.setattr(io_engine.handle.IOHandle, "wait", interrupted_wait)
        interrupt["on"] = True
        with pytest.raises(KeyboardInterrupt):
            store.take(1, 0)
        store.close()
        assert all(handle.done() for handle in writes), "close() returned with boundary writes in flight"
    finally:
        accel.close()
        tiers.close()
        io.close()
