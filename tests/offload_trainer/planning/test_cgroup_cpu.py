"""A container's CPU limit: a cgroup's CFS quota, which the affinity (every core of the host) does not show."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from offload_trainer.app import run_checks
from offload_trainer.planning import cgroup_cpu
from tests.offload_trainer.planning.test_cgroup_memory import _fake_cgroups, _write


def test_cgroup_v2_limit_is_the_least_quota_over_the_levels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_cgroups(monkeypatch, tmp_path, "0::/kubepods/pod1/ctr\n")
    _write(root, cgroup_controllers="memory cpu")  # the root: no cpu.max
    _write(root / "kubepods", cpu_max="max 100000")
    _write(root / "kubepods" / "pod1", cpu_max="150000 100000")  # the pod: 1.5 CPUs
    _write(root / "kubepods" / "pod1" / "ctr", cpu_max="400000 100000")
    assert cgroup_cpu.cgroup_cpu_limit() == 1.5


def test_cgroup_v1_quota_and_no_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_cgroups(monkeypatch, tmp_path, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    _write(root / "cpu", cpu_cfs_quota_us="200000", cpu_cfs_period_us="100000")  # mounted at the root
    assert cgroup_cpu.cgroup_cpu_limit() == 2.0
    _write(root / "cpu", cpu_cfs_quota_us="-1")
    assert cgroup_cpu.cgroup_cpu_limit() is None


def test_usable_cpus_and_num_threads_follow_a_cpu_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`docker run --cpus 2` on a 64-core host: the affinity holds all 64 cores, so train.num_threads=64
    passed and torch's default ran 64 threads on 2 CPUs' worth of time, throttled every period."""
    root = _fake_cgroups(monkeypatch, tmp_path, "0::/\n")
    _write(root, cgroup_controllers="cpu", cpu_max="150000 100000")
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert run_checks.usable_cpus() == 2  # 1.5 CPUs' worth of time: two threads can use it
    with pytest.raises(ValueError, match=r"^train.num_threads=64 is more than the 2 CPUs .*CPU quota"):
        run_checks.check_num_threads(64)
    run_checks.check_num_threads(2)
    _write(root, cpu_max="max 100000")
    assert run_checks.usable_cpus() == 64
