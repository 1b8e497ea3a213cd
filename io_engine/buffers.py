"""Aligned host memory for IO: arenas allocated once and handed out as tensor slices.

[Note: Why huge pages]
Direct IO of a 1 MiB request is a single bio only if the kernel can describe the buffer in at
most max_segments (254 on this project's virtio disks) segments, and 1 MiB of 4 KiB pages is 256
of them: whether a request stays whole then depends on how physically contiguous the pages
happen to be. Measured on one 4 GiB file, 1 MiB direct reads, 8 in flight, interleaved: heap
memory (`torch.empty`) 1.1-1.6 GB/s; `MAP_SHARED` anonymous memory 3.3-3.6 GB/s on a freshly
booted machine but 1.0-1.5 GB/s an hour later; private memory with MADV_HUGEPAGE 2.9-3.35 GB/s
every time (a 2 MiB page is one segment). So an arena of 2 MiB or more is private anonymous
memory, 2 MiB-aligned and advised for transparent huge pages; smaller ones (which cannot hold
a request large enough to split) stay `MAP_SHARED`. `scripts/bench_io.py --buffer` compares.

Under CUDA an arena is pinned with cudaHostRegister once, instead of `pin_memory()` per tensor:
the caching host allocator rounds each pinned allocation up to a power of two, which can nearly
double real host use. A registration must end (cudaHostUnregister) before its memory is unmapped:
else the driver keeps the pages pinned and the range registered, and the next mapping at the same
address (the kernel reuses it) fails to register with cudaErrorHostMemoryAlreadyRegistered (712).
close() unpins; a mapping whose arena was never closed (aligned_empty's, whose arena is dropped at
once) unpins itself when the last tensor over it goes (`_Mapping`).

[Note: Discarding idle memory]
An arena is faulted in whole at construction, but some of what it holds is dead for long parts
of a step (offload_trainer: a gradient home between its update and the next backward, staging
buffers from one update pass to the next). `discard(offset, nbytes)` gives the pages wholly
inside a range back to the kernel (MADV_DONTNEED); the range stays mapped and reads as zeros,
and the next write faults fresh pages in (a 2 MiB huge page where the arena has them). Only a
private, unpinned arena can: MADV_DONTNEED does not free MAP_SHARED anonymous memory, and a
pinned (cudaHostRegister'ed) range must keep the pages the GPU maps. Elsewhere it does nothing
and returns False. Cost, measured here on 700 MiB: the madvise 3 ms; writing it all again 63-107
ms against 44-62 ms while resident (the kernel zeroes the pages it faults in).
"""

from __future__ import annotations

import errno
import mmap
from typing import Optional

import torch

PAGE_BYTES = mmap.PAGESIZE
HUGE_PAGE_BYTES = 2 << 20
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels fall back to touching every page.


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def cuda_pinning_available() -> bool:
    """True where host memory can be pinned for asynchronous copies to a GPU."""
    return torch.cuda.is_available()


class _Mapping(mmap.mmap):
    """An anonymous mapping that ends the CUDA registration of the range pinned in it, if still
    pinned, before it is unmapped (the last tensor over it gone): see the module docstring."""

    pinned_ptr = 0
    """The start of the range registered with cudaHostRegister (0: none)."""

    def unpin(self) -> None:
        ptr, self.pinned_ptr = self.pinned_ptr, 0
        if ptr:
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def __del__(self) -> None:
        try:
            self.unpin()
        except Exception:  # noqa: BLE001 - at interpreter exit torch or the CUDA context may be gone first
            pass


def _map(nbytes: int, flags: int) -> _Mapping:
    """An anonymous mapping of `nbytes`; OSError(ENOMEM) naming the size where there is no room for it. mmap's
    own errors named nothing: "Cannot allocate memory" (IOConfig(block_bytes=2**40): a bounce buffer of 1 TiB
    per worker) or OverflowError "Python int too large to convert to C ssize_t" (block_bytes=2**70)."""
    try:
        return _Mapping(-1, nbytes, flags=flags)
    except (OSError, OverflowError) as exc:
        if isinstance(exc, OSError) and exc.errno != errno.ENOMEM:
            raise
        raise OSError(
            errno.ENOMEM,
            f"Cannot allocate memory: a host arena of {nbytes} bytes ({nbytes / 2**30:.2f} GiB) does not fit in this "
            "process's memory or address space",
        ) from None


class HostArena:
    """One page-aligned host allocation (pinned under CUDA), handed out as tensor slices.

    The memory is faulted in at construction, so what the arena holds is resident from the start
    and byte budgets that count arenas count real memory.
    """

    def __init__(
        self, nbytes: int, pin: Optional[bool] = None, populate: bool = True, huge_pages: Optional[bool] = None
    ) -> None:
        """`huge_pages`: back the arena with transparent huge pages (default: when nbytes >= 2 MiB)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"HostArena nbytes={nbytes!r} must be a positive int")
        self.nbytes = round_up(nbytes, PAGE_BYTES)
        if huge_pages is None:
            huge_pages = self.nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE")
        self.huge_pages = huge_pages
        if huge_pages:
            # Over-allocate one huge page so that the arena can start on a 2 MiB boundary.
            self._mmap: Optional[_Mapping] = _map(self.nbytes + HUGE_PAGE_BYTES, mmap.MAP_PRIVATE)
            try:
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # transparent huge pages disabled: ordinary pages, still page-aligned
            whole = torch.frombuffer(self._mmap, dtype=torch.uint8)
            self._start = (-whole.data_ptr()) % HUGE_PAGE_BYTES
            self.tensor = whole[self._start : self._start + self.nbytes]
        else:
            self._mmap = _map(self.nbytes, mmap.MAP_SHARED)
            self._start = 0
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        if populate:
            self._populate()
        self.pinned = False
        if pin is None:
            pin = cuda_pinning_available()
        if pin:
            self._pin()

    def _populate(self) -> None:
        assert self._mmap is not None
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE, self._start, self.nbytes)
        except (OSError, ValueError, AttributeError):
            self.tensor.zero_()

    def _pin(self) -> None:
        if not cuda_pinning_available():
            raise ValueError("HostArena(pin=True) needs CUDA, which is not available; use pin=False or pin=None")
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed with CUDA error {int(err)}")
        assert self._mmap is not None
        self._mmap.pinned_ptr = self.tensor.data_ptr()
        self.pinned = True

    def slice(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over [offset, offset + nbytes) of the arena, with a storage of its own.

        Its own storage (over the same memory) lets owners tell slices apart by storage and count
        the references to one slice (offload_trainer's slots do both).
        """
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"slice [{offset}, {offset + nbytes}) is outside the arena of {self.nbytes} bytes")
        if nbytes == 0:
            return self.tensor[offset:offset]
        assert self._mmap is not None
        return torch.frombuffer(self._mmap, dtype=torch.uint8, count=nbytes, offset=self._start + offset)

    @property
    def can_discard(self) -> bool:
        """Whether discard() gives memory back here: a private, unpinned arena ([Note: Discarding idle memory])."""
        return self.huge_pages and not self.pinned and self._mmap is not None  # huge_pages: MAP_PRIVATE

    def discard(self, offset: int, nbytes: int) -> bool:
        """Give the whole pages inside [offset, offset + nbytes) back to the kernel; they read as zeros
        until written again. The caller guarantees that nothing reads or writes the range meanwhile
        (no IO or copy in flight). Returns False, changing nothing, where the arena cannot
        ([Note: Discarding idle memory])."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside the arena of {self.nbytes} bytes")
        if not self.can_discard:
            return False
        assert self._mmap is not None
        start = round_up(self._start + offset, PAGE_BYTES)
        end = (self._start + offset + nbytes) // PAGE_BYTES * PAGE_BYTES
        if end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)
        return True

    def close(self) -> None:
        """Unpin. The memory itself is freed once no slice of it is referenced any more."""
        if self.pinned:
            assert self._mmap is not None
            self._mmap.unpin()
            self.pinned = False


def aligned_empty(nbytes: int, pin: Optional[bool] = None) -> torch.Tensor:
    """A page-aligned uint8 host tensor of `nbytes` bytes, good for O_DIRECT (pinned under CUDA, and
    unpinned when the last tensor over its memory goes)."""
    return HostArena(max(nbytes, 1), pin=pin).slice(0, nbytes)
