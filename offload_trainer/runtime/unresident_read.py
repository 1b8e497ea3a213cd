"""The errors for a parameter read where the engine has not made it resident, made plain: in
backward (explained), by state_dict() (state_dict_refused) and by a forward after the engine closed
(forward_after_close).

Outside its module's use a parameter is an empty placeholder ([Note: Binding parameters] in
groups/shard_group.py). Code that reads it there (a loss term over `model.parameters()` in the
training loop, say) computes with 0 elements, and when backward reaches the parameter, now bound
to its values again, autograd refuses the 0-element gradient: "Function PowBackward0 returned an
invalid gradient at index 0 - got [0] but expected shape compatible with [64]". explained()
turns that message into one that says what happened, which parameters have that shape, and the fix:

    with unresident_read.explained(plan.groups):
        loss.backward()
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

from offload_trainer.errors import UnresidentReadError
from offload_trainer.runtime.layout.partition import GroupPlan

_PLACEHOLDER_GRAD = re.compile(r"invalid gradient at index \d+ - got \[0\] but expected shape compatible with \[([\d, ]*)\]")
_NAMES_SHOWN = 3


def explain(error: RuntimeError, groups: Sequence[GroupPlan]) -> Optional[UnresidentReadError]:
    """The plain error for autograd's refusal of a placeholder's gradient; None for any other error."""
    found = _PLACEHOLDER_GRAD.search(str(error))
    if found is None:
        return None
    shape = tuple(int(n) for n in found.group(1).replace(" ", "").split(",") if n)
    names = [p.name for g in groups for p in g.params if p.shape == shape]
    which = ", ".join(names[:_NAMES_SHOWN]) + (f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else "")
    return UnresidentReadError(
        f"a parameter of shape {list(shape)} ({which or 'no parameter of the model has it'}) was read outside the "
        "forward of every module that uses it (a loss term over model.parameters() in the training loop, say): "
        "there the engine keeps an empty placeholder, so it read 0 elements and backward refused its gradient; "
        "compute such a term inside a module's forward (a module may read any of its descendants' parameters), "
        "or read the values with engine.full_state_dict()"
    )


def state_dict_refused(module: str, engine_closed: bool) -> UnresidentReadError:
    """The error for `state_dict()` of a module whose parameters the engine holds (or held, closed)."""
    if engine_closed:
        return UnresidentReadError(
            f"state_dict() reached module {module!r}, whose parameters are empty placeholders: the engine that held "
            "their values is closed; take them before engine.close() with engine.full_state_dict() (CPU tensors) or "
            "engine.export_safetensors(path), or resume from a checkpoint (engine.save_checkpoint(dir))"
        )
    return UnresidentReadError(
        f"state_dict() reached module {module!r}, whose parameters the engine holds in their homes (the module has "
        "empty placeholders), so it would return no weights; use engine.full_state_dict() for the values (CPU "
        "tensors), engine.export_safetensors(path) for a file, or engine.save_checkpoint(dir) to resume training"
    )


def load_state_dict_refused(module: str, engine_closed: bool) -> UnresidentReadError:
    """The error for `load_state_dict()` into a module whose parameters the engine holds (or held)."""
    if engine_closed:
        return UnresidentReadError(
            f"load_state_dict() reached module {module!r}, whose parameters are empty placeholders left by an engine "
            "that is closed; build the model again and load the weights into it before offload_trainer.initialize()"
        )
    return UnresidentReadError(
        f"load_state_dict() reached module {module!r}, whose parameters the engine holds in their homes (the module "
        "has empty placeholders); load weights before offload_trainer.initialize(), or into the engine with "
        "engine.load_safetensors([files]) (engine.load_checkpoint(dir) to resume training)"
    )


def forward_after_close(module: str) -> UnresidentReadError:
    """The error for a forward of a module whose parameters are placeholders left by a closed engine."""
    return UnresidentReadError(
        f"the forward of module {module!r} reached its parameters, empty placeholders: the engine that held their "
        "values is closed. Take the values before engine.close() with engine.full_state_dict() and load them into "
        "the model built again, or run it over them with torch.func.functional_call(model, state, args)"
    )


@contextmanager
def explained(groups: Sequence[GroupPlan]) -> Iterator[None]:
    """Run the body; autograd's refusal of a placeholder's gradient comes out as UnresidentReadError."""
    try:
        yield
    except RuntimeError as error:
        plain = explain(error, groups)
        if plain is None:
            raise
        raise plain from error


__all__ = ["explain", "explained", "forward_after_close", "load_state_dict_refused", "state_dict_refused"]
