"""partition.plan_partition: which parameters move together, and each group's flat layout.

Pure planning on small models built on the CPU: group boundaries (auto, by class name, packed by
bytes), tied weights, the flat layout (trainable first, padded to equal aligned shards) and the
user errors. Run: pytest tests/offload_trainer/runtime/test_partition.py
"""

from __future__ import annotations

import dataclasses
from typing import List

import pytest
import torch
from torch import nn

from offload_trainer.config import GroupingConfig
from offload_trainer.models import DecoderConfig, DecoderLM, MoEConfig, MoEDecoderLM
from offload_trainer.runtime.layout.partition import PARAM_ALIGN_BYTES, GroupPlan, PartitionPlan, plan_partition

TINY = DecoderConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=24, max_seq_len=16)
"""A decoder small enough that every plan here takes milliseconds."""


def decoder(**overrides: object) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(dataclasses.replace(TINY, **overrides))


def block_bytes(model: DecoderLM, i: int) -> int:
    return sum(p.numel() * p.element_size() for p in model.layers[i].parameters())


def names(plan: PartitionPlan) -> List[str]:
    return [g.name for g in plan.groups]


def assert_every_param_owned_once(model: nn.Module, plan: PartitionPlan) -> None:
    indices = [slot.index for g in plan.groups for slot in g.params]
    assert sorted(indices) == list(range(len(list(model.parameters()))))
    assert plan.num_params == sum(p.numel() for p in model.parameters())


# -- group boundaries ------------------------------------------------------------------------------


def test_auto_grouping_takes_each_block_of_the_largest_module_list() -> None:
    model = decoder()
    plan = plan_partition(model, GroupingConfig())

    assert names(plan) == ["layers.0", "layers.1", "layers.2", "embed_tokens", "norm", "lm_head"]
    assert [g.index for g in plan.groups] == list(range(6))
    for i in range(3):
        group = plan.groups[i]
        assert group.module_names == (f"layers.{i}",)
        assert {s.name for s in group.params} == {f"layers.{i}.{n}" for n, _ in model.layers[i].named_parameters()}
    # Leftovers: one group per module that owns parameters directly.
    assert plan.groups[3].module_names == ("embed_tokens",)
    assert [s.name for s in plan.groups[3].params] == ["embed_tokens.weight"]
    assert [s.name for s in plan.groups[4].params] == ["norm.weight"]
    assert [s.name for s in plan.groups[5].params] == ["lm_head.weight"]
    assert plan.module_uses == {
        "layers.0": (0,),
        "layers.1": (1,),
        "layers.2": (2,),
        "embed_tokens": (3,),
        "norm": (4,),
        "lm_head": (5,),
    }
    assert_every_param_owned_once(model, plan)


def test_module_classes_decoder_block_gives_the_same_blocks() -> None:
    model = decoder()
    auto = plan_partition(model, GroupingConfig())
    by_class = plan_partition(model, GroupingConfig(module_classes=("DecoderBlock",)))
    assert names(by_class) == names(auto)
    assert [[s.index for s in g.params] for g in by_class.groups] == [[s.index for s in g.params] for g in auto.groups]


def test_module_classes_swiglu_makes_each_expert_a_group() -> None:
    config = MoEConfig(n_layers=2, n_experts=3)
    torch.manual_seed(0)
    model = MoEDecoderLM(config)
    plan = plan_partition(model, GroupingConfig(module_classes=("SwiGLU",)))

    experts = [f"layers.{layer}.mlp.experts.{e}" for layer in range(2) for e in range(3)]
    assert names(plan)[:6] == experts
    for group, name in zip(plan.groups[:6], experts):
        assert group.module_names == (name,)
        assert {s.name for s in group.params} == {f"{name}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        assert plan.module_uses[name] == (group.index,)
    # The rest (attention projections, norms, routers, embedding, head) own their parameters directly.
    rest = names(plan)[6:]
    assert "layers.0.mlp.router" in rest and "layers.1.self_attn.q_proj" in rest
    assert rest[0] == "embed_tokens" and rest[-2:] == ["norm", "lm_head"]
    assert not any(".experts." in n for n in rest)
    assert_every_param_owned_once(model, plan)


def test_module_classes_matching_nothing_lists_the_models_classes() -> None:
    model = decoder()
    with pytest.raises(ValueError) as info:
        plan_partition(model, GroupingConfig(module_classes=("LlamaDecoderLayer",)))
    message = str(info.value)
    assert "LlamaDecoderLayer" in message
    for cls in ("DecoderLM", "DecoderBlock", "Attention", "SwiGLU", "RMSNorm", "Embedding", "Linear", "ModuleList"):
        assert cls in message


def test_nested_matches_keep_only_the_outermost_module() -> None:
    # DecoderBlock contains a SwiGLU: naming both must not split the block.
    model = decoder()
    plan = plan_partition(model, GroupingConfig(module_classes=("DecoderBlock", "SwiGLU")))
    assert names(plan)[:3] == ["layers.0", "layers.1", "layers.2"]
    assert_every_param_owned_once(model, plan)


def test_max_group_bytes_packs_consecutive_blocks() -> None:
    model = decoder(n_layers=5)
    one = block_bytes(model, 0)
    assert all(block_bytes(model, i) == one for i in range(5))
    plan = plan_partition(model, GroupingConfig(max_group_bytes=2 * one))

    assert names(plan)[:3] == ["layers.0..layers.1", "layers.2..layers.3", "layers.4"]
    assert plan.groups[0].module_names == ("layers.0", "layers.1")
    assert plan.groups[1].module_names == ("layers.2", "layers.3")
    assert plan.groups[2].module_names == ("layers.4",)
    assert plan.module_uses["layers.0"] == plan.module_uses["layers.1"] == (0,)
    assert plan.module_uses["layers.4"] == (2,)
    assert sum(s.numel for s in plan.groups[0].params) * 4 == 2 * one
    assert_every_param_owned_once(model, plan)


def test_max_group_bytes_below_one_block_keeps_one_block_per_group() -> None:
    model = decoder()
    plan = plan_partition(model, GroupingConfig(max_group_bytes=1))
    assert names(plan)[:3] == ["layers.0", "layers.1", "layers.2"]


def test_max_group_bytes_just_short_of_two_blocks_does_not_pack() -> None:
    model = decoder()
    plan = plan_partition(model, GroupingConfig(max_group_bytes=2 * block_bytes(model, 0) - 1))
    assert names(plan)[:3] == ["layers.0", "layers.1", "layers.2"]


def test_tied_weight_is_owned_by_the_embeddings_group() -> None:
    model = decoder(tie_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    plan = plan_partition(model, GroupingConfig())

    assert names(plan) == ["layers.0", "layers.1", "layers.2", "embed_tokens", "norm"]
    embed = plan.groups[3]
    assert [s.name for s in embed.params] == ["embed_tokens.weight"]
    owners = [g.index for g in plan.groups for s in g.params if s.name == "embed_tokens.weight"]
    assert owners == [embed.index]
    assert plan.module_uses["lm_head"] == (embed.index,)
    assert plan.module_uses["embed_tokens"] == (embed.index,)
    assert not any("lm_head" in s.name for g in plan.groups for s in g.params)
    assert_every_param_owned_once(model, plan)


# -- flat layout -----------------------------------------------------------------------------------


def frozen_some(model: DecoderLM) -> DecoderLM:
    # Frozen parameters that come first in module order, to see them moved behind the trainable ones.
    model.layers[0].input_layernorm.weight.requires_grad_(False)
    model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("align_numel", [1, 8, 1024])
def test_flat_layout(world_size: int, align_numel: int) -> None:
    model = frozen_some(decoder())
    params = list(model.parameters())
    plan = plan_partition(model, GroupingConfig(), world_size=world_size, align_numel=align_numel)
    assert plan.world_size == world_size

    for group in plan.groups:
        flags = [s.requires_grad for s in group.params]
        assert flags == sorted(flags, reverse=True), f"{group.name}: frozen before trainable"
        cursor = trainable_end = 0
        step = PARAM_ALIGN_BYTES // group.dtype.itemsize  # [Note: Parameter alignment]
        for slot in group.params:
            p = params[slot.index]
            cursor = -(-cursor // step) * step
            assert slot.offset_numel == cursor
            assert slot.numel == p.numel() and slot.shape == tuple(p.shape)
            assert slot.requires_grad == p.requires_grad
            assert group.dtype == p.dtype
            cursor += slot.numel
            trainable_end = cursor if slot.requires_grad else trainable_end
        assert group.trainable_numel == trainable_end
        assert group.used_numel == cursor
        assert group.flat_numel >= cursor
        assert group.flat_numel % (world_size * align_numel) == 0
        assert group.flat_numel == world_size * group.shard_numel
        assert group.shard_numel % align_numel == 0
        # Padding is less than one aligned row across the ranks.
        assert group.flat_numel - cursor < world_size * align_numel
        assert group.flat_bytes == group.flat_numel * 4 and group.shard_bytes == group.shard_numel * 4

        ranges = [group.shard_range(r) for r in range(world_size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == group.flat_numel
        for (_, end), (start, _) in zip(ranges, ranges[1:]):
            assert end == start
        assert all(end - start == group.shard_numel for start, end in ranges)
        assert sum(group.trainable_shard_numel(r) for r in range(world_size)) == group.trainable_numel
        assert group.has_trainable == (group.trainable_numel > 0)
    assert_every_param_owned_once(model, plan)


def test_frozen_parameters_follow_trainable_ones_in_their_group() -> None:
    model = frozen_some(decoder())
    group = plan_partition(model, GroupingConfig()).groups[0]
    assert [s.name for s in group.params[-2:]] == [
        "layers.0.input_layernorm.weight",
        "layers.0.self_attn.q_proj.weight",
    ]
    frozen_numel = model.layers[0].input_layernorm.weight.numel() + model.layers[0].self_attn.q_proj.weight.numel()
    assert sum(s.numel for s in group.params[-2:]) == frozen_numel
    # Trainable elements end where the last trainable parameter does; the frozen ones start at the
    # next aligned offset ([Note: Parameter alignment]).
    assert group.trainable_numel == max(s.offset_numel + s.numel for s in group.params if s.requires_grad)
    step = PARAM_ALIGN_BYTES // group.dtype.itemsize
    assert group.params[-2].offset_numel == -(-group.trainable_numel // step) * step


def test_trainable_shard_numel_where_trainable_ends_mid_shard() -> None:
    group = GroupPlan(0, "g", ("g",), torch.float32, (), trainable_numel=10, flat_numel=12, shard_numel=4)
    assert [group.shard_range(r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    assert [group.trainable_shard_numel(r) for r in range(3)] == [4, 4, 2]
    frozen = GroupPlan(0, "g", ("g",), torch.float32, (), trainable_numel=0, flat_numel=12, shard_numel=4)
    assert [frozen.trainable_shard_numel(r) for r in range(3)] == [0, 0, 0]
    assert not frozen.has_trainable


def test_a_group_of_one_element_still_gets_an_aligned_shard_per_rank() -> None:
    model = nn.Sequential(nn.Linear(1, 1, bias=False))
    plan = plan_partition(model, GroupingConfig(), world_size=3, align_numel=4)
    (group,) = plan.groups
    assert group.name == "0" and group.shard_numel == 4 and group.flat_numel == 12


def test_world_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        plan_partition(decoder(), GroupingConfig(), world_size=0)


def test_mixed_dtypes_in_a_group_raise_naming_the_group() -> None:
    model = decoder()
    model.layers[1].mlp.half()
    with pytest.raises(ValueError) as info:
        plan_partition(model, GroupingConfig())
    message = str(info.value)
    assert "'layers.1'" in message and "torch.float16" in message and "torch.float32" in message
    assert "model.float()" in message


def test_a_uniform_non_fp32_model_is_planned_in_its_dtype() -> None:
    model = decoder().to(torch.bfloat16)
    plan = plan_partition(model, GroupingConfig())
    assert {g.dtype for g in plan.groups} == {torch.bfloat16}
    assert all(g.flat_bytes == g.flat_numel * 2 for g in plan.groups)


def test_parameters_on_the_root_module_form_a_root_group() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    model = Root()
    plan = plan_partition(model, GroupingConfig())
    assert names(plan) == ["blocks.0", "blocks.1", "<root>"]
    assert plan.module_uses[""] == (2,)
    assert_every_param_owned_once(model, plan)
