"""Device slots sized per group: a large embedding no longer makes every slot its size.

The plan gives the N slots the sizes of the N largest groups that need one (so any N groups fit at
once); the least device memory (min_bytes, which the planner checks) counts the largest
`min_slots` of them. An engine whose device budget holds those slots, but not N copies of the
largest group, runs and trains bitwise like plain PyTorch.
"""

from __future__ import annotations

import torch

import offload_trainer as ot
from offload_trainer.config import Tier
from offload_trainer.runtime.layout.memory_plan import plan_memory
from offload_trainer.runtime.layout.partition import plan_partition

from tests.offload_trainer.runtime.test_engine_parity import OPT, TinyLM, assert_params_equal, train_both


def _config(tmp_path, device_budget=None, lookahead: int = 2) -> ot.OffloadConfig:
    return ot.OffloadConfig(
        tiers=ot.TierConfig(params="host", grads="host", optimizer="host", device_budget_bytes=device_budget,
                            nvme_dir=str(tmp_path)),
        prefetch=ot.PrefetchConfig(lookahead_groups=lookahead),
        optimizer=OPT,
    )


def _model() -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM(dim=16, n_layers=4)
    model.emb = torch.nn.Embedding(4096, 16)  # 64 K elements: far larger than a block
    return model


def test_slots_take_the_sizes_of_the_largest_groups(tmp_path) -> None:
    model = _model()
    partition = plan_partition(model, ot.GroupingConfig())
    mp = plan_memory(partition, _config(tmp_path), 0, torch.float32, device_is_host=True)
    sizes = sorted((g.flat_numel for g in partition.groups), reverse=True)
    assert mp.device_slot_numels == tuple(sizes[: mp.num_device_slots])
    assert mp.device_slot_numel == sizes[0] and mp.device_slot_numels[-1] < sizes[0]
    assert sum(mp.arena_bytes[Tier.DEVICE]) == 4 * sum(mp.device_slot_numels)
    assert mp.min_bytes[Tier.DEVICE] == 4 * sizes[0]  # one group in use at a time


def test_a_budget_below_n_largest_slots_fits_and_trains_bitwise(tmp_path) -> None:
    model = _model()
    partition = plan_partition(model, ot.GroupingConfig())
    unlimited = plan_memory(partition, _config(tmp_path), 0, torch.float32, device_is_host=True)
    per_group = 4 * sum(unlimited.device_slot_numels)
    budget = per_group + 1024
    assert budget < 4 * unlimited.device_slot_numel * unlimited.num_device_slots  # too small for equal slots
    ref, state, engine = train_both(model, _config(tmp_path, device_budget=budget), num_steps=3)
    assert engine.memory_plan.num_device_slots == unlimited.num_device_slots
    assert engine.peak_bytes(Tier.DEVICE) <= budget
    assert_params_equal(ref, state)
