"""The memory this process's control group still lets it use: what a container's limit leaves.

    room = cgroup_memory_room_bytes()    # bytes, or None where no cgroup limits the memory

psutil reads /proc/meminfo, which describes the whole machine, not the container: a Kubernetes pod
or `docker run --memory 8g` on a 512 GiB host saw about 500 GiB "available". An unset host budget
planned with that (host_memory.py), the run checks let a micro-batch or IO buffers through against
it, and the kernel's OOM killer ended the run with SIGKILL: no line, no cleanup. So the memory
available is also bounded by each memory cgroup from this process's own up to the root: its limit
less its usage, the usage without the inactive file pages (page cache the kernel reclaims before it
kills, as psutil's `available` counts reclaimable memory as free; Kubernetes calls the rest the
working set).

cgroup v2: memory.max ("max": no limit), memory.current and memory.stat's `inactive_file`.
cgroup v1: memory.limit_in_bytes (a huge number: no limit), memory.usage_in_bytes and memory.stat's
`total_inactive_file`. Where each level's files are is io_engine/cgroups.py's (usable_cpus.py, the
CPU quota's reader, walks the same levels).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from io_engine import cgroups

_NO_LIMIT_BYTES = 2**60
"""cgroup v1 spells "no limit" as a page-rounded 2**63 - 1; anything this large is no limit."""


def cgroup_memory_room_bytes() -> Optional[int]:
    """Bytes this process may still take before a memory cgroup of it is full (the least over its
    cgroup and their ancestors), or None where none sets a limit or none can be read."""
    rooms = [room for directory, names in _memory_cgroup_dirs() if (room := _room(directory, *names)) is not None]
    return max(0, min(rooms)) if rooms else None


def _memory_cgroup_dirs() -> List[Tuple[Path, Tuple[str, str, str]]]:
    """(directory, (limit file, usage file, inactive-file key of memory.stat)) of each level, leaf first."""
    v2_names = ("memory.max", "memory.current", "inactive_file")
    v1_names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    return [(d, v2_names if v2 else v1_names) for d, v2 in cgroups.controller_dirs("memory")]


def _room(directory: Path, limit_name: str, usage_name: str, inactive_key: str) -> Optional[int]:
    """Limit less the usage that is not inactive page cache, for one cgroup; None if it has no limit."""
    try:
        raw = (directory / limit_name).read_text(encoding="utf-8").strip()
        if raw == "max" or int(raw) >= _NO_LIMIT_BYTES:
            return None
        limit = int(raw)
        usage = int((directory / usage_name).read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None
    return limit - usage + _stat_value(directory / "memory.stat", inactive_key)


def _stat_value(path: Path, key: str) -> int:
    """The value of `key` in a memory.stat file (0 if it is missing or unreadable)."""
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


__all__ = ["cgroup_memory_room_bytes"]
