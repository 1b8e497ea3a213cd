"""The CPUs this process may use: its affinity, within its control groups' CPU quota.

    cpus = usable_cpus()          # e.g. 2 under `docker run --cpus 2` on a 64-core host
    cpus = cgroup_cpu_limit()     # 2.0 there, or None where no cgroup sets a quota

os.cpu_count() is the whole machine: `taskset -c 0`, a batch scheduler's or a container's cpuset
narrow the affinity (os.sched_getaffinity) instead. A Kubernetes pod or `docker run --cpus 2` on a
64-core host keeps every core in the affinity and limits time instead: a CFS quota of 2 CPUs per
period. torch's default thread count follows the cores, so its 32 or 64 intra-op threads shared 2
CPUs' worth of time, and each period the kernel stopped them all once the quota was spent. So the
CPUs usable are the affinity's, no more than the least quota over the process's cgroup and its
ancestors, rounded up. The IO engine's default thread count (IOConfig.num_threads unset), torch's
threads under offload-train and the checks of train.num_threads all follow it.

cgroup v2: cpu.max holds "<quota> <period>" ("max <period>": no limit). cgroup v1: cpu.cfs_quota_us
(-1: no limit) and cpu.cfs_period_us. Where each level's files are is cgroups.py's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

from . import cgroups


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (os.cpu_count() where there is none), and no more
    than its cgroups' CPU quota allows, rounded up (cgroup_cpu_limit). At least 1."""
    if hasattr(os, "sched_getaffinity"):
        cpus = len(os.sched_getaffinity(0)) or 1
    else:
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def cgroup_cpu_limit() -> Optional[float]:
    """CPUs' worth of time per period this process may use (quota / period, the least over its cgroup and
    its ancestors), or None where none sets a quota or none can be read."""
    limits = [limit for limit in (_limit(d, v2) for d, v2 in cgroups.controller_dirs("cpu")) if limit is not None]
    return min(limits) if limits else None


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


__all__ = ["cgroup_cpu_limit", "usable_cpus"]
