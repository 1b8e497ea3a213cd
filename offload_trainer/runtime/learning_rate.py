"""LearningRates: the engine's learning rates as a torch.optim.Optimizer's param_groups.

    engine = ot.initialize(model, cfg)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(engine.lr_optimizer, T_max=1000)
    ...
    if engine.step():          # True at the accumulation boundary, where an update was applied
        sched.step()

torch's LR schedulers take a torch.optim.Optimizer and change `group["lr"]` in its
`param_groups`; this object is one that holds no tensors (the engine owns the parameters and the
update), with one param group per weight-decay value, in the order of
optimizer.torch_param_groups (the order a plain PyTorch reference uses). Its step() does nothing
but let schedulers see that an update ran: engine.step() calls it at each update.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch


class LearningRates(torch.optim.Optimizer):
    """Param groups with a learning rate and a weight decay each, and no parameters."""

    def __init__(self, lr: float, weight_decays: Sequence[float]) -> None:
        # torch.optim.Optimizer.__init__ refuses an empty parameter list, so the attributes the
        # schedulers and Optimizer's own methods read are set here.
        self.defaults: Dict[str, Any] = {"lr": lr}
        self.state: Dict[Any, Any] = defaultdict(dict)
        self.param_groups: List[Dict[str, Any]] = [
            {"params": [], "lr": lr, "weight_decay": wd} for wd in dict.fromkeys(weight_decays)
        ]
        self._optimizer_step_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()

    @property
    def driven_by_scheduler(self) -> bool:
        """True once a torch.optim.lr_scheduler scheduler is attached (it wraps step())."""
        return hasattr(self.step, "_wrapped_by_lr_sched")

    def step(self, closure: Optional[Callable[[], float]] = None) -> None:  # type: ignore[override]
        """Called by engine.step() at each update it applies; changes nothing here."""
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to zero: engine.step() starts the next accumulation itself."""

    def set_all(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The param groups' settings (learning rate, and what a scheduler added: initial_lr, ...) and
        whether a scheduler drives them, JSON-safe; saved with every checkpoint, so that a scheduler
        resumed there continues from the rates it had set (a chainable one, ExponentialLR say,
        computes the next from them)."""
        return {
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "driven_by_scheduler": self.driven_by_scheduler,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # type: ignore[override]
        """Restore state_dict()'s settings, matched by weight-decay value (a group whose value the
        saved state lacks keeps its own)."""
        saved = {float(g["weight_decay"]): g for g in state["param_groups"]}
        for group in self.param_groups:
            settings = saved.get(float(group["weight_decay"]))
            if settings is not None:
                group.update({k: v for k, v in settings.items() if k != "weight_decay"})

    def by_weight_decay(self) -> Dict[float, float]:
        """The learning rate of each weight-decay value, for StreamingOptimizer.update."""
        return {float(g["weight_decay"]): float(g["lr"]) for g in self.param_groups}


__all__ = ["LearningRates"]
