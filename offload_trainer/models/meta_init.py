"""Building a model on the meta device without running its initialisation there.

    with on_meta():                      # torch.device("meta"), and init ops on meta tensors skipped
        model = DecoderLM(config)
    with parameters_on_meta(), skipping_meta_init():
        model = AutoModelForCausalLM.from_config(hf_config)

A meta tensor holds no values, so `normal_`, `uniform_` and the like change nothing on it; but a
few of them (normal_, erfinv_, exponential_, clamp_ among others: nn.Embedding's default init,
trunc_normal_, Hugging Face's _init_weights) have no C++ meta kernel and run Python decompositions
that import torch._dynamo on first use: 1.5-2.5 s added to every process that builds a model on
meta (every offload-train and offload-plan start). The parameters are initialised later for real
(initialize(..., init_fn=...)), and a meta random op draws nothing from the generator, so skipping
them changes no value and no random stream.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

_VALUE_ONLY_IN_PLACE = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "normal_", "uniform_", "erfinv_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_",
        "bernoulli_", "clamp_", "clamp_min_", "clamp_max_", "fill_", "zero_", "mul_", "add_", "sub_", "div_",
    )
    if hasattr(torch.Tensor, name)
) | frozenset(
    getattr(torch.nn.init, name)
    for name in (
        "normal_", "uniform_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
        "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
    )
    if hasattr(torch.nn.init, name)
)
"""In-place ops, and torch.nn.init's functions, that change a tensor's values only (never its shape,
dtype or strides). A mode does not see the ops inside a function it let run, so the init functions
are listed themselves."""


class _SkipMetaInit(TorchFunctionMode):
    def __torch_function__(
        self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _VALUE_ONLY_IN_PLACE:
            target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def skipping_meta_init() -> Iterator[None]:
    """Within it, value-only in-place ops on meta tensors return the tensor as it is."""
    with _SkipMetaInit():
        yield


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """torch.device("meta") for everything created within it, without the init ops' cost there."""
    with torch.device("meta"), _SkipMetaInit():
        yield


__all__ = ["on_meta", "skipping_meta_init"]
