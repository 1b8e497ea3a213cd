"""IOConfig: how the IO engine moves bytes (threads, requests in flight, block size, O_DIRECT, checksums)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .usable_cpus import usable_cpus


class DirectMode(enum.Enum):
    """Whether files are opened with O_DIRECT (bypassing the page cache)."""

    ON = "on"
    """Always O_DIRECT; a file system that refuses it is an error."""
    OFF = "off"
    """Never O_DIRECT: all IO goes through the page cache."""
    AUTO = "auto"
    """O_DIRECT where the file system allows it, else a reported buffered fallback."""

    @classmethod
    def parse(cls, value: "DirectMode | str | bool") -> "DirectMode":
        if isinstance(value, DirectMode):
            return value
        if isinstance(value, bool):
            return cls.ON if value else cls.OFF
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"IOConfig.direct={value!r} is not valid: use one of {allowed} (or True/False)")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class IOConfig:
    """Settings of an IOEngine. Every field is validated when the config is made."""

    num_threads: int | None = None
    """Worker threads issuing preadv/pwritev; each has one system call in flight at a time. None: one per
    CPU this process may use, at least MIN_DEFAULT_THREADS and at most MAX_DEFAULT_THREADS and queue_depth
    (worker_threads(); [Note: How many IO threads])."""

    queue_depth: int = 32
    """Blocks submitted but not yet finished (a run of blocks moved with one system call counts once:
    blocks_per_call); pread/pwrite block the caller beyond this (backpressure).
    Background writes (IOEngine's [Note: Background requests]) are not counted and never block."""

    block_bytes: int = 1 << 20
    """Requests are split into blocks of this size, spread across the workers. A multiple of alignment_bytes.
    Also the chunk a swap extent's checksums cover (checksums.py)."""

    blocks_per_call: int = 4
    """A worker moves up to this many consecutive blocks of one request (one part of a request of
    several) with one system call, each block still checked on its own: [Note: Blocks per call]."""

    alignment_bytes: int = 4096
    """O_DIRECT alignment of file offsets, sizes and memory addresses: a power of two, at least 512."""

    direct: DirectMode = DirectMode.AUTO
    """O_DIRECT on, off, or auto (on where the file system allows it, with a reported fallback)."""

    verify_checksums: bool = True
    """FileStore keeps a checksum of every chunk written to a swap file and checks it on every read
    (IntegrityError on a mismatch), computed in the worker threads; False moves bytes unchecked.
    See [Note: Checksums of swap extents] in checksums.py."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "direct", DirectMode.parse(self.direct))
        if not isinstance(self.verify_checksums, bool):
            raise TypeError(f"IOConfig.verify_checksums={self.verify_checksums!r} must be True or False")
        for name in ("num_threads", "queue_depth", "block_bytes", "blocks_per_call", "alignment_bytes"):
            value = getattr(self, name)
            if name == "num_threads" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                unset = " (or None: one per usable CPU)" if name == "num_threads" else ""
                raise TypeError(f"IOConfig.{name}={value!r} must be an int{unset}")
            if value < 1:
                raise ValueError(f"IOConfig.{name}={value} must be at least 1")
        if not _is_power_of_two(self.alignment_bytes) or self.alignment_bytes < 512:
            raise ValueError(
                f"IOConfig.alignment_bytes={self.alignment_bytes} must be a power of two >= 512 "
                "(the logical block size of the disk, usually 512 or 4096)"
            )
        if self.block_bytes % self.alignment_bytes:
            raise ValueError(
                f"IOConfig.block_bytes={self.block_bytes} must be a multiple of alignment_bytes="
                f"{self.alignment_bytes}; for example {max(1, self.block_bytes // self.alignment_bytes) * self.alignment_bytes}"
            )
        if self.num_threads is not None and self.queue_depth < self.num_threads:
            raise ValueError(
                f"IOConfig.queue_depth={self.queue_depth} is below num_threads={self.num_threads}, "
                f"which would leave workers idle; set queue_depth >= {self.num_threads}"
            )

    def worker_threads(self) -> int:
        """The worker threads an IOEngine of this config starts: num_threads, or where it is None, one per
        CPU this process may use (usable_cpus.py: its affinity within its cgroups' CPU quota), at least
        MIN_DEFAULT_THREADS and at most MAX_DEFAULT_THREADS and queue_depth."""
        if self.num_threads is not None:
            return self.num_threads
        return min(self.queue_depth, MAX_DEFAULT_THREADS, max(MIN_DEFAULT_THREADS, usable_cpus()))


MIN_DEFAULT_THREADS = 2
"""The fewest workers an unset IOConfig.num_threads starts: [Note: How many IO threads]."""
MAX_DEFAULT_THREADS = 8
"""The most workers an unset IOConfig.num_threads starts: [Note: How many IO threads]."""

# [Note: Blocks per call]
# A direct read or write costs the kernel (and, here, the virtual machine under it) a fixed part per
# system call besides its part per page. Measured on this project's 2-core machine, a loop of direct
# os.preadv / os.pwritev over a 2 GiB file from one 16 MiB buffer, the thread's system time per GiB
# moved (two rounds) for calls of 256 KiB, 1, 2, 4 and 8 MiB: reads 160-235, 82-84, 56-59, 43-46,
# 48-66 ms; writes 127-206, 72-73, 44-49, 35-43, 33-48 ms. So a worker moves a run of up to
# blocks_per_call consecutive blocks of one request part with one call, while the blocks stay the
# chunks the checksums cover (1 MiB: a read of part of an extent is checked by whole chunks, and the
# planner cuts its updates at them; each chunk of a run is hashed and judged on its own, an
# IntegrityError names the chunk, not the run). The first block of a request at an unaligned file
# offset is a run of its own (a write's unaligned head goes through the buffered descriptor, which
# must not take the direct blocks behind it). queue_depth counts runs.

# [Note: How many IO threads]
# A worker spends most of a block waiting in preadv/pwritev, but not all of it: the checksums of
# the block (io.verify_checksums, XXH3 over every byte), the bounce buffer's memmove of an unaligned
# part, and with buffered IO (a file system that refuses O_DIRECT) the kernel's copy through the
# page cache are CPU work, all of it with the GIL released. Eight workers were started whatever the
# machine: on one CPU (or a container's quota of one) they competed with the training thread and
# the update thread for it, and on a 64-core host limited to 2 CPUs by its cgroup they were throttled
# with torch's threads every period. So an unset num_threads starts one worker per CPU this process
# may use: at least two, so that the disk has the next block while one worker checksums the last
# (a worker's CPU time is per byte moved, not per thread), and at most eight, the number started
# before whatever the machine (bench_io.py --sweep measures where a disk stops gaining); a larger
# machine's many CPUs are torch's. A number set in the config is used as it is.
