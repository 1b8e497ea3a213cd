"""BoundarySpill across steps: a step whose boundaries need a larger NVMe extent replaces the old
one, so the swap files and the NVMe account hold one extent, the largest a step needed, never the
sum of every size a step ever needed. The boundaries read back as written.

Run: pytest tests/offload_trainer/runtime/test_boundary_store.py
"""

from __future__ import annotations

from pathlib import Path

import torch

from io_engine import IOConfig, IOEngine
from io_engine.buffers import round_up
from offload_trainer.config import Tier
from offload_trainer.runtime.boundary_store import BoundarySpill, BoundaryStore
from offload_trainer.runtime.device.host import CpuAccelerator
from offload_trainer.runtime.groups.tiers import ARENA_ALIGN_BYTES, MemoryTiers


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
            sizes = [numel * 4, numel * 4]
            store = BoundaryStore(tiers, sizes, [1, 0], spill)
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
