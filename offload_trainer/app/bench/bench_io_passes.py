"""bench_io's timed passes: the scratch file, the IO memory, one engine per Point, and what each pass took.

time_point() times every pass of one Point on a file made by scratch_file(); the disk's own
counters (DiskCounters) say how the kernel cut the requests. Used by bench_io.py (run it as
`python3 scripts/bench_io.py`, usage and what the numbers mean in bench_io.py's docstring) and
by bench_offload.py, which times its disk with the same passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from offload_trainer.app.bench.bench_cli import UsageError
from offload_trainer.app.bench.bench_io_settings import BufferKind, Point, Settings
from offload_trainer.config.byte_size import KiB, format_bytes
from io_engine.buffers import PAGE_BYTES
from io_engine import (
    DirectIOUnsupportedError,
    DirectMode,
    FileStore,
    HostArena,
    IOConfig,
    IOEngine,
    IOFile,
    NotEnoughSpaceError,
    ShortTransferError,
    run_pass,
)

GB = 10**9
_SEED = 0x5EED
_EXTENT_KEY = "bench"


class PassKind(enum.Enum):
    """One timed pass over the whole file."""

    SEQ_WRITE = "sequential write"
    SEQ_READ = "sequential read"
    RANDOM_WRITE = "random write"
    RANDOM_READ = "random read"
    AIOFILES_READ = "aiofiles seq read"

    @property
    def is_read(self) -> bool:
        return self in (PassKind.SEQ_READ, PassKind.RANDOM_READ, PassKind.AIOFILES_READ)

    @property
    def json_key(self) -> str:
        return {
            PassKind.SEQ_WRITE: "write_gbps",
            PassKind.SEQ_READ: "read_gbps",
            PassKind.RANDOM_WRITE: "random_write_gbps",
            PassKind.RANDOM_READ: "random_read_gbps",
            PassKind.AIOFILES_READ: "aiofiles_read_gbps",
        }[self]


@dataclass
class PointResult:
    """Timings of every pass of one Point, and how its IO was done."""

    point: Point
    seconds: Dict[PassKind, List[float]] = field(default_factory=dict)
    disk_request_bytes: Dict[PassKind, List[float]] = field(default_factory=dict)
    """Mean size of the requests the disk completed during each pass (after the kernel split or merged them)."""
    direct_used: bool = False
    fallback_reason: Optional[str] = None
    page_cache_dropped: bool = False

    def gbps(self, kind: PassKind, size_bytes: int) -> List[float]:
        return [size_bytes / s / GB for s in self.seconds.get(kind, [])]

    def best_gbps(self, kind: PassKind, size_bytes: int) -> Optional[float]:
        rates = self.gbps(kind, size_bytes)
        return max(rates) if rates else None

    def median_gbps(self, kind: PassKind, size_bytes: int) -> Optional[float]:
        rates = self.gbps(kind, size_bytes)
        return statistics.median(rates) if rates else None

    def median_disk_request_kib(self, kind: PassKind) -> Optional[float]:
        sizes = self.disk_request_bytes.get(kind)
        return statistics.median(sizes) / KiB if sizes else None


def make_buffer(kind: BufferKind, nbytes: int) -> torch.Tensor:
    """The IO memory of every pass, allocated once, faulted in and filled with random bytes.

    Random rather than zero bytes: a virtual disk may turn zero writes into cheap "write zeroes".
    """
    if kind is BufferKind.MMAP:
        buf = HostArena(nbytes).slice(0, nbytes)
    elif kind is BufferKind.TORCH:
        buf = torch.empty(nbytes, dtype=torch.uint8)
    else:
        raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE_BYTES
        buf = raw[start : start + nbytes]
    buf.random_(generator=torch.Generator().manual_seed(_SEED))
    return buf


def address_alignment_bytes(buf: torch.Tensor, cap: int = 1 << 21) -> int:
    """The largest power of two (up to `cap`) that divides the buffer's address."""
    ptr = buf.data_ptr()
    return min(ptr & -ptr, cap) if ptr else cap


class DiskCounters:
    """Requests and sectors the file's block device completed (/sys/dev/block/MAJ:MIN/stat).

    They show how the kernel cut the engine's requests: a 1 MiB read counted as two disk reads was
    split. The counters are device-wide, so other IO on the disk during a pass blurs them.
    """

    def __init__(self, path: str) -> None:
        dev = os.stat(path).st_dev
        stat_path = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
        self.stat_path: Optional[str] = stat_path if os.path.exists(stat_path) else None

    def snapshot(self) -> Optional[Tuple[int, int, int, int]]:
        """(read requests, read sectors, write requests, write sectors), or None without a block device."""
        if self.stat_path is None:
            return None
        with open(self.stat_path, encoding="utf-8") as f:
            fields = f.read().split()
        return int(fields[0]), int(fields[2]), int(fields[4]), int(fields[6])

    @staticmethod
    def mean_request_bytes(
        before: Optional[Tuple[int, int, int, int]], after: Optional[Tuple[int, int, int, int]], is_read: bool
    ) -> Optional[float]:
        if before is None or after is None:
            return None
        i = 0 if is_read else 2
        num_requests = after[i] - before[i]
        return (after[i + 1] - before[i + 1]) * 512 / num_requests if num_requests > 0 else None


def block_offsets(size_bytes: int, block_bytes: int, shuffle_seed: Optional[int]) -> List[int]:
    offsets = list(range(0, size_bytes, block_bytes))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(offsets)
    return offsets


def engine_pass(f: IOFile, slices: Sequence[torch.Tensor], offsets: Sequence[int], is_read: bool) -> float:
    """Move one block at each offset, keeping len(slices) requests in flight; return the seconds taken.

    io_engine.run_pass: slot k of `slices` is reused as soon as the request in it completes (in any
    order), so the queue stays full even when requests finish out of order. A write pass ends
    with fsync, timed.
    """
    seconds = run_pass(f.pread if is_read else f.pwrite, slices, offsets)
    if not is_read:
        fsync_start_s = time.perf_counter()
        f.fsync()
        seconds += time.perf_counter() - fsync_start_s
    return seconds


def aiofiles_pass(
    path: str, slices: Sequence[memoryview], block_bytes: int, size_bytes: int, num_threads: int
) -> float:
    """Read the file in order through aiofiles; return the seconds taken (file opening excluded).

    aiofiles has no positional reads, so each of len(slices) coroutines has its own file object
    and does seek + readinto for blocks k, k + n, k + 2n, ...; every call is a round trip to the
    event loop's thread pool, given `num_threads` workers to match the engine.
    """
    import aiofiles  # only this pass needs it

    num_blocks = size_bytes // block_bytes
    num_readers = min(len(slices), num_blocks)

    async def read_blocks(f: Any, reader: int) -> None:
        view = slices[reader]
        for index in range(reader, num_blocks, num_readers):
            await f.seek(index * block_bytes)
            got = 0
            while got < block_bytes:
                n = await f.readinto(view[got:])
                if not n:
                    raise ShortTransferError("read", path, index * block_bytes, block_bytes, got)
                got += n

    async def run() -> float:
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="aiofiles")
        )
        files = await asyncio.gather(*(aiofiles.open(path, "rb", buffering=0) for _ in range(num_readers)))
        try:
            start_s = time.perf_counter()
            await asyncio.gather(*(read_blocks(f, k) for k, f in enumerate(files)))
            return time.perf_counter() - start_s
        finally:
            await asyncio.gather(*(f.close() for f in files))

    return asyncio.run(run())


@contextlib.contextmanager
def scratch_file(
    directory: str,
    size_bytes: int,
    block_bytes: int,
    direct: DirectMode,
    *,
    dir_flag: str,
    size_flag: str,
    what: str,
) -> Iterator[str]:
    """Path of a new preallocated `size_bytes` file in a FileStore under `directory`, removed on exit.

    A small engine owns the store; whoever times the file opens it with an engine of its own.
    Errors a user can fix are UsageErrors naming `dir_flag` (the directory) or `size_flag` (too
    little space); `what` names the file in them ("the test file").
    """
    owner = IOEngine(IOConfig(num_threads=1, queue_depth=1, block_bytes=block_bytes, direct=direct))
    try:
        try:
            store = FileStore(owner, directory)
        except (ValueError, OSError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UsageError(
                f"{dir_flag} {directory!r} cannot hold {what}: {reason}; pass a writable directory"
            ) from None
        with store:
            try:
                (extent,) = store.allocate({_EXTENT_KEY: size_bytes})
            except NotEnoughSpaceError as exc:
                raise UsageError(f"{exc}; or pass a smaller {size_flag}") from None
            except DirectIOUnsupportedError as exc:  # only with direct=on, which only --direct gives
                raise UsageError(f"--direct on: {exc.strerror or exc}") from None
            yield extent.path
    finally:
        owner.close()


@contextlib.contextmanager
def open_point(point: Point, direct: DirectMode, path: str) -> Iterator[IOFile]:
    """An engine configured for `point` with the test file open; closed (cancelling on error) after."""
    engine = IOEngine(point.io_config(direct))
    try:
        f = engine.open(path, writable=True)
    except BaseException:
        engine.close()
        raise
    finished = False
    try:
        yield f
        finished = True
    finally:
        engine.close(cancel=not finished)
        f.close()


def time_point(
    settings: Settings,
    point: Point,
    path: str,
    buffer: torch.Tensor,
    fill: bool,
    progress: Callable[[str], None],
) -> PointResult:
    """Time every pass of `point` on the file at `path`, settings.num_repeats times.

    `fill` first writes the whole file once, untimed (see the module docstring).
    """
    result = PointResult(point)
    slices = [buffer[k * point.block_bytes : (k + 1) * point.block_bytes] for k in range(point.queue_depth)]
    views = [memoryview(s.numpy()) for s in slices] if settings.aiofiles else []
    kinds: List[PassKind] = []
    if settings.pattern.sequential:
        kinds += [PassKind.SEQ_WRITE, PassKind.SEQ_READ]
    if settings.pattern.random:
        kinds += [PassKind.RANDOM_WRITE, PassKind.RANDOM_READ]
    if settings.aiofiles:
        kinds.append(PassKind.AIOFILES_READ)
    num_passes = len(kinds) * settings.num_repeats
    size = settings.size_bytes
    disk = DiskCounters(path)
    with open_point(point, settings.direct, path) as f:
        if fill:
            progress("writing the file once, untimed, so that timed writes overwrite allocated blocks")
            engine_pass(f, slices, block_offsets(size, point.block_bytes, None), is_read=False)
        done = 0
        for repeat in range(settings.num_repeats):
            for kind in kinds:
                if kind.is_read and (kind is PassKind.AIOFILES_READ or not f.uses_direct_io):
                    f.drop_cached_pages()
                    result.page_cache_dropped |= kind is not PassKind.AIOFILES_READ
                before = disk.snapshot()
                if kind is PassKind.AIOFILES_READ:
                    seconds = aiofiles_pass(path, views, point.block_bytes, size, point.num_threads)
                else:
                    seed = _SEED + repeat if kind in (PassKind.RANDOM_WRITE, PassKind.RANDOM_READ) else None
                    offsets = block_offsets(size, point.block_bytes, seed)
                    seconds = engine_pass(f, slices, offsets, is_read=kind.is_read)
                request_bytes = DiskCounters.mean_request_bytes(before, disk.snapshot(), kind.is_read)
                if kind is PassKind.AIOFILES_READ:
                    f.drop_cached_pages()  # leave nothing cached for the passes after it
                result.seconds.setdefault(kind, []).append(seconds)
                if request_bytes is not None:
                    result.disk_request_bytes.setdefault(kind, []).append(request_bytes)
                done += 1
                if not settings.sweep:
                    progress(
                        f"[{done}/{num_passes}] {kind.value:<18} {format_bytes(size)} in {seconds:6.2f} s = "
                        f"{size / seconds / GB:6.2f} GB/s"
                    )
        result.direct_used = f.uses_direct_io
        result.fallback_reason = None if f.uses_direct_io else (f.fallback_reason or "--direct off")
    return result
