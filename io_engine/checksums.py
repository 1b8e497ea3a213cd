"""Checksums of swap extents: a 64-bit hash per chunk, kept in memory, checked by the worker threads.

    sums = ExtentChecksums(path, file_offset, size_bytes, chunk_bytes, key="a", label="group 'a' exp_avg")
    engine.pwrite(f, buf, file_offset, check=sums)   # each whole chunk's checksum recorded as written
    engine.pread(f, buf, file_offset, check=sums)    # each whole chunk verified; IntegrityError if changed

FileStore makes one per extent (unless IOConfig.verify_checksums is False); the engine calls
`start` on the caller's thread when a request is submitted (a few operations per chunk) and
`finish` in the worker that moved the block (a run of up to IOConfig.blocks_per_call chunks, one
system call: [Note: Blocks per call] in config.py), where the checksum of each of its chunks is
computed with the GIL released, so the cost runs beside the disk, never on the caller's thread.

[Note: Checksums of swap extents]
An extent is cut into chunks of `chunk_bytes` (IOConfig.block_bytes) counted from its first
byte, and a request through a checked extent is split into pieces at those same boundaries
(`origin`), so a piece either is one whole chunk or lies inside one (an engine block moves a run
of consecutive pieces, each checked on its own, below "block" means such a piece). Each chunk has a
checksum, a flag saying whether it is valid, and a generation counted up by every write
that touches it. Whole-extent requests, which the engine makes almost always, are whole chunks
only, so every byte they move is checked. The rules:
- A write invalidates every chunk it touches when it is submitted. A block that is a whole chunk
  records the chunk's checksum when it has been written, unless another write touched the chunk in
  the meantime (its generation moved on). A chunk only partly written keeps no valid checksum.
- A read of a whole chunk with a valid checksum verifies it: a mismatch fails the read's handle with
  IntegrityError (file, byte offset and size of the chunk, the extent's key and label).
- "The first read after a partial write records": a whole-chunk read of a chunk with no valid
  checksum (partly written, never written) records what it read, and every later read of the
  chunk is verified against that. A corruption between the partial write and that first whole
  read goes unseen; none after it does.
- A chunk that a failed write touched is lost: it holds neither the old bytes nor all of the new
  ones (a part may have reached the disk), and any read of it, whole or not, is refused at
  submission with LostWriteError (file, offset and size of the first lost chunk, the extent's key
  and label) until a whole-chunk write of it succeeds. Before, such a read recorded what it found,
  and a training loop that caught the write's error and went on read a mix of old and new state
  without a word: the optimizer's moments of one step, the parameters of another.
- A read of part of a chunk is not checked (the checksum covers the whole chunk only).
So a read is never reported corrupt when the bytes are what was last written; a read or write
of bytes that a write still in flight is changing is the caller's error, as with any IO.

The checksum is XXH3-64 (the `xxhash` package, a declared dependency), else zlib.crc32 where
that package is missing; CHECKSUM_BACKEND says which. Both release the GIL on a chunk. Values never
leave the process, so either serves. Why XXH3: the checksums cost CPU on the same cores that
compute. Measured here (2 cores loaded by other jobs), CPU time per 1 MiB chunk over a 256 MiB
buffer, 5 rounds: the `crc32c` package (hardware CRC-32C) 5.1-5.2 GB/s, xxh3_64 9.3-11.3 GB/s
(zlib.crc32, the fallback, 3.3 GB/s when measured before); on the real path, 4 GiB written and
read back through a FileStore, two interleaved rounds, the process's CPU less that of the same
run unchecked (0.36-0.42 s): crc32c 1.04-1.10 s, xxh3_64 0.65-0.79 s, about 30% less (the chunks
come fresh from the disk, so memory bandwidth bounds both). A 64-bit hash also misses a random
change less often than a 32-bit one. An earlier version used the `crc32c` package.
"""

from __future__ import annotations

import threading
import zlib
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .errors import IntegrityError, LostWriteError
from .transfer import Block


try:
    from xxhash import xxh3_64_intdigest as _xxh3_64
except ImportError:  # the package is a declared dependency; zlib keeps io_engine working without it
    _xxh3_64 = None

CHECKSUM_BACKEND = "xxh3_64" if _xxh3_64 is not None else "zlib.crc32"
"""Which function computes the checksums: "xxh3_64" (the xxhash package) or "zlib.crc32"."""


def checksum(piece: memoryview) -> int:
    """The checksum of `piece`: a 64-bit XXH3, or zlib's crc32 where xxhash is missing."""
    if _xxh3_64 is not None:
        return _xxh3_64(piece)
    return zlib.crc32(piece)


class ExtentChecksums:
    """The checksum of every chunk of one extent (a transfer.BlockCheck). See [Note: Checksums of swap extents]."""

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
        self._sums = np.zeros(num_chunks, dtype=np.uint64)
        self._valid = np.zeros(num_chunks, dtype=np.bool_)
        self._generation = np.zeros(num_chunks, dtype=np.int64)
        self._lost = np.zeros(num_chunks, dtype=np.bool_)
        """Chunks a failed write touched, not written whole since: reads of them are refused."""
        self._num_lost = 0
        """How many of `_lost` are set: 0 (nearly always) lets a read's check skip the scan, whose
        numpy calls (flatnonzero and its dispatchers) were Python calls on every read request."""
        # Orders a submission's invalidation against the workers' recording (checksums are computed
        # outside it).
        self._lock = threading.Lock()

    @property
    def num_chunks(self) -> int:
        return len(self._sums)

    def num_valid(self) -> int:
        """Chunks whose checksum is valid (the next whole read of them is verified)."""
        with self._lock:
            return int(self._valid.sum())

    def _chunk_bytes_of(self, index: int) -> int:
        return min(self.chunk_bytes, self.size_bytes - index * self.chunk_bytes)

    def start(self, is_read: bool, offset: int, pieces: Sequence[Tuple[int, int]]) -> List[Optional[int]]:
        """A block that is one whole chunk gets the chunk's generation as token; any other None."""
        start_in_extent = offset - self.origin
        tokens: List[Optional[int]] = []
        with self._lock:
            if is_read and pieces:
                self._refuse_lost(start_in_extent + pieces[0][0], start_in_extent + pieces[-1][0] + pieces[-1][1])
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
        """Record (write, or read of a chunk with no valid checksum) or verify (read) each whole chunk
        of `block` (a run of pieces: [Note: Blocks per call] in config.py), its tokens in order."""
        file_offset, mem_offset = block.file_offset, block.mem_offset
        end = file_offset + block.size_bytes
        for token in block.check_tokens:
            index = (file_offset - self.origin) // self.chunk_bytes
            piece_end = min(end, self.origin + (index + 1) * self.chunk_bytes)
            if token is not None:
                self._finish_chunk(block, index, token, mem_offset, file_offset, piece_end - file_offset)
            mem_offset += piece_end - file_offset
            file_offset = piece_end

    def _finish_chunk(self, block: Block, index: int, token: int, mem_offset: int, file_offset: int, size: int) -> None:
        """finish for chunk `index`, whole in the block's memory at `mem_offset` (file_offset, size its place)."""
        actual = checksum(block.view[mem_offset : mem_offset + size])
        with self._lock:
            if self._generation[index] != token:
                return  # a write touched the chunk since this block was submitted: nothing to judge
            if not (block.is_read and self._valid[index]):
                self._sums[index] = actual
                self._valid[index] = True
                if not block.is_read and self._lost[index]:
                    self._lost[index] = False  # written whole again
                    self._num_lost -= 1
                return
            expected = int(self._sums[index])
        if actual != expected:
            raise IntegrityError(
                self.path, file_offset, size, self.key, self.label, file_offset - self.origin, expected, actual
            )

    def failed(self, block: Block) -> None:
        """A write `block` failed: every chunk it touched is lost until written whole again."""
        if block.is_read:
            return
        start = block.file_offset - self.origin
        first = start // self.chunk_bytes
        last = -(-(start + block.size_bytes) // self.chunk_bytes)
        with self._lock:
            self._lost[first:last] = True
            self._num_lost = int(self._lost.sum())

    def _refuse_lost(self, start: int, end: int) -> None:
        """LostWriteError if a chunk holding a byte of [start, end) of the extent is lost (under the lock)."""
        if not self._num_lost:
            return
        first, last = start // self.chunk_bytes, -(-end // self.chunk_bytes)
        lost = np.flatnonzero(self._lost[first:last])
        if len(lost):
            index = first + int(lost[0])
            chunk_start = index * self.chunk_bytes
            raise LostWriteError(
                self.path, self.origin + chunk_start, self._chunk_bytes_of(index), self.key, self.label, chunk_start
            )


__all__ = ["CHECKSUM_BACKEND", "ExtentChecksums", "checksum"]
