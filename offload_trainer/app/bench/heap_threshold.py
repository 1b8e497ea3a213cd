"""bench_offload --malloc-mmap-threshold: glibc's mmap threshold fixed for the benchmark's process.

    fix_mmap_threshold(1 << 20)     # every allocation of 1 MiB or more: its own mmap, unmapped at free

[Note: Freed heap memory and peak RSS]
glibc serves an allocation under its mmap threshold from the heap, a larger one with an mmap of
its own that free() returns to the OS. The threshold starts at 128 KiB and rises to the size of
every mmapped block freed, up to 32 MiB, so after the first step most of a step's activations
(1.5 to 6 MB each on the 124M configuration) come from the heap; and freed heap memory goes
back to the OS only at the heap's top, so what lies under a live allocation stays resident,
free, for the rest of the run. Measured on `--config gpt2-124m` (CPU, each side in its own
process, mallinfo2 at the RSS peak): 0.5 GiB of free heap in plain PyTorch's process, 0.65 GiB in
the engine's, both about a third of their non-state memory. mallopt(M_MMAP_THRESHOLD, n) fixes the
threshold (it no longer rises): every tensor of n bytes or more leaves the resident set when
freed, for the price of fresh pages faulted in for it at the next allocation: with 1 MiB, 4 to
6 s more system time over a run of 4 steps of either side here (about 1 s a step against a
4-5 s step), so it is for measuring memory, not for timing. It is a property
of the process and of glibc, not of the engine, so it is off by default and, when given, applies
to whatever this process runs: --compare-plain passes it to both workers. (The same can be had
for any program with the environment variable MALLOC_MMAP_THRESHOLD_=n.)
"""

from __future__ import annotations

import ctypes

from offload_trainer.runtime.groups.freed_heap import c_library_function

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the mmap threshold (glibc's malloc.h)."""
MAX_MMAP_THRESHOLD_BYTES = 32 << 20
"""The ceiling glibc documents for it on 64-bit machines (DEFAULT_MMAP_THRESHOLD_MAX, mallopt(3));
the benchmark refuses more (some builds accept it, but no activation here is that large)."""


def fix_mmap_threshold(nbytes: int) -> bool:
    """mallopt(M_MMAP_THRESHOLD, nbytes) for this process; False where the C library has no mallopt
    (not glibc) or refuses the value."""
    mallopt = c_library_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(nbytes)))
