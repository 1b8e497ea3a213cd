"""Export consolidated weights as one safetensors file, streamed group by group.

    engine.export_safetensors("runs/my-run/model.safetensors", dtype=torch.bfloat16)

The safetensors format is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the bytes. All shapes are known from the plan, so
the header is written first and each group's parameters are then gathered (all ranks take
part), converted and appended: memory holds one group at a time, never the whole model. The
file is written next to the target and renamed into place. A parameter shared by several
modules (tied weights) is stored once, under its first name; the header's metadata lists the
other names (`tied`), as transformers expects tied weights to be re-tied on load.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List

import torch

if TYPE_CHECKING:
    from offload_trainer.runtime.engine import Engine

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def export_safetensors(engine: "Engine", path: "str | os.PathLike[str]", dtype: torch.dtype = torch.float32) -> Path:
    """Write every parameter (consolidated across ranks) to `path` in `dtype`. Collective; rank 0 writes."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"export dtype {dtype} is not supported: use torch.float32, torch.bfloat16 or torch.float16")
    target = Path(path)
    esize = torch.empty((), dtype=dtype).element_size()
    header: Dict[str, object] = {}
    tied: Dict[str, List[str]] = {}
    first_name = {id(p): n for n, p in engine.model.named_parameters()}
    for name, p in engine.model.named_parameters(remove_duplicate=False):
        if first_name[id(p)] != name:
            tied.setdefault(first_name[id(p)], []).append(name)
    offset = 0
    order = []
    for group in engine.plan.groups:
        for slot in group.params:
            nbytes = slot.numel * esize
            header[slot.name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(slot.shape), "data_offsets": [offset, offset + nbytes]}
            order.append(slot.name)
            offset += nbytes
    header["__metadata__"] = {"format": "pt", "tied": json.dumps(tied)}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data to 8 bytes
    is_writer = engine.collectives.rank == 0
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    if is_writer:
        target.parent.mkdir(parents=True, exist_ok=True)
    f = open(tmp, "wb") if is_writer else None
    try:
        if f is not None:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
        for group in engine.groups:
            values = engine.group_parameters(group)
            if f is not None:
                for slot in group.plan.params:
                    f.write(memoryview(values[slot.index].to(dtype).contiguous().view(torch.uint8).reshape(-1).numpy()))
        if f is not None:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            f = None
            os.replace(tmp, target)
    finally:
        if f is not None:
            f.close()
            tmp.unlink(missing_ok=True)
    engine.collectives.barrier()
    return target
