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
import os
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn


if TYPE_CHECKING:
    from offload_trainer.runtime.engine import Engine
    from offload_trainer.runtime.groups.shard_group import ShardGroup
    from offload_trainer.runtime.groups.tiers import Home


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


def load_safetensors(engine: "Engine", paths: "Sequence[str | os.PathLike[str]]") -> None:
    """Write the tensors of safetensors files (e.g. a model's shards) into the engine's homes.

    Every name must be a parameter of the model with its shape, and every parameter must be
    given (a tied parameter under any one of its names); all of that is checked from the files'
    headers before anything is written. Tensors are read one at a time (memory-mapped).
    """
    from safetensors import safe_open

    by_name = dict(engine.model.named_parameters(remove_duplicate=False))
    where = {id(p): (group, i) for group in engine.groups for i, p in enumerate(group.params)}
    plan_of = {id(p): group.plan.params[i] for group in engine.groups for i, p in enumerate(group.params)}
    found: Dict[int, Tuple[str, str]] = {}
    problems: List[str] = []
    for path in map(str, paths):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                p = by_name.get(key)
                if p is None:
                    problems.append(f"{path}: {key!r} is not a parameter of the model")
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != plan_of[id(p)].shape:
                    problems.append(f"{path}: {key!r} has shape {list(shape)}, the model's is {list(plan_of[id(p)].shape)}")
                found[id(p)] = (path, key)
    missing = [n for n, p in engine.model.named_parameters() if id(p) not in found]
    if missing:
        problems.append(f"missing from the files: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if problems:
        raise ValueError("these weights do not fit the model: " + "; ".join(problems[:8]))
    for pid, (path, key) in found.items():
        with safe_open(path, framework="pt") as f:
            group, i = where[pid]
            _write_param(engine, group, i, f.get_tensor(key).to(group.plan.dtype))


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
        home.write(engine.tiers, part.to(home.dtype), offset=lo - group.shard_start)
