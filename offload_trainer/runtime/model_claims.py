"""Which models an engine has taken: initialize() takes ownership of a model's parameters (their
values move to the engine's homes; the model keeps empty placeholders, for good once the engine is
closed), so a second initialize() of the same model, or of one of its modules, would partition
placeholders and train on nothing. The engine claims every module of its model here, and a claimed
module is refused with what to do instead.

Weakly keyed: a model that is dropped leaves no entry behind.
"""

from __future__ import annotations

import weakref
from typing import Callable

from torch import nn

_claims: "weakref.WeakKeyDictionary[nn.Module, Callable[[], bool]]" = weakref.WeakKeyDictionary()
"""Module -> closed(), whether the engine that took it is closed (or gone)."""


def claim(model: nn.Module, closed: Callable[[], bool]) -> None:
    """Mark every module of `model` as taken by an engine; `closed()` tells whether it still runs."""
    for module in model.modules():
        _claims[module] = closed


def refuse_claimed(model: nn.Module) -> None:
    """Raise ValueError if `model` or one of its modules was given to an engine before."""
    for name, module in model.named_modules():
        closed = _claims.get(module)
        if closed is None:
            continue
        what = "the model" if not name else f"its module {name!r}"
        if closed():
            raise ValueError(
                f"{what} was given to an engine that is closed: the engine took its parameters' values "
                "and left empty placeholders, so it cannot be trained again; build the model again (load "
                "the weights from engine.export_safetensors or a checkpoint), or keep that engine open"
            )
        raise ValueError(
            f"{what} is held by an engine that is still open: its parameters are that engine's, so a second "
            "engine would train empty placeholders; use the open engine, or close it and build the model again"
        )
