"""initialize(): the one call that turns a model and a config into an Engine.

    engine = ot.initialize(model, cfg)                                  # placement as the config says
    engine = ot.initialize(model, cfg_auto, micro_batch=(2, 256))       # placement = "auto": planned first

Under placement = "auto" the planner (offload_trainer.planning) chooses the tiers and the lookahead
here, before the Engine is built, so that the runtime never depends on the planner.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from offload_trainer.config import OffloadConfig, PlacementMode
from offload_trainer.planning.auto_placement import resolve_auto_placement
from offload_trainer.planning.model_spec import MicroBatch
from offload_trainer.runtime.collectives import data_parallel_world_size
from offload_trainer.runtime.device.accelerator import Accelerator
from offload_trainer.runtime.device.choose import accelerator_for
from offload_trainer.runtime.engine import Engine, check_engine_arguments


def initialize(
    model: nn.Module,
    config: Optional[OffloadConfig] = None,
    lr_schedule: Optional[Callable[[int], float]] = None,
    init_fn: Optional[Callable[[nn.Module], None]] = None,
    micro_batch: Optional[Tuple[int, int]] = None,
    device: "torch.device | str | Accelerator | None" = None,
) -> Engine:
    """Take ownership of `model`'s parameters and return the engine that trains it.

    `lr_schedule`: any callable of the optimizer step (from 0) giving its learning rate; by
    default the schedule of config.optimizer (constant, or warmup + cosine).
    `init_fn`: for a model built on the meta device, a function initialising one module's own
    parameters in place; they are then created one module at a time straight into their homes,
    so the whole model never exists in memory.
    `micro_batch`: (batch_size, seq_len) of one rank's micro-batch; needed under placement =
    "auto", where the planner times the model's compute and counts its activations for it.
    `engine.placement_choice` then holds the planner's answer, and `engine.config` the settings used.
    `device`: "cpu", "cuda[:n]", an Accelerator (runtime.device.host.SimulatedAccelerator: a GPU-like
    device on the CPU whose copies finish late), or None for the GPU if there is one.
    """
    config = config if config is not None else OffloadConfig()
    check_engine_arguments(model, config, lr_schedule, init_fn)
    if config.placement is not PlacementMode.AUTO:
        return Engine(model, config, device=device, lr_schedule=lr_schedule, init_fn=init_fn)
    if micro_batch is None:
        raise ValueError(
            'placement="auto" plans for one micro-batch: pass initialize(..., micro_batch=(batch_size, seq_len)), '
            'or set placement="manual" with tiers of your own'
        )
    batch = _micro_batch(micro_batch)  # before the accelerator's copy workers start
    accelerator = accelerator_for(device)
    try:
        choice = resolve_auto_placement(
            model, config, batch, accelerator.torch_device, data_parallel_world_size()
        )
    except BaseException:
        if accelerator is not device:  # made here (its copy workers): the Engine that would own it never came
            accelerator.close()
        raise
    engine = Engine(model, choice.engine_config(config), lr_schedule=lr_schedule, init_fn=init_fn, device=accelerator)
    engine.placement_choice = choice
    return engine


def _micro_batch(micro_batch: object) -> MicroBatch:
    """initialize's `micro_batch` as a MicroBatch; TypeError naming it unless it is a pair ("2x256" and
    (2, 256, 1) failed as "MicroBatch.__init__() takes 3 positional arguments but 6 were given")."""
    if isinstance(micro_batch, (str, bytes)) or not isinstance(micro_batch, Sequence) or len(micro_batch) != 2:
        raise TypeError(
            f"micro_batch={micro_batch!r} must be a pair (batch_size, seq_len) of one rank's micro-batch, e.g. (2, 256)"
        )
    return MicroBatch(*micro_batch)
