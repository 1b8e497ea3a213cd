"""Load weights straight into the engine's shards, one stored tensor (or one fused parameter) at a time.

    engine.load_safetensors(sorted(Path("/models/llama").glob("*.safetensors")))
    engine.load_safetensors(source)        # any WeightSource: e.g. a checkpoint whose layout differs

A `WeightSource` says, before any data is read, which parameters it gives and their shapes, in
units (`WeightUnit`): the parameters that one read produces together. A unit is usually one stored
tensor under the parameter's own name; a source that converts a checkpoint's layout may instead
build one parameter from several stored tensors (per-expert weights stacked into one fused expert
parameter), or several parameters from one. Safetensors files read as they are
(`SafetensorsFiles`) are the source that needs no conversion.

Every name must be a parameter of the model with its shape, every parameter must be given (a
tied parameter under any one of its names), and the source must report no problems of its own; all
of that is checked from the units before anything is written, and refused in one ValueError. Units
are then read one at a time (memory-mapped), so host memory holds one unit's tensors, never the
model; a tensor holding a NaN or an infinity is refused then, by name (`_refuse_nonfinite`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import AbstractSet, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import torch
from torch import nn

from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.groups.tiers import MemoryTiers
from offload_trainer.runtime.persist.safetensors_header import check_safetensors_header

@dataclass(frozen=True)
class WeightUnit:
    """The parameters that one read of a weight source produces together, known without reading data."""

    shapes: Tuple[Tuple[str, Tuple[int, ...]], ...]
    """(parameter name, shape) of each parameter the read gives, in the model's names."""
    origin: str
    """Where the data comes from, for messages (a file and the stored names)."""

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(name for name, _ in self.shapes)


@runtime_checkable
class WeightSource(Protocol):
    """Weights for a model, described up front and read one unit at a time."""

    def units(self) -> Sequence[WeightUnit]:
        """Every unit the source gives (names and shapes only: no tensor data is read)."""
        ...

    def problems(self) -> Sequence[str]:
        """What the source found it cannot give, one sentence each (a stored tensor that fits no
        parameter, a conversion that fails on the stored shapes); the load refuses if there are any."""
        ...

    def read(self, unit: WeightUnit) -> Mapping[str, torch.Tensor]:
        """The tensors of one of `units()`: exactly its names, with its shapes (any dtype; CPU)."""
        ...


class SafetensorsFiles:
    """Safetensors files as they are: each stored tensor is the parameter of the same name, except
    those named in `buffers` (the model's persistent buffers, as an export without stored_as holds
    them), which are left to read_buffers."""

    def __init__(self, paths: "Sequence[str | os.PathLike[str]]", buffers: AbstractSet[str] = frozenset()) -> None:
        self.paths = [str(p) for p in paths]
        self._stored: Dict[WeightUnit, Tuple[str, str]] = {}
        self._problems: List[str] = []
        self.buffers: Dict[str, str] = {}
        """Stored name of each buffer found -> its file."""
        from safetensors import safe_open

        first: Dict[str, str] = {}  # stored name -> the file that holds it
        for path in self.paths:
            check_safetensors_header(path)  # the library's own refusal names no file
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if key in buffers:
                        self.buffers.setdefault(key, path)
                        continue
                    stored = f.get_slice(key)
                    problem = stored_tensor_problem(key, path, stored.get_dtype(), first.get(key))
                    if problem is not None:
                        self._problems.append(problem)
                        continue
                    first[key] = path
                    unit = WeightUnit(((key, tuple(stored.get_shape())),), path)
                    self._stored[unit] = (path, key)

    def units(self) -> Sequence[WeightUnit]:
        return list(self._stored)

    def problems(self) -> Sequence[str]:
        return list(self._problems)

    def read(self, unit: WeightUnit) -> Mapping[str, torch.Tensor]:
        from safetensors import safe_open

        path, key = self._stored[unit]
        with safe_open(path, framework="pt") as f:
            return {key: f.get_tensor(key)}

    def read_buffers(self, live: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The stored buffers, checked against the model's `live` ones (shape); ValueError naming each misfit.
        A buffer the files do not hold keeps its value."""
        from safetensors import safe_open

        out: Dict[str, torch.Tensor] = {}
        for key, path in self.buffers.items():
            with safe_open(path, framework="pt") as f:
                out[key] = f.get_tensor(key)
        bad = [f"{k!r} has shape {list(v.shape)}, the model's is {list(live[k].shape)}" for k, v in out.items() if v.shape != live[k].shape]
        if bad:
            raise ValueError("these buffers do not fit the model: " + "; ".join(bad[:8]))
        return out


FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0"})
"""Safetensors dtypes that hold floating-point values: what a parameter's weights may be stored as
(cast on load); an integer or bool tensor under a parameter's name is another file's, or corrupted."""


def stored_tensor_problem(key: str, path: str, dtype: str, also_in: Optional[str]) -> Optional[str]:
    """Why stored tensor `key` of `path` cannot be a parameter's weights, or None: it is stored in an
    earlier file too (which copy is meant? a shard of another save left beside these, say: never picked
    silently), or it holds integers or bools (`dtype` as safetensors names it), which no cast makes
    into trained weights."""
    if also_in is not None:
        return (
            f"{key!r} is stored in both {also_in} and {path} (a shard of another save left beside these?); "
            "remove the files that do not belong"
        )
    if dtype not in FLOAT_DTYPES:
        return f"{path}: {key!r} is stored as {dtype}, not a floating-point type (corrupted, or not weights)"
    return None


def check_weights_fit(model: nn.Module, source: WeightSource) -> None:
    """Refuse, in one ValueError naming every misfit, weights that do not fit `model` (names and shapes
    from the source's units against the model's parameters). Call it while the model is still on the
    meta device: then nothing is allocated for a model whose weights were never going to load (a
    config.json that lost its sizes builds the library's default, billions of parameters).
    load_weights checks the same again."""
    _check_fit(model, source, lambda p: tuple(p.shape))


def _check_fit(
    model: nn.Module, source: WeightSource, shape_of: Callable[[nn.Parameter], Tuple[int, ...]]
) -> Dict[int, str]:
    """id(parameter) -> the name it is first given under (a tied parameter is written once); ValueError
    naming every misfit (unknown name, wrong shape, missing, the source's own problems)."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    given: Dict[int, str] = {}
    problems: List[str] = list(source.problems())
    for unit in source.units():
        for name, shape in unit.shapes:
            p = by_name.get(name)
            if p is None:
                problems.append(f"{name!r} (from {unit.origin}) is not a parameter of the model")
                continue
            model_shape = shape_of(p)
            if tuple(shape) != tuple(model_shape):
                problems.append(
                    f"{name!r} (from {unit.origin}) has shape {list(shape)}, the model's is {list(model_shape)}"
                )
            given.setdefault(id(p), name)
    missing = [n for n, p in model.named_parameters() if id(p) not in given]
    if missing:
        problems.append(f"missing from the weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if problems:
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ValueError("these weights do not fit the model: " + "; ".join(problems[:8]) + more)
    return given


def load_weights(
    model: nn.Module,
    groups: Sequence[ShardGroup],
    tiers: MemoryTiers,
    source: WeightSource,
    before_writes: Callable[[], None] = lambda: None,
) -> None:
    """Write the parameters `source` gives into the groups' homes; no device copy may exist.
    ValueError naming every misfit (unknown name, wrong shape, missing) before anything is written;
    `before_writes()` is called once the checks pass, before the first write."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    where = {id(p): (group, i) for group in groups for i, p in enumerate(group.params)}

    def planned_shape(p: nn.Parameter) -> Tuple[int, ...]:
        group, i = where[id(p)]
        return tuple(group.plan.params[i].shape)

    given = _check_fit(model, source, planned_shape)
    units = list(source.units())
    before_writes()
    for unit in units:
        tensors = source.read(unit)
        if set(tensors) != set(unit.names):  # a broken source, not a misfit of the weights
            raise RuntimeError(f"the weight source read {sorted(tensors)} for {unit.origin}, described {list(unit.names)}")
        for name, shape in unit.shapes:
            p = by_name[name]
            if given[id(p)] != name:
                continue  # a tied parameter given again under another name: written once
            value = tensors[name]
            if tuple(value.shape) != tuple(shape):
                raise RuntimeError(f"the weight source read {name!r} as {list(value.shape)}, described {list(shape)}")
            _refuse_nonfinite(name, unit.origin, value)
            group, i = where[id(p)]
            group.write_param(tiers, i, value.to(group.plan.dtype))
        del tensors


_FINITE_CHECK_NUMEL = 1 << 24
"""Elements checked at once by _refuse_nonfinite (a 16 MiB mask, whatever the tensor's size)."""


def _refuse_nonfinite(name: str, origin: str, value: torch.Tensor) -> None:
    """ValueError if weight `name` holds a NaN or an infinity. No model's parameter does: such a value is
    a damaged file (a bad download, a disk error, a conversion that overflowed), and training on it
    fails only at the first step, with a message about the learning rate. Checked as each unit is
    read, so the weights before it are already written: the engine then holds a partial load, which it
    refuses to train on until a load completes ([Note: A load that failed part-way] in runtime/engine.py)."""
    flat = value.reshape(-1)
    bad = 0
    for start in range(0, flat.numel(), _FINITE_CHECK_NUMEL):
        piece = flat[start : start + _FINITE_CHECK_NUMEL]
        finite = torch.isfinite(piece)
        if not bool(finite.all()):
            bad += int(piece.numel() - finite.sum())
    if bad:
        raise ValueError(
            f"weight {name!r} (from {origin}) holds {bad} NaN or infinite value(s) of {flat.numel()}: the weights "
            "are damaged; download or convert them again"
        )


def load_safetensors(
    model: nn.Module,
    groups: Sequence[ShardGroup],
    tiers: MemoryTiers,
    paths: "Union[Sequence[str | os.PathLike[str]], WeightSource]",
    buffers: Mapping[str, torch.Tensor] = {},
    before_writes: Callable[[], None] = lambda: None,
) -> None:
    """Write the tensors of safetensors files (e.g. a model's shards), or of any WeightSource, into the
    groups' homes, and those stored under the names of the model's persistent `buffers` into them;
    no device copy may exist. ValueError naming every misfit (unknown name, wrong shape, missing);
    `before_writes()` is called once they pass, before the first write (load_weights)."""
    if isinstance(paths, (str, bytes, os.PathLike)):  # iterated, a path gave its characters as the files
        raise TypeError(f"paths={paths!r} must be a list of safetensors files: pass [{paths!r}]")
    source = paths if isinstance(paths, WeightSource) else SafetensorsFiles(paths, buffers.keys())
    stored_buffers = source.read_buffers(buffers) if isinstance(source, SafetensorsFiles) else {}
    load_weights(model, groups, tiers, source, before_writes)
    with torch.no_grad():
        for name, value in stored_buffers.items():
            buffers[name].copy_(value)
