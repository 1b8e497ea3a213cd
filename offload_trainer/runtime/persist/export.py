"""Export consolidated weights as one safetensors file, streamed group by group.

    engine.export_safetensors("runs/my-run/model.safetensors", dtype=torch.bfloat16)

The safetensors format is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the bytes. All shapes are known from the plan, so
the header is written first and each group's parameters are then gathered (all ranks take
part), converted and appended, then the model's persistent buffers (BatchNorm's running
statistics: what model.state_dict() holds besides parameters; rank 0's, as they are on the model): memory holds one group at a time, never the whole model. The
file is written next to the target and renamed into place (io_engine.atomic_file). A parameter shared by several
modules (tied weights) is stored once, under its first name; the header's metadata lists the
other names (`tied`, in the model's names), as transformers expects tied weights to be re-tied on load.

A checkpoint format may store weights under other names or in another layout than the model's
parameters (per-expert tensors for one fused expert parameter, say). `stored_as` maps one group's
parameters to the tensors to write: it is called once per group on meta tensors (shapes only) to
write the header, then again on the gathered values, and must give the same names and shapes both
times; the names of all groups together must be distinct.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from pathlib import Path
from typing import BinaryIO, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from io_engine.atomic_file import atomic_open, make_dirs

from offload_trainer.errors import NonFiniteError
from offload_trainer.runtime.collectives import Collectives
from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.groups.tiers import MemoryTiers
from offload_trainer.runtime.persist.consolidate import group_parameters

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_BUFFER_DTYPES = {
    **_SAFETENSORS_DTYPES, torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
    torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
"""A buffer keeps its own dtype (num_batches_tracked is int64), but a floating one is stored in the export's."""

StoredAs = Callable[[Dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]
"""One group's parameters (model name -> tensor) -> the tensors to store (stored name -> tensor)."""


def export_safetensors(
    path: "str | os.PathLike[str]",
    dtype: torch.dtype,
    model: nn.Module,
    groups: Sequence[ShardGroup],
    tiers: MemoryTiers,
    collectives: Collectives,
    stored_as: Optional[StoredAs] = None,
    buffers: Optional[Mapping[str, torch.Tensor]] = None,
) -> Path:
    """Write every parameter (consolidated across ranks) to `path` in `dtype`, under the names and in
    the layout `stored_as` gives (the model's own when None), then `buffers` (rank 0's, by name; a
    floating one in `dtype`). Collective; rank 0 writes."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"export dtype {dtype} is not supported: use torch.float32, torch.bfloat16 or torch.float16")
    target = Path(path)
    esize = torch.empty((), dtype=dtype).element_size()
    header: Dict[str, object] = {}
    tied: Dict[str, List[str]] = {}
    first_name = {id(p): n for n, p in model.named_parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first_name[id(p)] != name:
            tied.setdefault(first_name[id(p)], []).append(name)
    stored_shapes: List[List[Tuple[str, Tuple[int, ...]]]] = []
    """Per group, the (stored name, shape) of each tensor it writes, in writing order."""
    for group in groups:
        on_meta = {layout.name: torch.empty(layout.shape, dtype=dtype, device="meta") for layout in group.plan.params}
        stored = on_meta if stored_as is None else stored_as(on_meta)
        stored_shapes.append([(name, tuple(t.shape)) for name, t in stored.items()])
    offset = 0
    for shapes in stored_shapes:
        for name, shape in shapes:
            if name in header:
                raise ValueError(f"{target} was not written: two parameters would be stored as {name!r}")
            nbytes = math.prod(shape) * esize
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]
            }
            offset += nbytes
    stored_buffers = {name: _buffer_as(b, dtype) for name, b in (buffers or {}).items()}
    for name, b in stored_buffers.items():
        if name in header:
            raise ValueError(f"{target} was not written: a parameter and a buffer would be stored as {name!r}")
        if b.dtype not in _BUFFER_DTYPES:
            raise ValueError(f"{target} was not written: buffer {name!r} is {b.dtype}, which safetensors cannot store")
        nbytes = b.numel() * b.element_size()
        header[name] = {"dtype": _BUFFER_DTYPES[b.dtype], "shape": list(b.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", "tied": json.dumps(tied)}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data to 8 bytes
    if collectives.rank == 0:
        make_dirs(target.parent)
    with atomic_open(target) if collectives.rank == 0 else _nowhere() as f:
        if f is not None:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
        for group, shapes in zip(groups, stored_shapes):
            values = group_parameters(group, tiers, collectives)
            bad = [layout.name for layout in group.plan.params if not bool(torch.isfinite(values[layout.index]).all())]
            if bad:  # every rank gathered the same values, so every rank stops here
                raise NonFiniteError(
                    f"{target} was not written: parameters {bad[:4]} hold inf or nan; weights are never exported "
                    "from a non-finite state (export from the last good checkpoint)"
                )
            named = {layout.name: values[layout.index].to(dtype) for layout in group.plan.params}
            stored = named if stored_as is None else stored_as(named)
            got = [(name, tuple(t.shape)) for name, t in stored.items()]
            if got != shapes:  # checked on every rank (same values everywhere), so every rank stops here
                raise RuntimeError(
                    f"stored_as gave {got} for the values of group {group.plan.name!r}, {shapes} for its shapes"
                )
            if f is not None:
                for t in stored.values():
                    f.write(memoryview(t.to(dtype).contiguous().view(torch.uint8).reshape(-1).numpy()))
            del named, stored
        if f is not None:
            for b in stored_buffers.values():
                f.write(memoryview(b.contiguous().reshape(-1).view(torch.uint8).numpy()))  # 0-dim: no view as bytes
    collectives.barrier()
    return target


def _buffer_as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A buffer as stored: on the CPU, a floating one in the export's dtype."""
    buf = buf.detach().cpu()
    return buf.to(dtype) if buf.is_floating_point() else buf


@contextlib.contextmanager
def _nowhere() -> Iterator[Optional[BinaryIO]]:
    """What ranks other than 0 write to: nothing (they only take part in the gathers)."""
    yield None
