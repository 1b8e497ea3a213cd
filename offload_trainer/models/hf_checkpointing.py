"""Activation checkpointing of a Hugging Face model, under transformers 5's names or the older ones.

    enable_hf_checkpointing(model)     # non-reentrant, as the engine needs it
    hf_checkpointing_on(model)         # whether it is on

transformers 5 renamed gradient checkpointing to activation checkpointing
(`activation_checkpointing_enable`, `is_activation_checkpointing`) and warns (FutureWarning) at every
use of the old names, which transformers 4 alone has: the new name is used where the class has it.
"""

from __future__ import annotations

from typing import Any

_ENABLE = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
_IS_ON = ("is_activation_checkpointing", "is_gradient_checkpointing")


def _first_of(model: Any, names: tuple) -> Any:
    """The first of `names` the model's class defines, or None."""
    return next((name for name in names if hasattr(type(model), name)), None)


def enable_hf_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing of an HF model; a model without it is left as it is."""
    name = _first_of(model, _ENABLE)
    if name is not None:
        kwargs_name = "activation_checkpointing_kwargs" if name == _ENABLE[0] else "gradient_checkpointing_kwargs"
        getattr(model, name)(**{kwargs_name: {"use_reentrant": False}})


def hf_checkpointing_on(model: Any) -> bool:
    """Whether an HF model has activation checkpointing on; False for any other module."""
    name = _first_of(model, _IS_ON)
    return name is not None and bool(getattr(model, name))
