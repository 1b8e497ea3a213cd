"""The engine's hooks with nothing behind them: what hooking a model costs before any engine work.

    hooks = EngineHooksOnly(model)       # the engine's Hooks, their callbacks empty
    with hooks.forward_context():
        loss = model(x)                  # pre/post-forward hooks, output tensor hooks, saved-tensor hooks
    loss.backward()                      # post-accumulate-grad hooks; .grad kept as plain PyTorch keeps it
    hooks.remove()

offload-bench-many-layers trains a third copy of its model this way, interleaved with plain PyTorch
and the engine, and reports the difference to plain PyTorch per group as the "hook floor" column:
the part of the engine's extra time that the autograd and module hook calls take by themselves
(each a call from C++ into Python), with the engine's real hooks (runtime/hooks.py: the same
module set, the same saved-tensor pack test) and no acquisition, copy, eviction or gradient
bookkeeping behind them. No engine built on these hooks costs less per group on that machine.
"""

from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple

import torch
from torch import nn

from offload_trainer.config import GroupingConfig
from offload_trainer.runtime.hooks import HookCallbacks, Hooks
from offload_trainer.runtime.layout.partition import plan_partition


class _EmptyCallbacks(HookCallbacks):
    """Every callback returns at once; no tensor is ever in a group's device copy."""

    def __init__(self) -> None:
        self._resident: Dict[int, int] = {}

    def on_forward_start(self, groups: Sequence[int]) -> None:
        return None

    def on_forward_end(self, groups: Sequence[int]) -> None:
        return None

    def on_backward_start(self, groups: Sequence[int]) -> None:
        return None

    def in_backward(self) -> bool:
        return False

    def holds(self, groups: Sequence[int]) -> bool:
        return True

    def saved_tensor_sources(self) -> Tuple[Dict[int, int], Callable[[int], torch.Tensor]]:
        def no_copy(gi: int) -> torch.Tensor:
            raise AssertionError("no group is resident, so no saved tensor was packed as one")

        return self._resident, no_copy

    def on_grad(self, param: nn.Parameter) -> None:
        return None


class EngineHooksOnly:
    """The engine's hooks on `model`, for the modules and parameters the engine would hook."""

    def __init__(self, model: nn.Module, grouping: GroupingConfig = GroupingConfig()) -> None:
        plan = plan_partition(model, grouping)
        self._hooks = Hooks(model, dict(plan.module_uses), list(model.parameters()), _EmptyCallbacks(), plan.entry_uses)

    def forward_context(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks the engine runs a forward in."""
        return self._hooks.saved_tensors()

    def remove(self) -> None:
        self._hooks.remove()


__all__ = ["EngineHooksOnly"]
