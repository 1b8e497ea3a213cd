"""One block of a request, moved by one worker with positional system calls.

Every path here releases the GIL during the copy or the system call, completes short transfers
by looping, and turns a failure into a TransferError naming path, offset and size. Where the
request meets O_DIRECT's rules (offset, size and memory address aligned) the block goes straight
between the caller's memory and the disk. Otherwise:
- a read goes through the worker's aligned bounce buffer: a direct read of the aligned window
  around the bytes, then a memmove of the wanted part (the page cache stays out of it);
- a write with an aligned offset but unaligned memory is staged through the bounce buffer;
- what remains (a write at an unaligned offset, a write's unaligned tail) uses the buffered
  descriptor: read-modify-write of a shared disk block by two writers would race.

A direct system call refused with EINVAL under DirectMode.AUTO is not this file's to handle: it
raises DirectIORefused and the engine retires the file's direct descriptor, reports the
fallback and runs the block again, buffered. This file never imports the engine.

A request may carry a BlockCheck (FileStore's checksums, io_engine/checksums.py): the engine cuts
the request at the check's boundaries into pieces, a block moves a run of them with one system call,
and its worker runs the check on the block once it moved.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Protocol, Sequence, Tuple

from .config import DirectMode
from .errors import ShortTransferError, TransferError

if TYPE_CHECKING:
    from .file import IOFile
    from .handle import IOHandle

_memmove = ctypes.memmove  # a ctypes foreign call: the GIL is released during the copy


@dataclass
class Block:
    """A piece of one request: bytes [mem_offset, mem_offset + size_bytes) of the request's memory."""

    handle: "IOHandle"
    file: "IOFile"
    is_read: bool
    view: memoryview
    """The whole request's memory as bytes."""
    address: int
    """Address of view[0]."""
    mem_offset: int
    file_offset: int
    size_bytes: int
    check: "Optional[BlockCheck]" = None
    """The request's per-block work after the move (checksums), run by the worker; None: none."""
    check_tokens: Tuple[Optional[int], ...] = ()
    """What check.start gave each of the request's pieces this block moves ([Note: Blocks per call]
    in config.py: up to IOConfig.blocks_per_call of them), in order; empty without a check."""
    background: bool = False
    """Queued in the background lane (IOEngine's [Note: Background requests])."""


class BlockCheck(Protocol):
    """Work a request asks the engine's workers to do on each of its blocks (see IOEngine.pread)."""

    origin: int
    """File offset that the request's block boundaries are counted from."""

    def start(self, is_read: bool, offset: int, pieces: Sequence[Tuple[int, int]]) -> List[Optional[int]]:
        """On submission, on the caller's thread: a token per block of `pieces` ((offset in the request,
        bytes) each) of the request at file offset `offset`; the block carries it to `finish`."""
        ...

    def finish(self, block: Block) -> None:
        """In the worker, after the block moved (all its pieces): raise a TransferError to fail the request."""
        ...

    def failed(self, block: Block) -> None:
        """In the worker, after the block failed (or was cancelled before it ran)."""
        ...


class DirectIORefused(Exception):
    """A direct system call of a block failed with EINVAL under DirectMode.AUTO: run it buffered.

    Seen on some FUSE and network file systems, which accept O_DIRECT at open but refuse the IO.
    Raised to the engine's worker, never to a caller; the block may have moved some bytes already,
    which moving the whole block again rewrites (or rereads) unchanged.
    """

    def __init__(self, file_offset: int) -> None:
        super().__init__(f"direct IO failed with EINVAL at offset {file_offset}")
        self.file_offset = file_offset
        """Where in the file the refused system call started."""


class Bounce:
    """A worker's aligned staging buffer (allocated once, when the engine starts)."""

    def __init__(self, view: memoryview, address: int) -> None:
        self.view = view
        self.address = address
        self.nbytes = len(view)


def run_block(block: Block, bounce: Bounce, alignment: int, direct: DirectMode) -> int:
    """Move one block completely; return its size or raise TransferError.

    `direct` is the engine's IOConfig.direct: under DirectMode.AUTO a direct system call failing
    with EINVAL raises DirectIORefused instead of a TransferError.
    """
    f = block.file
    done = 0
    while done < block.size_bytes:
        remaining = block.size_bytes - done
        file_pos = block.file_offset + done
        mem_pos = block.mem_offset + done
        fd_direct = f.fd_direct
        try:
            if fd_direct is None:
                n = _buffered(block, mem_pos, file_pos, remaining)
            elif (block.address + mem_pos) % alignment == 0 and file_pos % alignment == 0 and remaining >= alignment:
                n = _direct(block, fd_direct, mem_pos, file_pos, remaining - remaining % alignment)
            elif block.is_read:
                n = _read_via_bounce(block, fd_direct, bounce, alignment, mem_pos, file_pos, remaining)
            elif file_pos % alignment == 0 and remaining >= alignment:
                n = _write_via_bounce(block, fd_direct, bounce, alignment, mem_pos, file_pos, remaining)
            else:
                n = _buffered(block, mem_pos, file_pos, remaining)
        except OSError as exc:
            if fd_direct is not None and exc.errno == errno.EINVAL and direct is DirectMode.AUTO:
                raise DirectIORefused(file_pos) from exc
            raise TransferError(
                "read" if block.is_read else "write", f.path, block.file_offset, block.size_bytes, exc.errno or errno.EIO
            ) from exc
        if n <= 0:
            raise ShortTransferError(
                "read" if block.is_read else "write", f.path, block.file_offset, block.size_bytes, done
            )
        done += n
    return done


def _direct(block: Block, fd: int, mem_pos: int, file_pos: int, size: int) -> int:
    piece = block.view[mem_pos : mem_pos + size]
    if block.is_read:
        return os.preadv(fd, [piece], file_pos)
    return os.pwritev(fd, [piece], file_pos)


def _buffered(block: Block, mem_pos: int, file_pos: int, size: int) -> int:
    piece = block.view[mem_pos : mem_pos + size]
    if block.is_read:
        return os.preadv(block.file.fd_buffered, [piece], file_pos)
    return os.pwritev(block.file.fd_buffered, [piece], file_pos)


def _read_via_bounce(
    block: Block, fd: int, bounce: Bounce, alignment: int, mem_pos: int, file_pos: int, remaining: int
) -> int:
    window_start = file_pos - file_pos % alignment
    skip = file_pos - window_start
    want = min(remaining, bounce.nbytes - skip - alignment)
    window_bytes = -(-(skip + want) // alignment) * alignment
    got = os.preadv(fd, [bounce.view[:window_bytes]], window_start) - skip
    n = min(max(got, 0), want)
    if n > 0:
        _memmove(block.address + mem_pos, bounce.address + skip, n)
    return n


def _write_via_bounce(
    block: Block, fd: int, bounce: Bounce, alignment: int, mem_pos: int, file_pos: int, remaining: int
) -> int:
    n = min(remaining - remaining % alignment, bounce.nbytes - bounce.nbytes % alignment)
    _memmove(bounce.address, block.address + mem_pos, n)
    return os.pwritev(fd, [bounce.view[:n]], file_pos)


def block_error(block: Block, exc: BaseException) -> TransferError:
    """Wrap an unexpected failure of a block (not an OSError) so that the handle reports it."""
    if isinstance(exc, TransferError):
        return exc
    err = TransferError(
        "read" if block.is_read else "write",
        block.file.path,
        block.file_offset,
        block.size_bytes,
        getattr(exc, "errno", None) or errno.EIO,
        f"{type(exc).__name__}: {exc}",
    )
    err.__cause__ = exc
    return err


def cancelled_error(block: Block) -> TransferError:
    return TransferError(
        "read" if block.is_read else "write",
        block.file.path,
        block.file_offset,
        block.size_bytes,
        errno.ECANCELED,
        "cancelled: the engine was closed with cancel=True before this block started",
    )


__all__ = ["Block", "BlockCheck", "Bounce", "DirectIORefused", "run_block", "block_error", "cancelled_error"]
