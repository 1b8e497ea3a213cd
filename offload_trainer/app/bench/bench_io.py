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

The code, one concept a file in this folder: bench_io_settings.py (the command line and its
Settings), bench_io_passes.py (the scratch file and the timed passes), bench_io_report.py (the
table and the JSON object); run() here ties them together.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence

from offload_trainer.app.bench.bench_cli import run_cli
from offload_trainer.app.bench.bench_io_passes import PassKind, make_buffer, scratch_file, time_point
from offload_trainer.app.bench.bench_io_report import fmt_rate, report_single, report_sweep
from offload_trainer.app.bench.bench_io_settings import VALUE_FLAGS, Settings, build_parser, settings_from_args
from offload_trainer.config.byte_size import format_bytes


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(argv, build_parser(), VALUE_FLAGS, settings_from_args, run, cleaned_up="the test file was removed",
                   path_flags={"dir": "--dir"})


if __name__ == "__main__":
    sys.exit(main())
