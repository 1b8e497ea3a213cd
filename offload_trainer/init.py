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

from typing import TYPE_CHECKING, Callable, Dict, List, Tuple

import torch
from torch import nn

from .config import Tier

if TYPE_CHECKING:
    from .engine import Engine
    from .shard_group import ShardGroup
    from .tiers import Home


def has_meta_parameters(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def replace_meta_parameters(model: nn.Module) -> None:
    """Give every meta parameter a new, empty CPU Parameter in its place (one per shared one).

    A meta tensor cannot take CPU data through `.data`, so the engine plans from the meta shapes
    and then swaps the Parameter objects, before anything holds a reference to them; the order
    of model.parameters() and any tying are kept.
    """
    new: Dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
            module._parameters[name] = new[id(p)]


def materialize(engine: "Engine", init_fn: Callable[[nn.Module], None]) -> None:
    """Initialise every parameter of `engine.model` (on meta) into the engine's homes."""
    where: Dict[int, Tuple["ShardGroup", int]] = {
        id(p): (group, i) for group in engine.groups for i, p in enumerate(group.params)
    }
    owners: Dict[int, int] = {}
    for module in engine.model.modules():
        for p in _direct(module):
            owners[id(p)] = owners.get(id(p), 0) + 1
    values: Dict[int, torch.Tensor] = {}
    for module in engine.model.modules():
        direct = _direct(module)
        if not direct:
            continue
        for p in direct:
            if id(p) not in values:
                group, i = where[id(p)]
                values[id(p)] = torch.empty(group.plan.params[i].shape, dtype=group.plan.dtype)
            p.data = values[id(p)]
        with torch.no_grad():
            init_fn(module)
        for p in direct:
            owners[id(p)] -= 1
            if owners[id(p)] == 0:
                group, i = where[id(p)]
                _write_param(engine, group, i, values.pop(id(p)))
                p.data = group._placeholder
    assert not values, "parameters left unwritten"


def _direct(module: nn.Module) -> List[nn.Parameter]:
    seen = set()
    out = []
    for p in module._parameters.values():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _write_param(engine: "Engine", group: "ShardGroup", i: int, value: torch.Tensor) -> None:
    """This rank's part of parameter i of `group` into the parameter home and the fp32 master."""
    slot = group.plan.params[i]
    flat = value.reshape(-1)
    lo = max(slot.offset_numel, group.shard_start)
    hi = min(slot.offset_numel + slot.numel, group.shard_end)
    if lo >= hi:
        return
    part = flat[lo - slot.offset_numel : hi - slot.offset_numel]
    targets: List["Home"] = [group.param_home]
    master = group.optimizer_homes.get("master")
    if master is not None and slot.requires_grad:
        targets.append(master)
    for home in targets:
        _write_range(engine, home, lo - group.shard_start, part.to(home.dtype))


def _write_range(engine: "Engine", home: "Home", start: int, data: torch.Tensor) -> None:
    if home.tier is Tier.NVME:
        assert engine.tiers.store is not None and home.key is not None
        esize = data.element_size()
        engine.tiers.store.write(home.key, data.contiguous().view(torch.uint8), offset=start * esize)
    else:
        assert home.tensor is not None
        home.tensor[start : start + data.numel()].copy_(data)
