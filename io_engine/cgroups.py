"""Which control groups this process is in, and where the files of each level of them are.

    for directory, v2 in controller_dirs("cpu"):    # this process's CPU cgroup first, its root last
        ...

A container's limits (`docker run --cpus 2 --memory 8g`, a Kubernetes pod's) are set on a cgroup,
not on the machine that os.cpu_count(), the affinity and /proc/meminfo describe, and any level
from the process's cgroup up to the root may set one. usable_cpus.py reads the CPU quota, the
planner's cgroup_memory.py the memory limit; both walk the levels this file finds.

cgroup v2: /proc/self/cgroup holds `0::/path`, and the files are under /sys/fs/cgroup/path (the
unified hierarchy is mounted there: it has cgroup.controllers). cgroup v1: the line whose
controllers include the one asked for, its files under /sys/fs/cgroup/<controller>/path (or the
hierarchy's own mount, /sys/fs/cgroup/cpu,cpuacct/path, where no link names the controller). Inside a
container the path printed may be the host's while the container's own cgroup is mounted at the
root: levels whose directory is missing read as no limit, and the root is always read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, List, Tuple

PROC_SELF_CGROUP = Path("/proc/self/cgroup")
"""Which cgroups this process is in (a module constant so that tests can point it at a fake)."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup file systems are mounted (v2 here; v1 per controller below it)."""


def controller_dirs(controller: str) -> List[Tuple[Path, bool]]:
    """(directory, is cgroup v2) of each level of this process's cgroup of `controller` ("cpu",
    "memory"), leaf first; empty where /proc/self/cgroup cannot be read or names no such cgroup."""
    try:
        lines = PROC_SELF_CGROUP.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "" and (CGROUP_ROOT / "cgroup.controllers").exists():
            return [(d, True) for d in levels(CGROUP_ROOT, path)]
        if controller in controllers.split(","):
            # The hierarchy is mounted at its controllers' joint name ("cpu,cpuacct"); "cpu" is a symbolic
            # link to it that most systems add and some do not.
            mount = CGROUP_ROOT / controller
            if not mount.exists():
                mount = CGROUP_ROOT / controllers
            return [(d, False) for d in levels(mount, path)]
    return []


def levels(mount: Path, path: str) -> Iterator[Path]:
    """The directories of `path` under `mount`, from `path` itself up to `mount`."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    for depth in range(len(parts), -1, -1):
        yield mount.joinpath(*parts[:depth])


__all__ = ["CGROUP_ROOT", "PROC_SELF_CGROUP", "controller_dirs", "levels"]
