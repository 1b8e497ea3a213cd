"""Benchmark of io_engine on one directory's disk: sequential (and random) read and write GB/s.

    python scripts/bench_io.py                        # 4 GiB file in ./.offload-scratch, IOConfig defaults
    python scripts/bench_io.py --json                 # ...and one JSON object on the last stdout line
    python scripts/bench_io.py --sweep --size 1GiB    # grid of block size x threads x queue depth -> IOConfig
    python scripts/bench_io.py --buffer torch         # plain torch.empty memory instead of an mmap arena
    python scripts/bench_io.py --buffer torch-aligned # torch.empty memory sliced to a page boundary
    python scripts/bench_io.py --aiofiles             # also a sequential read through aiofiles, for comparison
    python scripts/bench_io.py --pattern both --size 1GiB --repeat 5

How the IO is issued. The test file is one extent of an io_engine.FileStore: created 0600 in a new
private directory under --dir, preallocated with posix_fallocate after a free-space check, and
removed at exit (also on an exception, Ctrl-C or SIGTERM). An IOEngine configured from the
command line opens it, and the whole file is moved in requests of exactly --block-size bytes
(IOConfig.block_bytes is the same value, so one request is one block of one worker).
--queue-depth requests are kept outstanding: each owns one slice of a single buffer of
queue_depth * block_size bytes, allocated and filled with random bytes once, and a slice is
reused as soon as its request completes. Nothing is allocated per request.

What the numbers mean. GB/s is 10^9 bytes per second; sizes are binary (1 GiB = 2^30 bytes). A
write pass is timed up to the end of its fsync, so a buffered write is not timed at memory speed.
Read data never comes from the page cache: with O_DIRECT it cannot; where the engine fell back to
buffered IO (or --direct off) the file is fsynced and its cached pages dropped with
POSIX_FADV_DONTNEED before every read pass (`page_cache_dropped` in the output). Random passes
move every block of the file exactly once, in a shuffled order. Before the first timed pass the
file is written once untimed, so every timed write overwrites allocated blocks, as a swap file
does during training (the first write of fallocated space also converts unwritten extents, and
ran at about half the speed here). "disk request KiB" is the mean size of the requests the block
device completed during a pass (from /sys/dev/block/MAJ:MIN/stat): below the block size means
the kernel split the engine's requests, above it that it merged neighbours. The counters are
device-wide, so other IO on the same disk lowers them. A sweep picks as best the point with the
least time to write the file and read it back (1/write + 1/read), and also names the fastest
read and the fastest write; one pass per point by default, so on a noisy disk add --repeat 3.

Output. A table on stdout, a progress line per pass on stderr. With --json, also one JSON object
as the last stdout line: read_gbps and write_gbps (best pass; null with --pattern random, which
gives random_read_gbps and random_write_gbps), each with a _median, size_bytes, block_bytes,
queue_depth, threads, direct (O_DIRECT actually used), fallback_reason, page_cache_dropped,
direct_mode, buffer, pattern, dir; aiofiles_read_gbps with --aiofiles; a sweep adds best,
best_read, best_write (each with its "ioconfig" text) and points.

Exit status: 0 done, 1 an IO failure (the TransferError is printed), 2 bad input (one message
naming the value and the fix), 130 Ctrl-C, 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import math
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import psutil
import torch

from offload_trainer.app.bench.bench_cli import UsageError, parse_size, run_cli
from offload_trainer.config.byte_size import GiB, KiB, MiB, format_bytes
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
_DEFAULTS = IOConfig()
DEFAULT_SIZE_BYTES = 4 * GiB
DEFAULT_SWEEP_SIZE_BYTES = 1 * GiB
DEFAULT_REPEAT = 3
DEFAULT_SWEEP_BLOCKS_BYTES = (256 * KiB, 1 * MiB, 4 * MiB)
DEFAULT_SWEEP_THREADS = (4, 8, 16)
SWEEP_DEPTH_MULTIPLIERS = (1, 2, 4)
# The buffer is resident memory: refuse one larger than this share of what the machine has free.
MAX_BUFFER_SHARE_OF_AVAILABLE = 0.5
_SEED = 0x5EED
_EXTENT_KEY = "bench"


class Pattern(enum.Enum):
    """Which access orders are timed."""

    SEQUENTIAL = "sequential"
    """Blocks in file order."""
    RANDOM = "random"
    """Every block once, in a shuffled order."""
    BOTH = "both"
    """Sequential passes, then random passes."""

    @property
    def sequential(self) -> bool:
        return self in (Pattern.SEQUENTIAL, Pattern.BOTH)

    @property
    def random(self) -> bool:
        return self in (Pattern.RANDOM, Pattern.BOTH)


class BufferKind(enum.Enum):
    """Which memory the requests read into and write from."""

    MMAP = "mmap"
    """io_engine.HostArena, what the project uses: a page-aligned anonymous mapping, private and advised
    for transparent huge pages from 2 MiB on (MAP_SHARED below), see [Note: Why huge pages] in
    io_engine/buffers.py."""
    TORCH = "torch"
    """One plain torch.empty tensor (heap memory, 64-byte aligned): the engine stages every block
    through its aligned bounce buffer, so this shows what the extra memcpy costs."""
    TORCH_ALIGNED = "torch-aligned"
    """A torch.empty tensor sliced to start on a page: heap memory that goes straight to O_DIRECT,
    which shows what ordinary memory costs the kernel (see [Note: Why huge pages] in io_engine/buffers.py)."""


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


@dataclass(frozen=True)
class Point:
    """One engine configuration to time."""

    block_bytes: int
    queue_depth: int
    num_threads: int

    def io_config(self, direct: DirectMode) -> IOConfig:
        return IOConfig(
            num_threads=self.num_threads, queue_depth=self.queue_depth, block_bytes=self.block_bytes, direct=direct
        )

    @property
    def buffer_bytes(self) -> int:
        return self.queue_depth * self.block_bytes


@dataclass(frozen=True)
class Settings:
    """Everything the command line asked for, validated."""

    dir: str
    """Where the FileStore makes its private directory (absolute path)."""
    size_bytes: int
    """Bytes of the test file: a multiple of every block size timed."""
    points: Tuple[Point, ...]
    """The engine configurations to time (one unless --sweep)."""
    direct: DirectMode
    buffer: BufferKind
    pattern: Pattern
    num_repeats: int
    sweep: bool
    aiofiles: bool
    emit_json: bool


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


# -- parsing -------------------------------------------------------------------------------------

def parse_list(text: str, flag: str, parse_one: Callable[[str], int]) -> List[int]:
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(f"{flag} {text!r} is empty; give a comma-separated list, for example {flag} 256KiB,1MiB")
    return [parse_one(item.strip()) for item in items]


def parse_count(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a whole number; for example {flag} 8") from None
    if value < 1:
        raise UsageError(f"{flag} {value} must be at least 1; for example {flag} 8")
    return value


def check_block(block_bytes: int, flag: str) -> None:
    alignment = _DEFAULTS.alignment_bytes
    if block_bytes % alignment:
        fixed = max(1, round(block_bytes / alignment)) * alignment
        raise UsageError(
            f"{flag} {block_bytes} bytes is not a multiple of {alignment} bytes (the O_DIRECT alignment); "
            f"use for example {fixed} or 1MiB"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_io.py",
        description="Read and write throughput of io_engine on one directory's disk (see the module docstring).",
    )
    p.add_argument("--dir", default="./.offload-scratch", help="directory on the disk to test (made if missing)")
    p.add_argument("--size", help="bytes of the test file: 512MiB, 4GiB or plain bytes (default 4GiB, sweep 1GiB)")
    default_block = format_bytes(_DEFAULTS.block_bytes)
    p.add_argument("--block-size", help=f"IOConfig.block_bytes and the request size (default {default_block})")
    p.add_argument("--queue-depth", help=f"requests in flight (default max({_DEFAULTS.queue_depth}, threads))")
    p.add_argument("--threads", help=f"IOConfig.num_threads (default {_DEFAULTS.num_threads})")
    p.add_argument("--direct", default="auto", choices=[m.value for m in DirectMode], help="O_DIRECT (default auto)")
    p.add_argument("--buffer", default="mmap", choices=[k.value for k in BufferKind], help="IO memory (default mmap)")
    p.add_argument("--pattern", default="sequential", choices=[k.value for k in Pattern], help="default sequential")
    p.add_argument("--repeat", help=f"passes of each kind; best and median shown (default {DEFAULT_REPEAT}, sweep 1)")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last stdout line")
    p.add_argument("--sweep", action="store_true", help="time a grid of block sizes, threads and queue depths")
    p.add_argument("--sweep-blocks", help="sweep block sizes (default 256KiB,1MiB,4MiB)")
    p.add_argument("--sweep-threads", help="sweep thread counts (default 4,8,16); queue depth is 1x, 2x, 4x threads")
    p.add_argument("--aiofiles", action="store_true", help="also time a sequential read through aiofiles")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate the command line; UsageError with the value and the fix for anything wrong."""
    directory = os.path.abspath(os.path.expanduser(args.dir))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"--dir {args.dir!r} is a file, not a directory; pass a directory (it is made if missing)")
    direct = DirectMode.parse(args.direct)
    if args.sweep:
        for flag, value in (("--block-size", args.block_size), ("--threads", args.threads),
                            ("--queue-depth", args.queue_depth)):
            if value is not None:
                raise UsageError(
                    f"{flag} {value} cannot be combined with --sweep, which chooses it; "
                    "narrow the grid with --sweep-blocks and --sweep-threads instead"
                )
        if Pattern(args.pattern) is not Pattern.SEQUENTIAL:
            raise UsageError(f"--pattern {args.pattern} cannot be combined with --sweep, which times sequential IO; "
                             "drop one of them")
        if args.aiofiles:
            raise UsageError("--aiofiles cannot be combined with --sweep; run it without --sweep")
        blocks = (parse_list(args.sweep_blocks, "--sweep-blocks", lambda s: parse_size(s, "--sweep-blocks"))
                  if args.sweep_blocks else list(DEFAULT_SWEEP_BLOCKS_BYTES))
        threads = (parse_list(args.sweep_threads, "--sweep-threads", lambda s: parse_count(s, "--sweep-threads"))
                   if args.sweep_threads else list(DEFAULT_SWEEP_THREADS))
        for b in blocks:
            check_block(b, "--sweep-blocks")
        points = tuple(
            Point(block_bytes=b, queue_depth=t * m, num_threads=t)
            for b in blocks for t in threads for m in SWEEP_DEPTH_MULTIPLIERS
        )
        default_size, default_repeat = DEFAULT_SWEEP_SIZE_BYTES, 1
    else:
        for flag, value in (("--sweep-blocks", args.sweep_blocks), ("--sweep-threads", args.sweep_threads)):
            if value is not None:
                raise UsageError(f"{flag} only applies with --sweep; add --sweep or drop {flag}")
        block = parse_size(args.block_size, "--block-size") if args.block_size else _DEFAULTS.block_bytes
        check_block(block, "--block-size")
        threads_n = parse_count(args.threads, "--threads") if args.threads else _DEFAULTS.num_threads
        depth = parse_count(args.queue_depth, "--queue-depth") if args.queue_depth else max(
            _DEFAULTS.queue_depth, threads_n)
        if depth < threads_n:
            raise UsageError(
                f"--queue-depth {depth} is below --threads {threads_n}, which would leave workers idle; "
                f"use --queue-depth {threads_n} or more"
            )
        points = (Point(block_bytes=block, queue_depth=depth, num_threads=threads_n),)
        default_size, default_repeat = DEFAULT_SIZE_BYTES, DEFAULT_REPEAT
    size = parse_size(args.size, "--size") if args.size else default_size
    # Round up so that every request is a whole block of every block size timed.
    unit = math.lcm(*(pt.block_bytes for pt in points))
    size = -(-size // unit) * unit
    num_repeats = parse_count(args.repeat, "--repeat") if args.repeat else default_repeat
    buffer_bytes = max(pt.buffer_bytes for pt in points)
    available = psutil.virtual_memory().available
    if buffer_bytes > MAX_BUFFER_SHARE_OF_AVAILABLE * available:
        raise UsageError(
            f"the IO buffer (queue depth x block size = {format_bytes(buffer_bytes)}) is more than "
            f"{MAX_BUFFER_SHARE_OF_AVAILABLE:.0%} of the {format_bytes(available)} of memory available; "
            "lower --queue-depth or --block-size"
        )
    return Settings(
        dir=directory,
        size_bytes=size,
        points=points,
        direct=direct,
        buffer=BufferKind(args.buffer),
        pattern=Pattern(args.pattern),
        num_repeats=num_repeats,
        sweep=args.sweep,
        aiofiles=args.aiofiles,
        emit_json=args.json,
    )


# -- IO ------------------------------------------------------------------------------------------


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
        with open(self.stat_path) as f:
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


# -- reporting -----------------------------------------------------------------------------------


def filesystem_of(path: str) -> str:
    """'ext4 on /dev/vda' for the mount holding `path` (best effort)."""
    real = os.path.realpath(path)
    best = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        if real == mount or real.startswith(mount.rstrip("/") + "/"):
            if best is None or len(mount) > len(best.mountpoint):
                best = part
    return f"{best.fstype} on {best.device}" if best is not None else "unknown"


def rate(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 3)


def fmt_rate(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def io_config_text(point: Point, direct: DirectMode) -> str:
    block = point.block_bytes
    block_text = f"1 << {block.bit_length() - 1}" if block & (block - 1) == 0 else str(block)
    return (
        f'IOConfig(num_threads={point.num_threads}, queue_depth={point.queue_depth}, '
        f'block_bytes={block_text}, direct="{direct.value}")'
    )


def direct_text(result: PointResult) -> str:
    if result.direct_used:
        return "O_DIRECT: used (reads cannot come from the page cache)"
    dropped = " page cache dropped (fsync + POSIX_FADV_DONTNEED) before every read pass" if (
        result.page_cache_dropped) else ""
    return f"O_DIRECT: not used ({result.fallback_reason});{dropped}"


def buffer_text(settings: Settings, buffer: torch.Tensor) -> str:
    alignment = address_alignment_bytes(buffer)
    if settings.buffer is BufferKind.MMAP:
        return f"mmap (io_engine.HostArena, address {format_bytes(alignment)}-aligned)"
    text = f"{settings.buffer.value} (torch.empty heap memory, address {format_bytes(alignment)}-aligned"
    if alignment < _DEFAULTS.alignment_bytes:
        text += ": every block is staged through the engine's aligned bounce buffer with a memcpy"
    else:
        text += ": O_DIRECT straight into it"
    return text + ")"


def common_json(settings: Settings, buffer: torch.Tensor) -> Dict[str, Any]:
    return {
        "size_bytes": settings.size_bytes,
        "direct_mode": settings.direct.value,
        "buffer": settings.buffer.value,
        "buffer_address_alignment_bytes": address_alignment_bytes(buffer),
        "pattern": settings.pattern.value,
        "repeat": settings.num_repeats,
        "dir": settings.dir,
        "filesystem": filesystem_of(settings.dir),
    }


def point_json(result: PointResult, size_bytes: int, with_medians: bool) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "block_bytes": result.point.block_bytes,
        "queue_depth": result.point.queue_depth,
        "threads": result.point.num_threads,
    }
    for kind in PassKind:
        if kind in result.seconds or kind in (PassKind.SEQ_READ, PassKind.SEQ_WRITE):
            out[kind.json_key] = rate(result.best_gbps(kind, size_bytes))
            if with_medians:
                out[kind.json_key.replace("_gbps", "_gbps_median")] = rate(result.median_gbps(kind, size_bytes))
            if kind in result.seconds:
                request_kib = result.median_disk_request_kib(kind)
                out[kind.json_key.replace("_gbps", "_disk_request_kib")] = (
                    None if request_kib is None else round(request_kib, 1)
                )
    out["direct"] = result.direct_used
    out["fallback_reason"] = result.fallback_reason
    out["page_cache_dropped"] = result.page_cache_dropped
    return out


def report_single(settings: Settings, result: PointResult, buffer: torch.Tensor) -> Dict[str, Any]:
    point, size = result.point, settings.size_bytes
    print(f"io_engine benchmark of {settings.dir} ({filesystem_of(settings.dir)})")
    print(
        f"  file {format_bytes(size)}, block {format_bytes(point.block_bytes)}, queue depth {point.queue_depth}, "
        f"{point.num_threads} threads, --direct {settings.direct.value}, pattern {settings.pattern.value}, "
        f"{settings.num_repeats} pass(es) of each kind"
    )
    print(f"  buffer: {buffer_text(settings, buffer)}")
    print(f"  {direct_text(result)}")
    print(f"  {'pass':<20} {'best GB/s':>10} {'median GB/s':>12} {'passes':>7} {'disk request KiB':>17}")
    for kind in PassKind:
        if kind in result.seconds:
            request_kib = result.median_disk_request_kib(kind)
            print(
                f"  {kind.value:<20} {fmt_rate(result.best_gbps(kind, size)):>10} "
                f"{fmt_rate(result.median_gbps(kind, size)):>12} {len(result.seconds[kind]):>7} "
                f"{'-' if request_kib is None else f'{request_kib:.0f}':>17}"
            )
    print(
        f"  (disk request KiB: mean size of what the disk completed, median over passes; "
        f"{format_bytes(point.block_bytes)} requests split by the kernel show less, merged ones more)"
    )
    if PassKind.AIOFILES_READ in result.seconds:
        print(
            f"  (aiofiles: {point.queue_depth} coroutines, each its own file object, seek + readinto through a "
            f"{point.num_threads}-thread executor; buffered IO, page cache dropped first)"
        )
    out = point_json(result, size, with_medians=True)
    out.update(common_json(settings, buffer))
    return out


def combined_s_per_byte(result: PointResult, size_bytes: int) -> float:
    """Seconds per byte to write a byte and read it back: what a swap file pays per byte it holds."""
    write, read = result.best_gbps(PassKind.SEQ_WRITE, size_bytes), result.best_gbps(PassKind.SEQ_READ, size_bytes)
    assert write is not None and read is not None  # every sweep point times both
    return 1 / write + 1 / read


def report_sweep(settings: Settings, results: List[PointResult], buffer: torch.Tensor) -> Dict[str, Any]:
    size = settings.size_bytes
    print(f"io_engine sweep of {settings.dir} ({filesystem_of(settings.dir)})")
    print(
        f"  file {format_bytes(size)} per point, --direct {settings.direct.value}, "
        f"buffer {buffer_text(settings, buffer)}, best of {settings.num_repeats} pass(es)"
    )
    print(f"  {'block':>8} {'threads':>7} {'qd':>4} {'write GB/s':>10} {'read GB/s':>10}  direct")
    for r in results:
        p = r.point
        print(
            f"  {format_bytes(p.block_bytes):>8} {p.num_threads:>7} {p.queue_depth:>4} "
            f"{fmt_rate(r.best_gbps(PassKind.SEQ_WRITE, size)):>10} "
            f"{fmt_rate(r.best_gbps(PassKind.SEQ_READ, size)):>10}  "
            f"{'O_DIRECT' if r.direct_used else 'buffered: ' + str(r.fallback_reason)}"
        )
    best = min(results, key=lambda r: combined_s_per_byte(r, size))
    best_read = max(results, key=lambda r: r.best_gbps(PassKind.SEQ_READ, size) or 0.0)
    best_write = max(results, key=lambda r: r.best_gbps(PassKind.SEQ_WRITE, size) or 0.0)
    print("best for this disk (least time to write the file and read it back):")
    print(
        f"  write {fmt_rate(best.best_gbps(PassKind.SEQ_WRITE, size))} GB/s, "
        f"read {fmt_rate(best.best_gbps(PassKind.SEQ_READ, size))} GB/s with"
    )
    print(f"  {io_config_text(best.point, settings.direct)}")
    for label, r, kind in (("read", best_read, PassKind.SEQ_READ), ("write", best_write, PassKind.SEQ_WRITE)):
        rate_text = fmt_rate(r.best_gbps(kind, size))
        print(f"  fastest {label}: {rate_text} GB/s with {io_config_text(r.point, settings.direct)}")

    def entry(r: PointResult) -> Dict[str, Any]:
        out = point_json(r, size, with_medians=False)
        out["ioconfig"] = io_config_text(r.point, settings.direct)
        return out

    out = point_json(best, size, with_medians=True)
    out.update(common_json(settings, buffer))
    out["best"] = entry(best)
    out["best_read"] = entry(best_read)
    out["best_write"] = entry(best_write)
    out["points"] = [entry(r) for r in results]
    return out


# -- main ----------------------------------------------------------------------------------------


def run(settings: Settings) -> Dict[str, Any]:
    def progress(line: str) -> None:
        print(f"bench_io: {line}", file=sys.stderr, flush=True)

    buffer = make_buffer(settings.buffer, max(p.buffer_bytes for p in settings.points))
    max_block = max(p.block_bytes for p in settings.points)
    with scratch_file(
        settings.dir, settings.size_bytes, max_block, settings.direct, dir_flag="--dir", size_flag="--size",
        what="the test file",
    ) as path:
        progress(f"test file {path} ({format_bytes(settings.size_bytes)}, removed at exit)")
        results = []
        for i, point in enumerate(settings.points):
            result = time_point(settings, point, path, buffer, i == 0, progress)
            results.append(result)
            if settings.sweep:
                progress(
                    f"[{i + 1}/{len(settings.points)}] block {format_bytes(point.block_bytes)}, "
                    f"{point.num_threads} threads, queue depth {point.queue_depth}: "
                    f"write {fmt_rate(result.best_gbps(PassKind.SEQ_WRITE, settings.size_bytes))} GB/s, "
                    f"read {fmt_rate(result.best_gbps(PassKind.SEQ_READ, settings.size_bytes))} GB/s"
                )
    if settings.sweep:
        return report_sweep(settings, results, buffer)
    return report_single(settings, results[0], buffer)


VALUE_FLAGS = ("--size", "--block-size", "--queue-depth", "--threads", "--repeat", "--sweep-blocks", "--sweep-threads")
"""The flags that take a value: a negative one is attached to its flag (bench_cli.attach_negative_values)."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(argv, build_parser(), VALUE_FLAGS, settings_from_args, run, cleaned_up="the test file was removed")


if __name__ == "__main__":
    sys.exit(main())
