"""IOEngine: positional reads and writes of tensors and buffers, several requests in flight.

    engine = IOEngine(IOConfig())            # num_threads: one per usable CPU, 2 to 8
    f = engine.open("/nvme/swap.bin", create=True)
    h = f.pwrite(tensor, offset=0)      # returns at once
    ...                                 # compute while the disk works
    h.wait()                            # bytes written, or TransferError
    engine.close()

Each request is split into blocks of IOConfig.block_bytes that a pool of worker threads moves
with os.preadv/os.pwritev, which release the GIL, up to IOConfig.blocks_per_call consecutive blocks
with one call ([Note: Blocks per call] in config.py); so several blocks are in flight at once from
plain Python, and no byte passes through a Python `bytes` object. pread_many/pwrite_many move
several buffers at several offsets of one file as one request (one handle, one wait): small
transfers that belong together pay one request's overhead, not one each. Memory alignment: O_DIRECT
needs the buffer's address, the file offset and the size to be multiples of
IOConfig.alignment_bytes (4096 by default). Buffers from io_engine.buffers always are; any
other buffer works too, through a per-worker bounce buffer at the cost of a memory copy.

[Note: Background requests]
A write that nobody waits for soon (the optimizer's moments, written behind the next forward)
may be submitted with `background=True`. Its blocks queue in a second lane, which a worker takes
from only while the first is empty, so the reads and writes that compute is waiting for (the
next forward's parameters) pass ahead of it instead of queueing behind hundreds of megabytes.
Only the foreground lane is bounded by queue_depth: a background submission never waits (its
submitter, the optimizer's update pass, has the next group to update, and the buffers it hands
over bound the lane anyway), and a burst of background blocks never holds up a foreground
submission. A background request still completes (its handle's wait() returns) once the
foreground lane drains; it is not cancelled or reordered within its lane.

The engine alone decides what a refused O_DIRECT means (IOConfig.direct): IOFile and transfer.py
only report a refusal; the engine records the fallback, warns once per file, raises
DirectIOUnsupportedError under DirectMode.ON, or retires the file's direct descriptor and runs the
block again, buffered.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .buffers import HostArena, round_up
from .config import DirectMode, IOConfig
from .errors import BufferedFallbackWarning, DirectIOUnsupportedError, TransferError
from .file import IOFile
from .handle import IOHandle
from .thread_join import EndingThread, join_through_interrupts
from .tokens import Tokens
from .transfer import Block, BlockCheck, Bounce, DirectIORefused, block_error, cancelled_error, run_block

PathLike = Union[str, "os.PathLike[str]"]


def byte_view(buf: Any, writable: bool) -> Tuple[memoryview, int]:
    """A flat byte memoryview of `buf` (CPU tensor, numpy array or buffer) and its address."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise TypeError(
                f"io_engine moves host memory; got a tensor on {buf.device}. Copy it to a host "
                "buffer (io_engine.aligned_empty or HostArena) first"
            )
        if not buf.is_contiguous():
            raise ValueError("io_engine needs a contiguous tensor; call .contiguous() first")
        arr = buf.detach().reshape(-1).view(torch.uint8).numpy()
        address = buf.data_ptr()  # as arr.ctypes.data, without making a ctypes object per request
    else:
        try:
            mv = memoryview(buf)
        except TypeError:
            raise TypeError(
                f"io_engine needs a CPU tensor or an object with the buffer protocol, got {type(buf).__name__}"
            ) from None
        if not mv.c_contiguous:
            raise ValueError("io_engine needs a C-contiguous buffer")
        arr = np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, dtype=np.uint8)
        address = int(arr.ctypes.data)
    if writable and not arr.flags.writeable:
        raise TypeError("pread needs a writable buffer; got a read-only one")
    return memoryview(arr), address


@dataclass(frozen=True)
class Segment:
    """One part of a request of several buffers (IOEngine.pread_many / pwrite_many)."""

    buf: Any
    """Host memory: a CPU tensor, numpy array or any C-contiguous buffer."""
    offset: int
    """Where in the file the part's bytes are."""
    size: Optional[int] = None
    """Bytes to move (default: all of `buf`)."""
    check: Optional[BlockCheck] = None
    """Per-block work, as for IOEngine.pread (FileStore's checksums of the part's extent)."""


class IOEngine:
    """Worker threads and their bounce buffers; open files with `open()`. Close with `close()`."""

    def __init__(self, config: Optional[IOConfig] = None) -> None:
        self.config = config if config is not None else IOConfig()
        self.num_threads = self.config.worker_threads()
        """The worker threads started: IOConfig.worker_threads() when the engine was made."""
        # Two lanes ([Note: Background requests]): a worker takes a foreground block whenever one
        # is queued, a background block only when none is. `_queued` counts the blocks of both.
        self._queue: "queue.SimpleQueue[Optional[Block]]" = queue.SimpleQueue()
        self._background: "queue.SimpleQueue[Optional[Block]]" = queue.SimpleQueue()
        self._queued = Tokens(0)
        # Bounds the foreground blocks queued or running, so a burst of requests cannot queue
        # without limit. The background lane has no bound: its submitter must not wait for the
        # foreground to drain, and its requests' buffers (the caller's) already bound it.
        self._slots = Tokens(self.config.queue_depth)
        self._closed = False
        self._cancel = False
        self._fallbacks: List[Tuple[str, str]] = []
        self._fallback_lock = threading.Lock()
        bounce_bytes = self.config.block_bytes + 2 * self.config.alignment_bytes
        stride = round_up(bounce_bytes, self.config.alignment_bytes)
        # Staging for unaligned requests: one buffer per worker, allocated once, never pinned.
        self._bounce_arena = HostArena(stride * self.num_threads, pin=False)
        self._threads = []
        for i in range(self.num_threads):
            t = self._bounce_arena.slice(i * stride, bounce_bytes)
            bounce = Bounce(memoryview(t.numpy()), t.data_ptr())
            # The workers hold the engine only while they run a block (whose file holds it anyway):
            # idle, they must not keep an engine nobody closed alive, and themselves with it.
            thread = EndingThread(
                target=IOEngine._worker_loop, args=(weakref.ref(self), self._queued, self._queue, self._background, bounce),
                name=f"io_engine-{i}", daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        # Collected without close(): the workers, idle then (a queued block holds the engine), end.
        self._finalizer = weakref.finalize(
            self, _stop_workers, self.num_threads, self._queued, self._background
        )
        self._finalizer.atexit = False  # at exit the daemon workers just stop

    # -- files ---------------------------------------------------------------------------------

    def open(self, path: PathLike, writable: bool = False, create: bool = False) -> IOFile:
        """Open `path` for IO through this engine (O_DIRECT per IOConfig.direct).

        `create` makes the file if missing, private to its owner (mode 0600), and implies
        `writable`. Raises TransferError naming the path if it cannot be opened.
        """
        self._check_open()
        direct = self.config.direct
        f = IOFile(self, os.fspath(path), writable=writable, create=create, direct=direct)
        if f.fallback_reason is not None:
            if direct is DirectMode.ON:
                reason = f.fallback_reason
                f.close()
                raise DirectIOUnsupportedError(
                    errno.EINVAL,
                    f"O_DIRECT is required (IOConfig.direct='on') but {f.path}: {reason}; "
                    "use direct='auto' to fall back to buffered IO, or a directory on a local disk",
                )
            try:
                # stacklevel 3: the warning names the line that called open(), not this file.
                self._record_fallback(f, f.fallback_reason, stacklevel=3)
            except BaseException:
                f.close()  # the warning was made an error: the caller never gets the file to close
                raise
        return f

    @property
    def buffered_fallback(self) -> bool:
        """True if any file of this engine fell back from O_DIRECT to buffered IO."""
        with self._fallback_lock:
            return bool(self._fallbacks)

    @property
    def fallbacks(self) -> List[Tuple[str, str]]:
        """(path, reason) of each file that fell back to buffered IO."""
        with self._fallback_lock:
            return list(self._fallbacks)

    def _record_fallback(self, file: IOFile, reason: str, stacklevel: int) -> None:
        """Record that `file` uses buffered IO and why, and warn (once per file: callers see to it)."""
        with self._fallback_lock:
            self._fallbacks.append((file.path, reason))
        warnings.warn(
            f"io_engine: {file.path} uses buffered IO through the page cache: {reason}",
            BufferedFallbackWarning,
            stacklevel=stacklevel,
        )

    # -- requests ------------------------------------------------------------------------------

    def pread(
        self, file: IOFile, buf: Any, offset: int = 0, size: Optional[int] = None, *, check: Optional[BlockCheck] = None
    ) -> IOHandle:
        """Start reading `size` bytes (default: all of `buf`) at `offset` into `buf`; returns a handle.

        Reading past the end of the file is an error (ShortTransferError on wait), never a
        silently short result. May block while IOConfig.queue_depth blocks are in flight.
        `check` (FileStore's checksums) splits the request at its boundaries and runs on every
        block in the worker that read it; its error fails the handle.
        """
        return self._submit(file, [Segment(buf, offset, size, check)], is_read=True)

    def pwrite(
        self, file: IOFile, buf: Any, offset: int = 0, size: Optional[int] = None, *, check: Optional[BlockCheck] = None
    ) -> IOHandle:
        """Start writing `size` bytes (default: all of `buf`) of `buf` at `offset`; returns a handle.

        `buf` must not change until the handle is done. `check`: as for pread.
        """
        return self._submit(file, [Segment(buf, offset, size, check)], is_read=False)

    def pread_many(self, file: IOFile, parts: Sequence[Segment]) -> IOHandle:
        """Start reading several buffers, each from its own offset of `file`, as ONE request.

        One handle for all of them (its wait() returns the bytes of every part), so a caller
        that moves a few small buffers together (say one group's optimizer states, extents of one
        swap file) pays one submission and one wait instead of one per buffer; each part is still
        cut into blocks and checked by its own `check` exactly as pread would. Parts must not
        overlap in the file or in memory.
        """
        return self._submit(file, parts, is_read=True)

    def pwrite_many(self, file: IOFile, parts: Sequence[Segment], *, background: bool = False) -> IOHandle:
        """Start writing several buffers, each at its own offset of `file`, as ONE request (see
        pread_many). No part's buffer may change until the handle is done. `background`: its
        blocks move only while no other request's are waiting ([Note: Background requests])."""
        return self._submit(file, parts, is_read=False, background=background)

    def read(self, file: IOFile, buf: Any, offset: int = 0, size: Optional[int] = None) -> int:
        """Blocking read: pread(...).wait()."""
        return self.pread(file, buf, offset, size).wait()

    def write(self, file: IOFile, buf: Any, offset: int = 0, size: Optional[int] = None) -> int:
        """Blocking write: pwrite(...).wait()."""
        return self.pwrite(file, buf, offset, size).wait()

    def _submit(self, file: IOFile, parts: Sequence[Segment], is_read: bool, background: bool = False) -> IOHandle:
        self._check_open()
        if file.engine is not self:
            raise ValueError(f"{file.path} was opened by another IOEngine")
        if not is_read and not file.writable:
            raise ValueError(f"{file.path} was opened read-only; open it with writable=True to write")
        # Every part is checked before any is started: a refused request changes no checksum state.
        checked: List[Tuple[memoryview, int, int, int, Optional[BlockCheck]]] = []
        for part in parts:
            view, address = byte_view(part.buf, writable=is_read)
            offset, size = part.offset, part.size
            if size is None:
                size = len(view)
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ValueError(f"offset={offset!r} must be a non-negative int")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 or size > len(view):
                raise ValueError(f"size={size!r} must be an int in [0, {len(view)}] (the buffer's size in bytes)")
            checked.append((view, address, offset, size, part.check))
        blocks: List[Tuple[memoryview, int, int, int, int, Optional[BlockCheck], Tuple[Optional[int], ...]]] = []
        total = 0
        for view, address, offset, size, check in checked:
            if check is None:
                pieces = self._split(offset, size, offset - offset % self.config.alignment_bytes)
                tokens: List[Optional[int]] = [None] * len(pieces)
            else:
                pieces = self._split(offset, size, check.origin)
                tokens = check.start(is_read, offset, pieces)
            for mem_offset, run_bytes, run_tokens in self._runs(offset, pieces, tokens):
                blocks.append((view, address, mem_offset, offset + mem_offset, run_bytes, check, run_tokens))
            total += size
        first_offset = parts[0].offset if parts else 0
        keep = parts[0].buf if len(parts) == 1 else [part.buf for part in parts]
        handle = IOHandle("read" if is_read else "write", file.path, first_offset, total, len(blocks), keep)
        lane = self._background if background else self._queue
        for view, address, mem_offset, file_offset, run_bytes, check, run_tokens in blocks:
            if not background:
                self._slots.acquire()
            block = Block(
                handle, file, is_read, view, address, mem_offset, file_offset, run_bytes, check, run_tokens, background
            )
            lane.put(block)
            self._queued.release()
        return handle

    def _split(self, offset: int, size: int, origin: int) -> List[Tuple[int, int]]:
        """(offset in the request, bytes) of each block: the request cut at file offsets origin + k * block_bytes.

        `origin` at or below `offset`; an aligned origin (the default: `offset` rounded down to
        the alignment) makes every block after the first start aligned in the file.
        """
        block_bytes = self.config.block_bytes
        pieces = []
        first = min(size, block_bytes - (offset - origin) % block_bytes)
        if first > 0:
            pieces.append((0, first))
        for start in range(first, size, block_bytes):
            pieces.append((start, min(block_bytes, size - start)))
        return pieces

    def _runs(
        self, offset: int, pieces: Sequence[Tuple[int, int]], tokens: Sequence[Optional[int]]
    ) -> List[Tuple[int, int, Tuple[Optional[int], ...]]]:
        """(offset in the request, bytes, the pieces' tokens) of each run of up to blocks_per_call
        consecutive pieces of a request at file offset `offset` that one worker moves with one system
        call ([Note: Blocks per call] in config.py). A first piece at an unaligned file offset is a run
        of its own."""
        per_call = self.config.blocks_per_call
        runs: List[Tuple[int, int, Tuple[Optional[int], ...]]] = []
        start = run_bytes = 0
        run_tokens: List[Optional[int]] = []
        for (mem_offset, piece_bytes), token in zip(pieces, tokens, strict=True):
            if run_tokens and len(run_tokens) == per_call:
                runs.append((start, run_bytes, tuple(run_tokens)))
                run_tokens = []
            if not run_tokens:
                start, run_bytes = mem_offset, 0
            run_tokens.append(token)
            run_bytes += piece_bytes
            if mem_offset == 0 and offset % self.config.alignment_bytes:
                runs.append((start, run_bytes, tuple(run_tokens)))  # an unaligned head moves alone
                run_tokens = []
        if run_tokens:
            runs.append((start, run_bytes, tuple(run_tokens)))
        return runs

    @staticmethod
    def _worker_loop(
        engine_ref: "weakref.ref[IOEngine]",
        queued: Tokens,
        foreground: "queue.SimpleQueue[Optional[Block]]",
        background: "queue.SimpleQueue[Optional[Block]]",
        bounce: Bounce,
    ) -> None:
        while True:
            # One count per block queued, taken by one worker: a lane holds a block for it (or none,
            # for a count close() added: [Note: A submit interrupted before its count]).
            queued.acquire()
            try:
                block = foreground.get_nowait()
            except queue.Empty:
                try:
                    block = background.get_nowait()
                except queue.Empty:
                    continue
            if block is None:
                return
            engine = engine_ref()
            if engine is None:  # cannot be: the block's file holds its engine
                return
            nbytes, error = engine._serve(block, bounce)
            handle = block.handle
            # Drop this worker's view of the caller's memory before the handle can report the
            # request done (a caller may reuse it at once; the slot pool lends a slot again only
            # once nothing else refers to it), and the engine: idle, a worker holds neither.
            del engine, block
            handle._block_finished(nbytes, error)
            del handle

    def _serve(self, block: Block, bounce: Bounce) -> Tuple[int, Optional[TransferError]]:
        """Run one block: the bytes it moved, or its error (the worker reports either to its handle)."""
        nbytes, error = 0, None
        try:
            if self._cancel:
                error = cancelled_error(block)
            else:
                nbytes = self._run_block(block, bounce, self.config.alignment_bytes)
                if block.check is not None:
                    block.check.finish(block)
        except BaseException as exc:  # noqa: B902 - every failure must reach the waiting handle
            error = block_error(block, exc)
        finally:
            if error is not None and block.check is not None:
                block.check.failed(block)  # a failed or cancelled write's chunks hold unknown bytes
            if not block.background:
                self._slots.release()
        return nbytes, error

    def _run_block(self, block: Block, bounce: Bounce, alignment: int) -> int:
        direct = self.config.direct
        try:
            return run_block(block, bounce, alignment, direct)
        except DirectIORefused as refused:
            # Only the first worker refused on this file retires the descriptor and reports it;
            # any other worker refused meanwhile just runs its block again, buffered too.
            if block.file.retire_direct(str(refused)):
                self._record_fallback(block.file, str(refused), stacklevel=2)
        # fd_direct is None now and never set again, so this run cannot be refused a second time.
        return run_block(block, bounce, alignment, direct)

    # -- lifetime ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this IOEngine is closed; make a new one")

    def close(self, cancel: bool = False) -> None:
        """Stop the workers, leaving no thread behind.

        Blocks already queued are finished first, or with `cancel=True` failed with ECANCELED
        (a system call already running completes). Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._cancel = cancel
        self._finalizer()  # behind every block of both lanes, one stop per worker
        # [Note: A close interrupted while a thread runs] (thread_join.py); each poll counts once more
        # for a worker still there ([Note: A submit interrupted before its count]).
        join_through_interrupts(self._threads, _JOIN_POLL_S, self._queued.release)
        self._bounce_arena.close()

    def __enter__(self) -> "IOEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_JOIN_POLL_S = 0.1
"""How long close() waits on a worker before it counts once more for it."""

# [Note: A submit interrupted before its count]
# A submit puts each block into its lane, then counts it (`_queued.release()`), in the caller's
# thread: a KeyboardInterrupt, or any exception a signal handler raises there (offload-train's
# SIGTERM), can land between the two. The block is then queued but uncounted; the workers take
# it with a later count, and close()'s stops fall one short: a worker waited for a count forever
# and close() with it (offload-train hung on its way out after a SIGTERM). So close() counts once
# more for any worker still there after a moment, and a worker that finds both lanes empty for a
# count just waits for the next one. Extra counts are harmless: each worker ends at its own stop.


def _stop_workers(num_threads: int, queued: Tokens, background: "queue.SimpleQueue[Optional[Block]]") -> None:
    """Tell each worker to end once the blocks queued before are done (close(), or the engine collected)."""
    for _ in range(num_threads):
        background.put(None)  # behind every block of both lanes
        queued.release()


__all__ = ["IOEngine", "Segment", "byte_view"]
