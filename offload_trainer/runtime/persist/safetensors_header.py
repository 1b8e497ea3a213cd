"""A safetensors file's header, checked as the format defines it before any reader opens the file.

    names = check_safetensors_header("/models/llama/model.safetensors")   # its tensors' names, or ValueError naming the file

The format: an 8-byte little-endian length, that many bytes of a JSON object (each name once) of
tensors, each {dtype, shape, data_offsets}, and an optional `__metadata__` of strings to strings;
the tensors' data spans, in order, tile the rest of the file with no gap or overlap. The safetensors
library refuses a file that breaks any of this with a message that names no file ("invalid offset
for tensor `a`"); this check names the file, the tensor and the numbers, and says what to do. It
reads the header only: nothing is loaded. Engine.load_safetensors and the Hugging Face loader
run it on every file before they open one; offload-train and offload-plan run it on a model's
files before anything is built (app/run_checks.py).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from typing import Any, Dict, List, Tuple

from offload_trainer.config import json_text

MAX_HEADER_BYTES = 100_000_000
"""The safetensors format's own limit on the JSON header (safetensors' MAX_HEADER_SIZE)."""
MAX_NUMEL = 2**63 - 1
"""The most elements a tensor may have, each of its nonzero sizes counted (torch's sizes and strides are int64)."""

DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64,
    "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
"""Bits per element of each dtype the safetensors format defines (its `Dtype`), to check that
every tensor's data span holds exactly its shape's elements."""

_FIX = "it must be a safetensors file as save_pretrained or safetensors.torch.save_file writes it"


def _once_each(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(key)
        out[key] = value
    return out


def _is_size(value: Any) -> bool:
    """A JSON integer: not a bool, which Python's json makes an int (true == 1) and the format's own
    reader refuses ("invalid type: boolean, expected usize", naming no file)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_safetensors_header(path: "str | os.PathLike[str]") -> List[str]:
    """The names of the tensors `path` holds, in its header's order; ValueError naming `path`, what is wrong
    and the fix, unless its header is what the format defines."""
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:  # a bare FileNotFoundError said neither what the path was for nor the fix
        raise ValueError(f"{path} does not exist; name a safetensors file that does (a model's *.safetensors)") from None
    if not stat.S_ISREG(mode):  # a directory's open() says "Is a directory"; a FIFO's blocks forever
        raise ValueError(f"{path} is not a regular file; name a safetensors file (a model's *.safetensors)")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is {size} bytes, too short for a safetensors file; {_FIX}")
        (header_bytes,) = struct.unpack("<Q", head)
        if header_bytes > MAX_HEADER_BYTES or header_bytes > size - 8:
            raise ValueError(
                f"{path} is not a safetensors file or is truncated: its header claims {header_bytes} "
                f"bytes, but the file has {size - 8} after the length; {_FIX}"
            )
        try:
            header = json_text.loads(f.read(header_bytes).decode("utf-8"), object_pairs_hook=_once_each)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{path} has a header that is not JSON (corrupted?); {_FIX}") from None
        except ValueError as exc:  # _once_each: a name twice (json.loads would keep the last one)
            raise ValueError(f"{path} is corrupted: its header names {exc.args[0]!r} twice; {_FIX}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a header that is not a JSON object (corrupted?); {_FIX}")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path} is corrupted: its __metadata__ {metadata!r} is not a table of strings; {_FIX}")
    data_bytes = size - 8 - header_bytes
    spans: List[Tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise ValueError(
                f"{path} is truncated or corrupted: tensor {name!r} lies at {offsets!r}, outside its "
                f"{data_bytes} bytes of data; {_FIX}"
            )
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if dtype not in DTYPE_BITS:
            raise ValueError(
                f"{path} is corrupted or of a newer format: tensor {name!r} has dtype {dtype!r}, which is "
                f"none of {', '.join(DTYPE_BITS)}; {_FIX}"
            )
        if not isinstance(shape, list) or not all(_is_size(n) and n >= 0 for n in shape):
            raise ValueError(f"{path} is corrupted: tensor {name!r} has shape {shape!r}; {_FIX}")
        if math.prod(n for n in shape if n) > MAX_NUMEL:  # an empty tensor too: torch and the library refuse its sizes
            raise ValueError(
                f"{path} is corrupted: tensor {name!r} has shape {shape}, whose sizes multiply past any tensor's "
                f"(2**63 - 1 elements); {_FIX}"
            )
        need_bits = math.prod(shape) * DTYPE_BITS[dtype]
        if (need_bits + 7) // 8 != offsets[1] - offsets[0]:
            raise ValueError(
                f"{path} is corrupted: tensor {name!r} ({dtype} {shape}) needs {(need_bits + 7) // 8} "
                f"bytes, but its data_offsets {offsets} hold {offsets[1] - offsets[0]}; {_FIX}"
            )
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for start, stop, name in sorted(spans):
        if start != end:
            what = "overlaps the tensor before it" if start < end else f"leaves bytes [{end}, {start}) to no tensor"
            raise ValueError(f"{path} is corrupted: tensor {name!r} at {[start, stop]} {what}; {_FIX}")
        end = stop
    if end != data_bytes:
        raise ValueError(
            f"{path} is corrupted or has bytes appended: its tensors cover {end} of its {data_bytes} bytes of "
            f"data; {_FIX}"
        )
    return [name for _, _, name in spans]


__all__ = ["DTYPE_BITS", "MAX_HEADER_BYTES", "check_safetensors_header"]
