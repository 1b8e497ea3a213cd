"""Consolidated parameters: a group's full parameters gathered from every rank's shard, on the CPU.

    by_index = group_parameters(group, tiers, collectives)     # model.parameters() index -> tensor

Trainable parameters come from the fp32 master when there is one (low-precision compute), so the
consolidated weights are the optimizer's, not their rounding. A collective: every rank calls it
for the same groups in the same order.
"""

from __future__ import annotations

from typing import Dict

import torch

from offload_trainer.runtime.collectives import Collectives
from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.groups.tiers import MemoryTiers


def group_parameters(group: ShardGroup, tiers: MemoryTiers, collectives: Collectives) -> Dict[int, torch.Tensor]:
    """One group's parameters, consolidated across ranks, as CPU tensors in the model's dtype by
    model.parameters() index; trainable ones from the fp32 master if any."""
    plan = group.plan
    shard = torch.empty(plan.shard_numel, dtype=group.param_home.dtype)
    group.param_home.read(tiers, shard)
    shard = shard.to(plan.dtype)
    master = group.optimizer_homes.get("master")
    if master is not None:
        master.read(tiers, shard[: group.local_trainable_numel])
    flat = torch.empty(plan.flat_numel, dtype=plan.dtype)
    collectives.all_gather_into(flat, shard)
    return {p.index: p.view(flat[p.offset_numel : p.offset_numel + p.numel]).clone() for p in plan.params}
