"""Checksums of swap extents: a crc32 per chunk, kept in memory, checked by the worker threads.

    sums = ExtentChecksums(path, file_offset, size_bytes, chunk_bytes, key="a", label="group 'a' exp_avg")
    engine.pwrite(f, buf, file_offset, check=sums)   # each whole chunk's crc32 recorded as it is written
    engine.pread(f, buf, file_offset, check=sums)    # each whole chunk verified; IntegrityError if changed

FileStore makes one per extent (unless IOConfig.verify_checksums is False); the engine calls
`start` on the caller's thread when a request is submitted (a few operations per block) and
`finish` in the worker that moved the block, where the crc32 of the block's memory is computed
with the GIL released, so the cost runs beside the disk, never on the caller's thread.

[Note: Checksums of swap extents]
An extent is cut into chunks of `chunk_bytes` (IOConfig.block_bytes) counted from its first
byte, and a request through a checked extent is split into engine blocks at those same
boundaries (`origin`), so a block either is one whole chunk or lies inside one. Each chunk has a
crc32, a flag saying whether that crc32 is valid, and a generation counted up by every write
that touches it. Whole-extent requests, which the engine makes almost always, are whole chunks
only, so every byte they move is checked. The rules:
- A write invalidates every chunk it touches when it is submitted. A block that is a whole chunk
  records the chunk's crc32 when it has been written, unless another write touched the chunk in
  the meantime (its generation moved on). A chunk only partly written keeps no valid crc32.
- A read of a whole chunk with a valid crc32 verifies it: a mismatch fails the read's handle with
  IntegrityError (file, byte offset and size of the chunk, the extent's key and label).
- "The first read after a partial write records": a whole-chunk read of a chunk with no valid
  crc32 (partly written, written by a failed request, never written) records what it read, and
  every later read of the chunk is verified against that. A corruption between the partial
  write and that first whole read goes unseen; none after it does.
- A read of part of a chunk is not checked (the crc32 covers the whole chunk only).
So a read is never reported corrupt when the bytes are what was last written; a read or write
of bytes that a write still in flight is changing is the caller's error, as with any IO.

The checksum is CRC-32C, computed by the `crc32c` package (the CPU's crc32 instruction: 8.6 GB/s
per core here, against 3.3 GB/s for zlib.crc32; it releases the GIL above 32 KiB), else by
zlib.crc32 where that package is missing; CRC32_BACKEND says which. The values differ between the
two, and never leave the process, so either serves. Measured while this was built (with a
hardware crc32 then too): the NVMe traffic of one bench_offload step (small preset, all state on
NVMe, 372 MB) costs 0.05 s of CPU more with a hardware crc32, 0.14 s with zlib's; interleaved
bench_offload runs (8 each) moved the ratio by -1% (noise) with the hardware crc, and by about
+10% (4 each) with zlib.
"""

from __future__ import annotations

import threading
import zlib
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .errors import IntegrityError
from .transfer import Block


try:
    from crc32c import crc32c as _crc32c
except ImportError:  # the package is a declared dependency; zlib keeps io_engine working without it
    _crc32c = None

CRC32_BACKEND = "crc32c" if _crc32c is not None else "zlib"
"""Which library computes the checksums: "crc32c" (CRC-32C in hardware) or "zlib" (crc32)."""


def crc32(piece: memoryview, address: int) -> int:
    """The checksum of `piece` (whose first byte is at `address`; kept for callers that pass it)."""
    if _crc32c is not None:
        return _crc32c(piece)
    return zlib.crc32(piece)


class ExtentChecksums:
    """The crc32 of every chunk of one extent (a transfer.BlockCheck). See [Note: Checksums of swap extents]."""

    def __init__(
        self, path: str, file_offset: int, size_bytes: int, chunk_bytes: int, key: str, label: Optional[str] = None
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be at least 1")
        self.path = path
        self.origin = file_offset
        self.size_bytes = size_bytes
        self.chunk_bytes = chunk_bytes
        self.key = key
        self.label = label
        num_chunks = -(-size_bytes // chunk_bytes)
        self._crc32 = np.zeros(num_chunks, dtype=np.uint32)
        self._valid = np.zeros(num_chunks, dtype=np.bool_)
        self._generation = np.zeros(num_chunks, dtype=np.int64)
        # Orders a submission's invalidation against the workers' recording (crc32s are computed
        # outside it).
        self._lock = threading.Lock()

    @property
    def num_chunks(self) -> int:
        return len(self._crc32)

    def num_valid(self) -> int:
        """Chunks whose crc32 is valid (the next whole read of them is verified)."""
        with self._lock:
            return int(self._valid.sum())

    def _chunk_bytes_of(self, index: int) -> int:
        return min(self.chunk_bytes, self.size_bytes - index * self.chunk_bytes)

    def start(self, is_read: bool, offset: int, pieces: Sequence[Tuple[int, int]]) -> List[Optional[int]]:
        """A block that is one whole chunk gets the chunk's generation as token; any other None."""
        start_in_extent = offset - self.origin
        tokens: List[Optional[int]] = []
        with self._lock:
            if not is_read and pieces:
                end_in_extent = start_in_extent + pieces[-1][0] + pieces[-1][1]
                first = start_in_extent // self.chunk_bytes
                last = -(-end_in_extent // self.chunk_bytes)
                self._generation[first:last] += 1
                self._valid[first:last] = False
            for piece_offset, piece_bytes in pieces:
                chunk_start = start_in_extent + piece_offset
                index = chunk_start // self.chunk_bytes
                whole = chunk_start % self.chunk_bytes == 0 and piece_bytes == self._chunk_bytes_of(index)
                tokens.append(int(self._generation[index]) if whole else None)
        return tokens

    def finish(self, block: Block) -> None:
        """Record (write, or read of a chunk with no valid crc32) or verify (read) a whole chunk."""
        token = block.check_token
        if token is None:
            return
        start = block.mem_offset
        actual = crc32(block.view[start : start + block.size_bytes], block.address + start)
        index = (block.file_offset - self.origin) // self.chunk_bytes
        with self._lock:
            if self._generation[index] != token:
                return  # a write touched the chunk since this block was submitted: nothing to judge
            if not (block.is_read and self._valid[index]):
                self._crc32[index] = actual
                self._valid[index] = True
                return
            expected = int(self._crc32[index])
        if actual != expected:
            raise IntegrityError(
                self.path,
                block.file_offset,
                block.size_bytes,
                self.key,
                self.label,
                block.file_offset - self.origin,
                expected,
                actual,
            )


__all__ = ["CRC32_BACKEND", "ExtentChecksums", "crc32"]
