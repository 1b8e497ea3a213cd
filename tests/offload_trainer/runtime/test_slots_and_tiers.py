"""tiers and slots: byte accounting per tier, homes on HOST and NVME, and slots lent only when unreferenced.

Everything runs on the CPU (the device tier is host memory there); NVMe homes use a tmp_path swap
directory. Run: pytest tests/offload_trainer/runtime/test_slots_and_tiers.py
"""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import pytest
import torch

from io_engine import IOConfig, IOEngine
from io_engine.swap_dirs import LOCK_NAME
from offload_trainer.config import Tier
from offload_trainer.runtime.device.host import CpuAccelerator
from offload_trainer.runtime.groups.buffer_pool import BufferPool, storage_references
from offload_trainer.runtime.groups.homes import Home
from offload_trainer.runtime.groups.tiers import BudgetExceededError, MemoryTiers, TierAccount

CPU = torch.device("cpu")
HAS_USE_COUNT = hasattr(torch._C, "_storage_Use_Count")


@pytest.fixture
def make_tiers(tmp_path: Path) -> Iterator[Callable[..., MemoryTiers]]:
    """make_tiers(device_budget, host_budget, nvme=False) -> MemoryTiers on the CPU; closed after the test."""
    made: List[MemoryTiers] = []
    engines: List[IOEngine] = []

    def make(device_budget: Optional[int] = None, host_budget: Optional[int] = None, nvme: bool = False) -> MemoryTiers:
        io = IOEngine(IOConfig(num_threads=2, queue_depth=4, block_bytes=8192))
        engines.append(io)
        tiers = MemoryTiers(CpuAccelerator(), device_budget, host_budget, io, str(tmp_path / "nvme") if nvme else None)
        made.append(tiers)
        return tiers

    yield make
    for tiers in made:
        tiers.accelerator.close()
        tiers.close()
    for io in engines:
        io.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("io_engine-")]
    assert not left, f"IO worker threads left running: {left}"


# -- TierAccount -----------------------------------------------------------------------------------


def test_tier_account_take_give_and_peak() -> None:
    account = TierAccount(Tier.HOST, budget_bytes=100)
    account.take(60, "a")
    account.take(40, "b")
    assert account.resident_bytes == 100 and account.peak_bytes == 100
    with pytest.raises(BudgetExceededError):
        account.take(1, "one more byte")
    account.give(70)
    assert account.resident_bytes == 30 and account.peak_bytes == 100
    with pytest.raises(BudgetExceededError):
        account.take(71, "one byte too many")
    account.take(50, "c")
    assert account.resident_bytes == 80 and account.peak_bytes == 100
    account.give(80)
    assert account.resident_bytes == 0 and account.peak_bytes == 100


def test_tier_account_over_budget_raises_with_the_numbers_and_takes_nothing() -> None:
    account = TierAccount(Tier.DEVICE, budget_bytes=100)
    account.take(70, "first")
    with pytest.raises(BudgetExceededError) as info:
        account.take(31, "group 3 params")
    message = str(info.value)
    assert "group 3 params" in message and "31" in message and "101" in message and "100" in message
    assert "device" in message
    assert account.resident_bytes == 70 and account.peak_bytes == 70


def test_tier_account_without_budget_is_unlimited() -> None:
    account = TierAccount(Tier.NVME, budget_bytes=None)
    account.take(1 << 50, "huge")
    account.take(1 << 50, "huge again")
    assert account.peak_bytes == 1 << 51


# -- MemoryTiers -----------------------------------------------------------------------------------


def test_allocate_counts_bytes_on_the_right_tier(make_tiers: Callable[..., MemoryTiers]) -> None:
    tiers = make_tiers(device_budget=10_000, host_budget=10_000)
    assert tiers.device_is_host
    host = tiers.allocate(Tier.HOST, 100, torch.float32, "h")
    device = tiers.allocate(Tier.DEVICE, 300, torch.bfloat16, "d")
    assert host.shape == (100,) and host.dtype == torch.float32 and host.device == CPU
    assert device.shape == (300,) and device.dtype == torch.bfloat16
    assert host.data_ptr() % 4096 == 0, "host memory is page-aligned, ready for direct IO"
    assert tiers.accounts[Tier.HOST].resident_bytes == 400
    assert tiers.accounts[Tier.DEVICE].resident_bytes == 600
    assert tiers.accounts[Tier.NVME].resident_bytes == 0


def test_allocate_over_budget_raises(make_tiers: Callable[..., MemoryTiers]) -> None:
    tiers = make_tiers(host_budget=1000)
    tiers.allocate(Tier.HOST, 200, torch.float32, "a")
    with pytest.raises(BudgetExceededError, match="staging"):
        tiers.allocate(Tier.HOST, 51, torch.float32, "staging")
    assert tiers.accounts[Tier.HOST].resident_bytes == 800


def test_allocate_on_nvme_is_refused(make_tiers: Callable[..., MemoryTiers]) -> None:
    tiers = make_tiers()
    with pytest.raises(ValueError, match="allocate_extents"):
        tiers.allocate(Tier.NVME, 10, torch.float32, "x")


def test_refused_nvme_allocate_charges_nothing(make_tiers: Callable[..., MemoryTiers]) -> None:
    tiers = make_tiers()
    with pytest.raises(ValueError):
        tiers.allocate(Tier.NVME, 10, torch.float32, "x")
    assert tiers.accounts[Tier.NVME].resident_bytes == 0


def test_allocate_extents_needs_an_nvme_dir(make_tiers: Callable[..., MemoryTiers]) -> None:
    tiers = make_tiers()
    with pytest.raises(ValueError, match="nvme_dir"):
        tiers.allocate_extents({"g0.param": 4096})


# -- Home ------------------------------------------------------------------------------------------


def test_host_home_read_and_write(make_tiers: Callable[..., MemoryTiers]) -> None:
    tiers = make_tiers()
    home = Home(Tier.HOST, 5, torch.float32, tensor=tiers.allocate(Tier.HOST, 5, torch.float32, "home"))
    assert home.nbytes == 20

    source = torch.arange(5, dtype=torch.float32)
    assert home.start_write(tiers, source) is None
    assert torch.equal(home.tensor, source)
    into = torch.zeros(5)
    assert home.start_read(tiers, into) is None
    assert torch.equal(into, source)

    # Writing the home's own tensor into it is a no-op, not a self-copy.
    home.tensor.fill_(7.0)
    assert home.start_write(tiers, home.tensor) is None
    assert torch.equal(home.tensor, torch.full((5,), 7.0))


@pytest.mark.parametrize("numel", [1, 1025, 4096 * 3 + 1])
def test_nvme_home_round_trip(make_tiers: Callable[..., MemoryTiers], tmp_path: Path, numel: int) -> None:
    tiers = make_tiers(nvme=True)
    nbytes = numel * 4
    tiers.allocate_extents({"g0.param": nbytes, "g0.grad": 8})
    assert tiers.accounts[Tier.NVME].resident_bytes == nbytes + 8
    home = Home(Tier.NVME, numel, torch.float32, key="g0.param")
    assert home.nbytes == nbytes

    source = tiers.allocate(Tier.HOST, numel, torch.float32, "source")
    source.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(numel)))
    handle = home.start_write(tiers, source)
    assert handle is not None
    assert handle.wait() == nbytes

    into = tiers.allocate(Tier.HOST, numel, torch.float32, "into")
    into.zero_()
    handle = home.start_read(tiers, into)
    assert handle is not None
    assert handle.wait() == nbytes
    assert torch.equal(into, source)

    swap_files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "nvme") for f in fs if f != LOCK_NAME]
    assert len(swap_files) == 1
    tiers.close()
    assert not [f for _, _, fs in os.walk(tmp_path / "nvme") for f in fs], "close() removes the swap files"
    tiers.close()  # idempotent


# -- BufferPool --------------------------------------------------------------------------------------


def make_pool(
    tiers: MemoryTiers, tier: Tier, num_buffers: int, buffer_numel: int, dtype: torch.dtype, what: str, guard: bool = True
) -> BufferPool:
    """A BufferPool; `guard` is guard_references (True for device slots, which autograd can see)."""
    return BufferPool(tiers, tier, num_buffers, buffer_numel, dtype, what, guard_references=guard)


def test_slot_pool_take_and_give(make_tiers: Callable[..., MemoryTiers]) -> None:
    tiers = make_tiers(host_budget=10_000)
    pool = make_pool(tiers, Tier.HOST, num_buffers=3, buffer_numel=100, dtype=torch.float32, what="staging buffer")
    assert pool.num_buffers == 3 and pool.num_free == 3 and pool.buffer_numel == 100 and pool.tier is Tier.HOST

    taken = [pool.take() for _ in range(3)]
    assert all(t is not None and t.shape == (100,) and t.dtype == torch.float32 for t in taken)
    assert len({t.data_ptr() for t in taken}) == 3
    assert pool.num_free == 0
    assert pool.take() is None

    pool.give(taken[1])
    assert pool.num_free == 1
    again = pool.take()
    assert again is not None and again.data_ptr() == taken[1].data_ptr()

    # A prefix view of a slot (what the engine gives back for a group smaller than the slot) returns it.
    prefix = taken[0][:40]
    del taken
    pool.give(again)
    pool.give(prefix)
    del prefix
    assert pool.num_free == 2


def test_slot_pool_accounts_its_slots_at_construction(make_tiers: Callable[..., MemoryTiers]) -> None:
    tiers = make_tiers(device_budget=2_000, host_budget=10_000)
    make_pool(tiers, Tier.DEVICE, num_buffers=2, buffer_numel=100, dtype=torch.float32, what="device slot")
    assert tiers.accounts[Tier.DEVICE].resident_bytes == 800
    assert tiers.accounts[Tier.HOST].resident_bytes == 0
    make_pool(tiers, Tier.HOST, num_buffers=4, buffer_numel=50, dtype=torch.bfloat16, what="staging buffer")
    assert tiers.accounts[Tier.HOST].resident_bytes == 400
    # A pool that does not fit is refused while it is being made, naming the slot that did not fit.
    with pytest.raises(BudgetExceededError, match="device slot 3"):
        make_pool(tiers, Tier.DEVICE, num_buffers=4, buffer_numel=100, dtype=torch.float32, what="device slot")


def test_taking_and_giving_slots_moves_no_bytes(make_tiers: Callable[..., MemoryTiers]) -> None:
    tiers = make_tiers(host_budget=800)
    pool = make_pool(tiers, Tier.HOST, num_buffers=2, buffer_numel=100, dtype=torch.float32, what="staging buffer")
    slot = pool.take()
    assert slot is not None
    assert tiers.accounts[Tier.HOST].resident_bytes == 800
    pool.give(slot)
    assert tiers.accounts[Tier.HOST].resident_bytes == 800


@pytest.mark.skipif(not HAS_USE_COUNT, reason="this torch cannot count storage references")
def test_a_slot_referenced_by_a_view_is_not_lent_again(make_tiers: Callable[..., MemoryTiers]) -> None:
    tiers = make_tiers()
    pool = make_pool(tiers, Tier.HOST, num_buffers=2, buffer_numel=100, dtype=torch.float32, what="device slot")
    first = pool.take()
    assert first is not None
    baseline = storage_references(first)
    view = first[:10]  # e.g. a tensor autograd saved from the group's last use
    assert storage_references(first) > baseline
    first_ptr = first.data_ptr()
    pool.give(first)
    del first

    second = pool.take()
    assert second is not None and second.data_ptr() != first_ptr, "the referenced slot was lent out"
    assert pool.take() is None, "the only free slot is still referenced"
    assert pool.num_free == 1

    del view
    gc.collect()
    third = pool.take()
    assert third is not None and third.data_ptr() == first_ptr
    assert pool.num_free == 0


@pytest.mark.skipif(not HAS_USE_COUNT, reason="this torch cannot count storage references")
def test_holding_the_slot_tensor_itself_does_not_block_it(make_tiers: Callable[..., MemoryTiers]) -> None:
    # The slot tensor the pool hands out is its own object: a caller keeping that reference after
    # give() does not make a new reference to the storage (views do).
    tiers = make_tiers()
    pool = make_pool(tiers, Tier.HOST, num_buffers=1, buffer_numel=16, dtype=torch.float32, what="staging buffer")
    slot = pool.take()
    assert slot is not None
    pool.give(slot)
    assert pool.take() is slot


def test_an_unguarded_pool_lends_a_referenced_slot(make_tiers: Callable[..., MemoryTiers]) -> None:
    # Host staging never reaches autograd, so its pool does not wait for views to die.
    tiers = make_tiers()
    pool = make_pool(tiers, Tier.HOST, num_buffers=1, buffer_numel=16, dtype=torch.float32, what="staging", guard=False)
    slot = pool.take()
    assert slot is not None
    view = slot[:4]
    pool.give(slot)
    again = pool.take()
    assert again is not None and again.data_ptr() == view.data_ptr()


def test_a_pool_of_sizes_lends_the_smallest_buffer_that_holds_the_request(make_tiers: Callable[..., MemoryTiers]) -> None:
    # Device slots are sized per group: a small group takes a small slot, a large group a large one.
    tiers = make_tiers(device_budget=4 * (300 + 100 + 100))
    pool = BufferPool(tiers, Tier.DEVICE, 3, [300, 100, 100], torch.float32, "device slot", guard_references=True)
    assert tiers.accounts[Tier.DEVICE].resident_bytes == 4 * 500
    assert pool.buffer_numel == 300
    small = pool.take(80)
    assert small is not None and pool.capacity(small) == 100
    big = pool.take(250)
    assert big is not None and pool.capacity(big) == 300
    assert pool.take(101) is None, "only a 100-element buffer is free"
    other = pool.take(100)
    assert other is not None and pool.capacity(other) == 100
    pool.give(big)
    pool.give(small)
    again = pool.take(1)
    assert again is not None and again.data_ptr() == small.data_ptr(), "the smallest free buffer first"
    assert pool.add(tiers, 50) is None, "the device budget is full"


@pytest.mark.skipif(not HAS_USE_COUNT, reason="this torch cannot count storage references")
def test_cached_views_are_counted_but_a_new_view_still_blocks_the_slot(make_tiers: Callable[..., MemoryTiers]) -> None:
    tiers = make_tiers()
    pool = make_pool(tiers, Tier.HOST, num_buffers=1, buffer_numel=16, dtype=torch.float32, what="device slot")
    slot = pool.take()
    assert slot is not None
    views = pool.cached_views(slot, 7, lambda: [slot[:4].view(2, 2), slot[4:8]])
    assert pool.cached_views(slot, 7, lambda: []) is views, "made once per (slot, key)"
    pool.give(slot)
    assert pool.take() is slot, "the pool's own cached views do not block the slot"
    saved = slot[8:]  # a tensor autograd kept
    pool.give(slot)
    assert pool.take() is None
    del saved
    gc.collect()
    assert pool.take() is slot
