"""merge_small_groups: consecutive small groups merged after partition, and training stays bitwise.

The pass is pure (a PartitionPlan in, a PartitionPlan out): every parameter lands in exactly one
merged group, laid out trainable first and contiguous, and every hooked module needs the merged
group of each group it needed. Then the engine with merged groups trains to the same bits as plain
PyTorch, on the CPU and on the simulated accelerator, in memory and on NVMe, tied weights included.
"""

from __future__ import annotations

import pytest
import torch

import offload_trainer as ot
from offload_trainer.runtime.layout.merge_groups import merge_small_groups
from offload_trainer.runtime.layout.partition import PARAM_ALIGN_BYTES, plan_partition

from tests.offload_trainer.runtime.test_engine_parity import (
    DEVICES, OPT, PLACEMENTS, TinyLM, accelerator, assert_params_equal, train_both,
)


def _block_bytes(model: TinyLM) -> int:
    return sum(p.numel() * 4 for p in model.layers[0].parameters())


def test_none_or_large_groups_leave_the_plan_alone() -> None:
    model = TinyLM(n_layers=6)
    plan = plan_partition(model, ot.GroupingConfig())
    assert merge_small_groups(plan, None) is plan
    assert merge_small_groups(plan, 1) is plan  # every group already holds at least 1 byte


@pytest.mark.parametrize("world_size", [1, 2])
def test_runs_are_merged_up_to_the_minimum_and_uses_follow(world_size: int) -> None:
    model = TinyLM(n_layers=6, tie=True)
    plan = plan_partition(model, ot.GroupingConfig(), world_size=world_size)
    merged = merge_small_groups(plan, 3 * _block_bytes(model))
    # Six blocks in runs of three, then the embedding and the head (tied: the head owns nothing).
    assert [g.module_names for g in merged.groups][:2] == [
        ("layers.0", "layers.1", "layers.2"), ("layers.3", "layers.4", "layers.5"),
    ]
    assert [g.index for g in merged.groups] == list(range(len(merged.groups)))
    old_owner = {p.index: g.index for g in plan.groups for p in g.params}
    new_owner = {p.index: g.index for g in merged.groups for p in g.params}
    assert sorted(new_owner) == sorted(old_owner)  # every parameter exactly once
    for g in merged.groups:
        offsets = [p.offset_numel for p in g.params]
        assert offsets == sorted(offsets) and offsets[0] == 0
        # Each right after the one before, at its next aligned offset ([Note: Parameter alignment]).
        step = PARAM_ALIGN_BYTES // g.dtype.itemsize
        assert all(b.offset_numel == -(-(a.offset_numel + a.numel) // step) * step for a, b in zip(g.params, g.params[1:]))
        flags = [p.requires_grad for p in g.params]
        assert flags == sorted(flags, reverse=True)  # trainable first
        assert g.trainable_numel == max(p.offset_numel + p.numel for p in g.params if p.requires_grad)
        assert g.flat_numel == g.shard_numel * world_size >= g.used_numel
    old_to_new = {old: new_owner[p.index] for old_g in plan.groups for p in old_g.params for old in [old_g.index]}
    for module, needed in plan.module_uses.items():
        assert merged.module_uses[module] == tuple(dict.fromkeys(old_to_new[g] for g in needed))


def test_max_group_bytes_caps_a_merge() -> None:
    model = TinyLM(n_layers=6)
    plan = plan_partition(model, ot.GroupingConfig())
    block = _block_bytes(model)
    merged = merge_small_groups(plan, 10 * block, max_group_bytes=2 * block)
    assert [len(g.module_names) for g in merged.groups if g.module_names[0].startswith("layers")] == [2, 2, 2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", ["all-host", "all-nvme", "mixed"])
def test_merged_groups_train_bitwise_like_plain_pytorch(tmp_path, placement: str, device: str) -> None:
    torch.manual_seed(0)
    model = TinyLM(n_layers=6, tie=placement == "mixed")
    cfg = ot.OffloadConfig(
        tiers=ot.TierConfig(**PLACEMENTS[placement], nvme_dir=str(tmp_path)),
        grouping=ot.GroupingConfig(min_group_bytes=2 * _block_bytes(model)),
        prefetch=ot.PrefetchConfig(lookahead_groups=1),
        optimizer=OPT,
        grad_accum_steps=2,
    )
    ref, state, engine = train_both(model, cfg, num_steps=3, device=accelerator(device))
    assert len(engine.groups) < 8  # 6 blocks, embedding, head before merging
    assert_params_equal(ref, state)
