"""The planner counts host staging as the engine allocates it: in size classes, not all the largest group's.

A tied embedding far larger than the blocks: the least host budget of an all-NVMe placement is
the staging classes' bytes at two groups in flight (layout/staging_sizes.py), below what equal
buffers of the largest group would need; the planner finds a placement within that budget, and
the engine it configures plans the host bytes the planner counted, allocates no more than its
plan, and trains a step within the budget.
"""

from __future__ import annotations

from pathlib import Path

import torch

import offload_trainer as ot
from offload_trainer.config import Tier
from offload_trainer.models import DecoderConfig, DecoderLM
from offload_trainer.planning.model_spec import ModelSpec
from offload_trainer.planning.planner import over_budget, plan_placement
from offload_trainer.runtime.layout.memory_plan import plan_memory
from offload_trainer.runtime.layout.staging_sizes import class_numels, staging_classes

from tests.offload_trainer.planning.test_planner import COMPUTE, _machine

SHAPE = dict(vocab_size=8192, tie_embeddings=True)


def test_the_least_host_budget_counts_staging_classes_and_the_engine_runs_in_it(tmp_path: Path) -> None:
    spec = ModelSpec.from_preset("tiny", **SHAPE)
    cfg = ot.OffloadConfig(tiers=dict(params="nvme", grads="nvme", optimizer="nvme", nvme_dir=str(tmp_path / "swap")))
    part = spec.partition(cfg, 1)
    sizes = [g.shard_numel for g in part.groups]
    kinds = 4  # parameter, gradient and both AdamW moments, each through staging
    least = plan_memory(part, cfg, 0, torch.float32, True).min_bytes[Tier.HOST]
    assert least == 4 * sum(class_numels(staging_classes(sizes, kinds, 2)))
    assert least < 4 * 2 * kinds * max(sizes), "equal buffers of the largest group would not fit"

    choice = plan_placement(part, cfg, _machine(tmp_path, host=least), COMPUTE, 0)
    assert not over_budget(choice.chosen, choice.machine)
    planned = choice.chosen.need_bytes[Tier.HOST]
    assert planned <= least

    engine_cfg = choice.engine_config(cfg.with_overrides({"tiers.host_budget_bytes": least}))
    torch.manual_seed(0)
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny", **SHAPE)), engine_cfg) as engine:
        assert engine.memory_plan.min_bytes[Tier.HOST] == planned  # the planner's count is the engine's
        tokens = torch.randint(0, 8192, (2, 17))
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.wait_for_updates()
        # The arena, and the gradient homes lent from the heap beside it, counted all the same
        # ([Note: Gradient homes lent from the heap] in runtime/gradients.py).
        lent = sum(g.grad_home.nbytes for g in engine.groups if g.grad_home is not None and g.grad_home.lent
                   and g.grad_home.tier is Tier.HOST)
        assert engine.peak_bytes(Tier.HOST) == sum(engine.memory_plan.arena_bytes[Tier.HOST]) + lent <= least
