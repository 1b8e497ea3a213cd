"""placement = "auto": the planner's choice for a live model, made once and shared by every rank.

    choice = resolve_auto_placement(model, cfg, MicroBatch(2, 256), torch.device("cpu"), world_size=1)
    engine_cfg = choice.engine_config(cfg)       # tiers, lookahead and the device budget left for the engine

offload_trainer.initialize calls this before it builds the Engine, so the runtime never sees the planner.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from offload_trainer.config import OffloadConfig
from offload_trainer.errors import PlanError
from offload_trainer.planning.model_spec import MicroBatch, ModelSpec, plan_for_model
from offload_trainer.planning.planner import PlacementChoice


def resolve_auto_placement(
    model: nn.Module, config: OffloadConfig, micro_batch: MicroBatch, device: torch.device, world_size: int
) -> PlacementChoice:
    """Plan on rank 0 and give every rank the same choice (ranks must agree on the lookahead, or their
    prefetch all-gathers would come in different orders). Raises PlanError on every rank if nothing fits."""
    spec = ModelSpec.from_module(model)
    multi = world_size > 1
    choice: Optional[PlacementChoice] = None
    error: Optional[str] = None
    if not multi or dist.get_rank() == 0:
        try:
            choice = plan_for_model(spec, config, micro_batch, device, partition=spec.partition(config, world_size))
        except PlanError as e:
            error = str(e)
    if multi:
        box = [(choice, error)]
        dist.broadcast_object_list(box, src=0)
        choice, error = box[0]
    if error is not None:
        raise PlanError(f'placement="auto": {error}')
    assert choice is not None
    if choice.memory_note is not None and (not multi or dist.get_rank() == 0):
        warnings.warn(f'placement="auto": {choice.memory_note}', stacklevel=3)
    return choice
