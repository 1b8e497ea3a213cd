"""give_back_freed_heap(): the process heap's free pages back to the OS, where the C library can.

    give_back_freed_heap()      # glibc's malloc_trim(0); False where there is no glibc
    c_library_function("mallopt")   # any C library function, looked up once (None if absent)

Engine calls it at construction too, once the model's own parameter storage is freed, and the
prefetch tuner between its measured runs.

[Note: Freed heap memory in backward]
On the CPU a forward's activations come from the process heap (torch allocates them with the C
library's malloc), and backward frees them block by block while the gradients it computes are
written into their homes. glibc gives freed heap memory back to the OS only from the top of the
heap, so what backward frees stays resident, free, while the gradient homes (given back after
their update under `tiers.release_idle_memory`) are faulted in again: at the end of backward the
process held the forward's activations, freed, and every gradient. `malloc_trim(0)` also gives
back the whole free pages inside the heap (madvise(MADV_DONTNEED) of every free chunk, in every
arena). MemoryTiers.release_freed_heap calls it, with `tiers.release_idle_memory` on the CPU, at
each group's backward acquisition, so that what backward frees leaves the resident set as it
goes and the peak becomes the larger of the two instead of their sum.

Measured on gpt2-124m (`offload-bench --config gpt2-124m --only engine --release-idle-memory`,
params and optimizer states on NVMe, 14 groups): peak RSS 2.06 GB without, 1.53 GB with it
(plain PyTorch's 3.15 GB); mallinfo2 at the end of backward: 664 MiB of free heap resident
without, under 1 MiB with it. Its price is paid in system time: the 15 calls of a step took
0.28-0.30 s (the kernel freeing the pages) and the next forward faults about 290 000 pages in
again (1.1 GB of page faults per step against 0.9 GB; +0.45 s of system time a step).
Where the C library is not glibc (musl, macOS) nothing is given back and nothing fails.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any, Optional


@functools.lru_cache(maxsize=None)
def c_library_function(name: str) -> Optional[Any]:
    """The C library's function `name` (ctypes, looked up once); None where the C library has none
    (malloc_trim and mallopt are glibc's).

    find_library("c") asks /sbin/ldconfig, then gcc or ld, and finds nothing where none is installed
    (distroless images, NixOS) although glibc is there: malloc_trim was then never called. The library
    it names is opened if there is one, else the process's own symbols (dlopen(NULL)), libc's among them."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name)  # CDLL(None): the symbols this process has loaded
    except (OSError, AttributeError):
        return None


def give_back_freed_heap() -> bool:
    """Give the free pages of the process heap back to the OS (ctypes releases the GIL for the
    call). False where the C library cannot (not glibc); else whether any memory was given back."""
    trim = c_library_function("malloc_trim")
    if trim is None:
        return False
    return bool(trim(ctypes.c_size_t(0)))


__all__ = ["c_library_function", "give_back_freed_heap"]
