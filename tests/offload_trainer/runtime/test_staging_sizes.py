"""Host staging buffers in a few size classes, not all the largest group's size.

The classes are computed on paper from the group sizes (layout/staging_sizes.py); the engine
allocates exactly the bytes the plan (and so the planner) counts; a request is served by its own
class only, so a small group never holds a buffer a large one waits for; and training through the
smaller pool stays bitwise plain PyTorch's, also at the plan's least host budget with the largest
group updated last (where lending a large buffer to a small group would leave it none).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload_trainer as ot
from offload_trainer.config import Tier
from offload_trainer.runtime.device.host import CpuAccelerator
from offload_trainer.runtime.groups.buffer_pool import BufferPool
from offload_trainer.runtime.groups.tiers import MemoryTiers
from offload_trainer.runtime.layout.memory_plan import plan_memory
from offload_trainer.runtime.layout.partition import plan_partition
from offload_trainer.runtime.layout.staging_sizes import class_numels, ring_numels, staging_classes

from tests.offload_trainer.runtime.test_engine_parity import OPT, VOCAB, Block, accelerator, assert_params_equal, train_both

ALL_NVME = dict(params="nvme", grads="nvme", optimizer="nvme")


class WideLast(nn.Module):
    """TinyLM's shape with a last block far wider than the others: the largest group is used last."""

    def __init__(self, dim: int = 16, wide: int = 1024, big_embedding: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(4096 if big_embedding else VOCAB, dim)
        self.layers = nn.ModuleList([Block(dim) for _ in range(3)])
        self.wide = nn.Sequential(nn.Linear(dim, wide), nn.GELU(), nn.Linear(wide, dim))
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h + self.wide(h))


def _config(tmp_path, host_budget=None, accum: int = 1, **tiers) -> ot.OffloadConfig:
    return ot.OffloadConfig(
        tiers=dict(ALL_NVME, **tiers, nvme_dir=str(tmp_path), host_budget_bytes=host_budget),
        optimizer=OPT,
        grad_accum_steps=accum,
    )


def test_classes_pay_for_a_large_group_once_per_state_kind() -> None:
    # A tied embedding five times a block, twelve blocks, three staged kinds, three groups in flight.
    classes = staging_classes([500] + [100] * 12, buffers_per_group=3, groups_in_flight=3)
    assert classes == [(500, 3), (100, 9)]
    assert sum(n * k for n, k in classes) == 2400  # all the largest's size: 9 x 500 = 4500
    assert class_numels(classes) == (500,) * 3 + (100,) * 9
    # Equal groups are one class; two groups in flight at the least; a class never below two buffers.
    assert staging_classes([7] * 5, 2, 2) == [(7, 4)]
    assert staging_classes([9], 1, 3) == [(9, 2)]
    # Close sizes share a class when that costs fewer bytes than a class each.
    assert staging_classes([101, 100, 99], 1, 3) == [(101, 3)]
    assert staging_classes([], 3, 3) == []
    assert ring_numels([5, 50, 20, 10], 2) == (50, 20)


def test_a_request_is_served_by_its_own_class_only(tmp_path) -> None:
    tiers = MemoryTiers(CpuAccelerator(), None, None, None, None)
    try:
        pool = BufferPool(tiers, Tier.HOST, 4, [100, 100, 20, 20], torch.float32, "staging buffer",
                          guard_references=False, exact_class=True)
        small = [pool.take(10), pool.take(20)]
        assert all(b is not None and b.numel() == 20 for b in small)
        assert pool.take(1) is None, "a small request must not take a large class's buffer"
        large = pool.try_take_as(50, torch.float32)
        assert large is not None and pool.capacity(large) == 100
        pool.give(small[0])
        assert pool.take(5).numel() == 20
    finally:
        tiers.close()


def test_a_buffer_added_makes_its_class_known(tmp_path) -> None:
    # take() finds a request's class once per size (a memo): a buffer added later must still count.
    tiers = MemoryTiers(CpuAccelerator(), None, None, None, None)
    try:
        pool = BufferPool(tiers, Tier.HOST, 2, [20, 20], torch.float32, "staging buffer",
                          guard_references=False, exact_class=True)
        assert pool.class_numel(50) == 50 and pool.take(50) is None  # no class holds 50 yet
        added = pool.add(tiers, 100)  # lent at once
        assert added is not None and pool.class_numel(50) == 100
        pool.give(added)
        assert pool.num_free_of_class(50) == 1 and pool.take(50) is added
        assert pool.take(10).numel() == 20
    finally:
        tiers.close()


def test_the_engine_allocates_what_the_plan_counts_and_trains_bitwise(tmp_path) -> None:
    torch.manual_seed(0)
    model = WideLast(big_embedding=True)
    cfg = _config(tmp_path)
    partition = plan_partition(model, cfg.grouping)
    mp = plan_memory(partition, cfg, 0, torch.float32, device_is_host=True)
    sizes = [g.shard_numel for g in partition.groups]
    # param, grad and both moments staged per group: three groups in flight, four buffers each.
    assert mp.staging_numels == class_numels(staging_classes(sizes, 4, 3))
    assert len(set(mp.staging_numels)) > 1 and sum(mp.staging_numels) < mp.num_staging * max(sizes)
    assert mp.min_bytes[Tier.HOST] == 4 * sum(class_numels(staging_classes(sizes, 4, 2)))

    ref, state, engine = train_both(model, cfg, num_steps=3)
    assert_params_equal(ref, state)
    assert engine.memory_plan.staging_numels == mp.staging_numels
    assert engine.staging is not None and engine.staging.num_buffers == mp.num_staging
    # Nothing beyond the plan: the host tier's peak is the planned arena (staging only, all homes on NVMe).
    assert engine.peak_bytes(Tier.HOST) == sum(mp.arena_bytes[Tier.HOST])
    assert sum(mp.arena_bytes[Tier.HOST]) == 4 * sum(mp.staging_numels)


@pytest.mark.parametrize("grads", ["nvme", "host"])
def test_least_host_budget_with_the_largest_group_last_trains_bitwise(tmp_path, grads: str) -> None:
    torch.manual_seed(0)
    model = WideLast()
    unlimited = _config(tmp_path, grads=grads, accum=2)
    partition = plan_partition(model, unlimited.grouping)
    order = [g.shard_numel for g in partition.groups]
    assert max(order) == order[-2], "the wide block (the largest group) is updated after the small ones"
    least = plan_memory(partition, unlimited, 0, torch.float32, device_is_host=True).min_bytes[Tier.HOST]
    cfg = _config(tmp_path, host_budget=least, grads=grads, accum=2)
    ref, state, engine = train_both(model, cfg, num_steps=3)
    assert_params_equal(ref, state)
    assert engine.peak_bytes(Tier.HOST) <= least


def test_parameter_staging_takes_the_largest_groups_sizes(tmp_path) -> None:
    torch.manual_seed(0)
    model = WideLast(big_embedding=True)
    cfg = _config(tmp_path)
    partition = plan_partition(model, cfg.grouping)
    mp = plan_memory(partition, cfg, 0, torch.float32, device_is_host=False)
    sizes = sorted((g.shard_numel for g in partition.groups), reverse=True)
    assert mp.param_staging_numels == tuple(sizes[: cfg.prefetch.lookahead_groups + 1])
    ref, state, engine = train_both(model, cfg, num_steps=2, device=accelerator("sim"))
    assert_params_equal(ref, state)
    assert engine.peak_bytes(Tier.HOST) == sum(engine.memory_plan.arena_bytes[Tier.HOST])


def test_a_take_whose_wait_is_interrupted_keeps_the_buffer_in_the_pool() -> None:
    """take() waits on the host for a buffer's earlier users (a copy still reading it); a Ctrl-C
    landing in that wait took the buffer off the free list without handing it to anyone: one
    staging buffer fewer for every later step, until none was left."""
    from offload_trainer.runtime.device.pending import HostEvent

    interrupted = {"once": False}

    def host_waits(pending: HostEvent) -> None:
        if not interrupted["once"]:
            interrupted["once"] = True
            raise KeyboardInterrupt()
        pending.wait()

    tiers = MemoryTiers(CpuAccelerator(), None, None, None, None)
    try:
        pool = BufferPool(tiers, Tier.HOST, 2, [100, 100], torch.float32, "staging buffer",
                          guard_references=False, host_waits=host_waits)
        buffers = [pool.take(100), pool.take(100)]
        copy = HostEvent()
        for buffer in buffers:
            pool.give(buffer, [copy])  # a copy still reads them
        with pytest.raises(KeyboardInterrupt):
            pool.take(100)
        assert pool.num_free == 2
        copy.set()
        assert pool.take(100) is not None and pool.take(100) is not None
    finally:
        tiers.close()
