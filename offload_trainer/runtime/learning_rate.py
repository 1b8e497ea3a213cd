"""LearningRates: the engine's learning rates as a torch.optim.Optimizer's param_groups.

    engine = ot.initialize(model, cfg)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(engine.lr_optimizer, T_max=1000)
    ...
    if engine.step():          # True at the accumulation boundary, where an update was applied
        sched.step()

torch's LR schedulers take a torch.optim.Optimizer and change `group["lr"]` in its
`param_groups`; this object is one that holds no tensors (the engine owns the parameters and the
update), with one param group per weight-decay value of the config, in the order of
optimizer.torch_param_groups (the order a plain PyTorch reference uses). A group's
`weight_decay` may be changed too (a weight-decay schedule), as in a torch optimizer: the next
update applies it to the group's parameters. Its step() does nothing but let schedulers see that
an update ran: engine.step() calls it at each update.

A loop may also write `group["lr"]` itself before each step, as with a torch optimizer (nanoGPT's
`for g in optimizer.param_groups: g["lr"] = lr`): once a rate differs from the one the engine's
schedule last set, the rates are the loop's, and the engine's schedule no longer sets them
(`follows_schedule`). Before, the next engine.step() overwrote them, silently.
"""

from __future__ import annotations

import math

from collections import OrderedDict, defaultdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch


def check_rate(value: float, what: str) -> float:
    """`value` if it is a finite number of 0 or more; ValueError naming `what` and the value otherwise.
    torch.optim.AdamW refuses a negative rate as it is built, but a rate changes every step: a nan one
    from a schedule or a scheduler made every weight nan at the next update, without a word."""
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{what}={value!r} is not a learning rate: it must be a finite number of 0 or more")
    return value


class LearningRates(torch.optim.Optimizer):
    """Param groups with a learning rate and a weight decay each, and no parameters."""

    def __init__(self, lr: float, weight_decays: Sequence[float]) -> None:
        # torch.optim.Optimizer.__init__ refuses an empty parameter list, so the attributes the
        # schedulers and Optimizer's own methods read are set here.
        self.defaults: Dict[str, Any] = {"lr": lr}
        self.state: Dict[Any, Any] = defaultdict(dict)
        self.decay_keys: List[float] = list(dict.fromkeys(weight_decays))
        """Per param group: the weight decay the config gives its parameters (the optimizer's key for
        them), whatever its `weight_decay` is changed to."""
        self.param_groups: List[Dict[str, Any]] = [{"params": [], "lr": lr, "weight_decay": wd} for wd in self.decay_keys]
        self._scheduled: List[float] = [lr] * len(self.param_groups)
        """The rates the engine's schedule last set (set_all), to tell a rate the loop wrote."""
        self.written_by_loop = False
        """True once the loop wrote a rate itself (a group's lr differed from the schedule's)."""
        self.on_zero_grad: Optional[Callable[[bool], None]] = None
        """The engine's handling of zero_grad(set_to_none) (Engine._zero_grad), set by the engine."""
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
        """Nothing to zero at an accumulation boundary: engine.step() starts the next accumulation
        itself. Between micro-batches, the engine drops the step's gradients so far (`on_zero_grad`),
        as torch.optim's zero_grad() drops `.grad`."""
        if self.on_zero_grad is not None:
            self.on_zero_grad(set_to_none)

    def follows_schedule(self) -> bool:
        """Whether the engine's schedule sets the rates: not once a torch scheduler drives them, nor
        once the loop has written one itself (seen here: a rate other than the schedule's last)."""
        if self.driven_by_scheduler:
            return False
        if not self.written_by_loop:
            self.written_by_loop = any(g["lr"] != lr for g, lr in zip(self.param_groups, self._scheduled))
        return not self.written_by_loop

    def check_rates(self) -> None:
        """ValueError naming the group and the value unless every group's lr and weight_decay is a finite
        number of 0 or more, whoever wrote it (the schedule, the loop, a torch scheduler)."""
        for i, group in enumerate(self.param_groups):
            for key in ("lr", "weight_decay"):
                value = group[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"engine.param_groups[{i}][{key!r}]={value!r} must be a number")
                check_rate(float(value), f"engine.param_groups[{i}][{key!r}]")

    def set_all(self, lr: float) -> None:
        """The engine's schedule's rate into every group."""
        for group in self.param_groups:
            group["lr"] = lr
        self._scheduled = [lr] * len(self.param_groups)

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The param groups' settings (learning rate, and what a scheduler added: initial_lr, ...) and
        whether a scheduler drives them, JSON-safe; saved with every checkpoint, so that a scheduler
        resumed there continues from the rates it had set (a chainable one, ExponentialLR say,
        computes the next from them)."""
        self.follows_schedule()  # notes a rate the loop wrote since the last step
        return {
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "decay_keys": list(self.decay_keys),
            "driven_by_scheduler": self.driven_by_scheduler,
            "written_by_loop": self.written_by_loop,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # type: ignore[override]
        """Restore state_dict()'s settings, matched by the config's weight decay of each group (a
        group the saved state lacks keeps its own)."""
        saved = {float(k): g for k, g in zip(state["decay_keys"], state["param_groups"])}
        for key, group in zip(self.decay_keys, self.param_groups):
            settings = saved.get(key)
            if settings is not None:
                group.update(settings)
        self._scheduled = [g["lr"] for g in self.param_groups]  # as loaded: not the loop's writing
        self.written_by_loop = bool(state.get("written_by_loop", False))  # absent before it was kept

    def by_weight_decay(self) -> Dict[float, Tuple[float, float]]:
        """Per weight decay the config gives (the optimizer's key for a set of parameters): the
        learning rate and the weight decay its group holds now, for StreamingOptimizer.update."""
        return {key: (float(g["lr"]), float(g["weight_decay"])) for key, g in zip(self.decay_keys, self.param_groups)}


__all__ = ["LearningRates"]
