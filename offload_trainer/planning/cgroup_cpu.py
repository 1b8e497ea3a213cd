"""The CPUs' worth of time this process's control groups allow: a container's CPU limit.

    cpus = cgroup_cpu_limit()    # e.g. 2.0 for `docker run --cpus 2`, or None where no cgroup sets a quota

A Kubernetes pod or `docker run --cpus 2` on a 64-core host keeps every core in the process's affinity
(os.sched_getaffinity says 64) and limits its time instead: a CFS quota of 2 CPUs per period. torch's
default thread count follows the cores, so its 32 or 64 intra-op threads shared 2 CPUs' worth of time,
and each period the kernel stopped them all once the quota was spent; train.num_threads = 64 was
accepted too. So the CPUs a process may use (app/run_checks.py usable_cpus) are also bounded by the
least quota over its cgroup and its ancestors, rounded up.

cgroup v2: cpu.max holds "<quota> <period>" ("max <period>": no limit). cgroup v1: the line of
/proc/self/cgroup whose controllers include `cpu`; cpu.cfs_quota_us (-1: no limit) and
cpu.cfs_period_us under /sys/fs/cgroup/cpu/path. Where the cgroups are and how their levels are
walked is cgroup_memory.py's (the same fakes serve both in the tests).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from offload_trainer.planning import cgroup_memory


def cgroup_cpu_limit() -> Optional[float]:
    """CPUs' worth of time per period this process may use (quota / period, the least over its cgroup and
    its ancestors), or None where none sets a quota or none can be read."""
    limits = [limit for limit in (_limit(d, v2) for d, v2 in _cpu_cgroup_dirs()) if limit is not None]
    return min(limits) if limits else None


def _cpu_cgroup_dirs() -> List["tuple[Path, bool]"]:
    """(directory, is cgroup v2) of each level of this process's CPU cgroup, leaf first."""
    try:
        lines = cgroup_memory.PROC_SELF_CGROUP.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    root = cgroup_memory.CGROUP_ROOT
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "" and (root / "cgroup.controllers").exists():
            return [(d, True) for d in cgroup_memory.levels(root, path)]
        if "cpu" in controllers.split(","):
            return [(d, False) for d in cgroup_memory.levels(root / "cpu", path)]
    return []


def _limit(directory: Path, v2: bool) -> Optional[float]:
    """quota / period of one cgroup; None if it sets no quota or cannot be read."""
    try:
        if v2:
            quota_text, _, period_text = (directory / "cpu.max").read_text(encoding="utf-8").strip().partition(" ")
            if quota_text == "max":
                return None
        else:
            quota_text = (directory / "cpu.cfs_quota_us").read_text(encoding="utf-8").strip()
            period_text = (directory / "cpu.cfs_period_us").read_text(encoding="utf-8").strip()
        quota, period = int(quota_text), int(period_text)
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:  # v1's -1: no limit
        return None
    return quota / period


__all__ = ["cgroup_cpu_limit"]
