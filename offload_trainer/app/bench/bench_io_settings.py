"""bench_io's command line: its flags, the Settings they validate into, and the Point(s) to time.

Used by bench_io.py (run it as `python3 scripts/bench_io.py`, usage in bench_io.py's docstring)
and by bench_offload.py, which builds a Settings and a Point of its own to time its disk.
Bad input raises UsageError naming the value and the fix.
"""

from __future__ import annotations

import argparse
import enum
import math
from dataclasses import dataclass
from typing import Callable, List, Tuple

from offload_trainer.app.bench.bench_cli import UsageError, parse_directory, parse_size
from offload_trainer.app.run_checks import MAX_IO_THREADS
from offload_trainer.app.user_errors import OneLineParser
from offload_trainer.config.byte_size import BYTE_SIZE_HELP, GiB, KiB, MiB, format_bytes
from offload_trainer.planning.host_memory import memory_available_bytes
from io_engine import DirectMode, IOConfig

IO_DEFAULTS = IOConfig()
"""io_engine's defaults: what the flags fall back to, and the O_DIRECT alignment blocks must keep."""
DEFAULT_SIZE_BYTES = 4 * GiB
DEFAULT_SWEEP_SIZE_BYTES = 1 * GiB
DEFAULT_REPEAT = 3
DEFAULT_SWEEP_BLOCKS_BYTES = (256 * KiB, 1 * MiB, 4 * MiB)
DEFAULT_SWEEP_THREADS = (4, 8, 16)
SWEEP_DEPTH_MULTIPLIERS = (1, 2, 4)
# The buffer is resident memory: refuse one larger than this share of what the machine has free.
MAX_BUFFER_SHARE_OF_AVAILABLE = 0.5


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


# -- parsing -------------------------------------------------------------------------------------

def parse_list(text: str, flag: str, parse_one: Callable[[str], int], example: str) -> List[int]:
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(f"{flag} {text!r} is empty; give a comma-separated list, for example {flag} {example}")
    return [parse_one(item.strip()) for item in items]


def parse_count(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a whole number; for example {flag} 8") from None
    if value < 1:
        raise UsageError(f"{flag} {value} must be at least 1; for example {flag} 8")
    if "threads" in flag and value > MAX_IO_THREADS:
        raise UsageError(
            f"{flag} {value} is more than {MAX_IO_THREADS}, the most io_engine starts; for example {flag} 8"
        )
    return value


def check_block(block_bytes: int, flag: str) -> None:
    alignment = IO_DEFAULTS.alignment_bytes
    if block_bytes % alignment:
        fixed = max(1, round(block_bytes / alignment)) * alignment
        raise UsageError(
            f"{flag} {block_bytes} bytes is not a multiple of {alignment} bytes (the O_DIRECT alignment); "
            f"use for example {fixed} or 1MiB"
        )


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="offload-bench-io",
        description="Read and write throughput of io_engine on one directory's disk (see the module docstring).",
        epilog=f"Sizes (--size, --block-size, --sweep-blocks) are {BYTE_SIZE_HELP}.",
    )
    p.add_argument("--dir", default="./.offload-scratch", help="directory on the disk to test (made if missing)")
    p.add_argument("--size", help="bytes of the test file: 512MiB, 4GiB or plain bytes (default 4GiB, sweep 1GiB)")
    default_block = format_bytes(IO_DEFAULTS.block_bytes)
    p.add_argument("--block-size", help=f"IOConfig.block_bytes and the request size (default {default_block})")
    p.add_argument("--queue-depth", help=f"requests in flight (default max({IO_DEFAULTS.queue_depth}, threads))")
    threads_here = IO_DEFAULTS.worker_threads()
    p.add_argument("--threads", help=f"IOConfig.num_threads (default one per usable CPU, 2 to 8: {threads_here} here)")
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
    directory = parse_directory(args.dir, "--dir")
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
        blocks = (parse_list(args.sweep_blocks, "--sweep-blocks", lambda s: parse_size(s, "--sweep-blocks"),
                             "256KiB,1MiB")
                  if args.sweep_blocks is not None else list(DEFAULT_SWEEP_BLOCKS_BYTES))
        threads = (parse_list(args.sweep_threads, "--sweep-threads", lambda s: parse_count(s, "--sweep-threads"),
                              "4,8")
                   if args.sweep_threads is not None else list(DEFAULT_SWEEP_THREADS))
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
        block = parse_size(args.block_size, "--block-size") if args.block_size is not None else IO_DEFAULTS.block_bytes
        check_block(block, "--block-size")
        threads_n = parse_count(args.threads, "--threads") if args.threads is not None else IO_DEFAULTS.worker_threads()
        depth = parse_count(args.queue_depth, "--queue-depth") if args.queue_depth is not None else max(
            IO_DEFAULTS.queue_depth, threads_n)
        if depth < threads_n:
            raise UsageError(
                f"--queue-depth {depth} is below --threads {threads_n}, which would leave workers idle; "
                f"use --queue-depth {threads_n} or more"
            )
        points = (Point(block_bytes=block, queue_depth=depth, num_threads=threads_n),)
        default_size, default_repeat = DEFAULT_SIZE_BYTES, DEFAULT_REPEAT
    size = parse_size(args.size, "--size") if args.size is not None else default_size
    # Round up so that every request is a whole block of every block size timed. Block sizes that do not divide
    # each other have a least common multiple far above any of them: --size 1MiB under --sweep-blocks
    # 3988KiB,3964KiB,3932KiB became 3.7 TiB without a word (refused only for the disk's room, with the fix
    # "pass a smaller --size"). At most twice the larger of --size and the largest block is a rounding.
    unit = math.lcm(*(pt.block_bytes for pt in points))
    rounded = -(-size // unit) * unit
    if rounded > 2 * max(size, *(pt.block_bytes for pt in points)):
        raise UsageError(
            f"--size {format_bytes(size)} would be rounded up to {format_bytes(rounded)}: the test file is a whole "
            f"number of blocks of every block size timed, and theirs have a least common multiple of "
            f"{format_bytes(unit)}; choose block sizes that divide each other, e.g. --sweep-blocks 1MiB,4MiB,16MiB"
        )
    size = rounded
    num_repeats = parse_count(args.repeat, "--repeat") if args.repeat is not None else default_repeat
    buffer_bytes = max(pt.buffer_bytes for pt in points)
    available = memory_available_bytes()
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


VALUE_FLAGS = ("--size", "--block-size", "--queue-depth", "--threads", "--repeat", "--sweep-blocks", "--sweep-threads")
"""The flags that take a value: a negative one is attached to its flag (bench_cli.attach_negative_values)."""
