"""Materialise a model built on the meta device straight into its homes, one module at a time.

    with torch.device("meta"):
        model = DecoderLM(config)                       # no memory for parameters
    engine = ot.initialize(model, cfg, init_fn=init_weights)

Modules are visited in `model.modules()` order. Each module's own parameters are bound to
temporary CPU tensors, `init_fn(module)` initialises them in place, and a parameter is written
into its group's homes (this rank's shard of it, in the compute dtype, and into the fp32
master) once the last module that holds it has been visited, then released. So host memory
holds at most one module's parameters (plus tied ones awaiting their last owner), whatever the
model's size, and the random draws are those of constructing the model directly and calling
`init_fn` on every module in that order: the weights come out bitwise the same.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.groups.tiers import MemoryTiers




@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within it, every nn.Module parameter is created on the meta device, buffers as usual.

    For models whose constructor computes buffers (rotary frequencies, say) that must exist for
    real, e.g. `AutoModelForCausalLM.from_config(...)`: the parameters are then materialised by
    initialize(..., init_fn=...) into their homes.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def has_meta_parameters(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def replace_meta_parameters(model: nn.Module) -> List[Tuple[nn.Module, str, nn.Parameter]]:
    """Give every meta parameter a new, empty CPU Parameter in its place (one per shared one), and
    return what was replaced, (module, name, the meta parameter): an engine whose build fails puts
    them back (put_back_meta_parameters), so the model can be given to another engine.

    A meta tensor cannot take CPU data through `.data`, so the engine plans from the meta shapes
    and then swaps the Parameter objects, before anything holds a reference to them; the order
    of model.parameters() and any tying are kept.
    """
    new: Dict[int, nn.Parameter] = {}
    replaced: List[Tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
            module._parameters[name] = new[id(p)]
            replaced.append((module, name, p))
    return replaced


def put_back_meta_parameters(replaced: List[Tuple[nn.Module, str, nn.Parameter]]) -> None:
    """Undo replace_meta_parameters: each module holds its meta parameter again."""
    for module, name, p in replaced:
        module._parameters[name] = p


def materialize(
    model: nn.Module, groups: Sequence[ShardGroup], tiers: MemoryTiers, init_fn: Callable[[nn.Module], None]
) -> None:
    """Initialise every parameter of `model` (on meta, replaced by replace_meta_parameters) into the groups' homes."""
    where: Dict[int, Tuple[ShardGroup, int]] = {id(p): (group, i) for group in groups for i, p in enumerate(group.params)}
    owners: Dict[int, int] = {}
    for module in model.modules():
        for p in _direct(module):
            owners[id(p)] = owners.get(id(p), 0) + 1
    values: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        direct = _direct(module)
        if not direct:
            continue
        for p in direct:
            if id(p) not in values:
                group, i = where[id(p)]
                # NaN until init_fn sets it: an element it leaves is refused (_refuse_unset), never trained.
                values[id(p)] = torch.full(group.plan.params[i].shape, float("nan"), dtype=group.plan.dtype)
            p.data = values[id(p)]
        with torch.no_grad():
            init_fn(module)
        for p in direct:
            owners[id(p)] -= 1
            if owners[id(p)] == 0:
                group, i = where[id(p)]
                value = values.pop(id(p))
                _refuse_unset(group.plan.params[i].name, module, value)
                group.write_param(tiers, i, value)
                group.unbind_placeholder(p)
    assert not values, "parameters left unwritten"


_CHECK_NUMEL = 1 << 24
"""Elements checked at once by _refuse_unset (a 16 MiB mask, whatever the parameter's size)."""


def _refuse_unset(name: str, module: nn.Module, value: torch.Tensor) -> None:
    """ValueError if init_fn left elements of parameter `name` unset (still the NaN they start as).

    [Note: Parameters init_fn leaves unset]
    A parameter on the meta device has no values: init_fn(module) gives them. One it does not
    handle (the built-in init_weights knows RMSNorm, Embedding and Linear: a LayerNorm's weight and
    bias were left as they were) held whatever the temporary tensor's memory held before
    (torch.empty: 6.2e-01, 4.6e-41, -3.5 in a LayerNorm's weight here), written into the homes
    and trained on without a word. Each parameter now starts as NaN, and one with any NaN left
    once its last module's init_fn ran is refused by name; the build is unwound."""
    flat = value.reshape(-1)
    unset = 0
    for start in range(0, flat.numel(), _CHECK_NUMEL):
        unset += int(flat[start : start + _CHECK_NUMEL].isnan().sum())
    if unset:
        raise ValueError(
            f"init_fn left {unset} of {flat.numel()} elements of parameter {name!r} (of a {type(module).__name__}) "
            "unset: a model on the meta device has no values until init_fn(module) sets each module's own "
            "parameters; make init_fn set every parameter of the modules it is given, e.g. "
            "module.reset_parameters() for the kinds it does not handle (offload_trainer.models.init_weights "
            "handles RMSNorm, Embedding and Linear)"
        )


def _direct(module: nn.Module) -> List[nn.Parameter]:
    seen = set()
    out = []
    for p in module._parameters.values():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
