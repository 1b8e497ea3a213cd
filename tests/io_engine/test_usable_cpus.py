"""The CPUs a process may use: its affinity within a cgroup's CFS quota (which the affinity, every core
of the host, does not show); and the IO engine's default thread count, which follows them."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from io_engine import IOConfig, IOEngine, usable_cpus
from offload_trainer.app import run_checks
from tests.io_engine.test_cgroups import fake_cgroups, write_files


def test_cgroup_v2_limit_is_the_least_quota_over_the_levels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_cgroups(monkeypatch, tmp_path, "0::/kubepods/pod1/ctr\n")
    write_files(root, cgroup_controllers="memory cpu")  # the root: no cpu.max
    write_files(root / "kubepods", cpu_max="max 100000")
    write_files(root / "kubepods" / "pod1", cpu_max="150000 100000")  # the pod: 1.5 CPUs
    write_files(root / "kubepods" / "pod1" / "ctr", cpu_max="400000 100000")
    assert usable_cpus.cgroup_cpu_limit() == 1.5


def test_cgroup_v1_quota_and_no_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_cgroups(monkeypatch, tmp_path, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    write_files(root / "cpu", cpu_cfs_quota_us="200000", cpu_cfs_period_us="100000")  # mounted at the root
    assert usable_cpus.cgroup_cpu_limit() == 2.0
    write_files(root / "cpu", cpu_cfs_quota_us="-1")
    assert usable_cpus.cgroup_cpu_limit() is None


def test_cgroup_v1_quota_where_no_cpu_link_names_the_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cgroup v1 mounts the cpu and cpuacct controllers together at /sys/fs/cgroup/cpu,cpuacct; the
    /sys/fs/cgroup/cpu link to it is a convention some systems lack, and there no quota was found."""
    root = fake_cgroups(monkeypatch, tmp_path, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    write_files(root / "cpu,cpuacct", cpu_cfs_quota_us="50000", cpu_cfs_period_us="100000")
    assert usable_cpus.cgroup_cpu_limit() == 0.5


def test_usable_cpus_and_num_threads_follow_a_cpu_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`docker run --cpus 2` on a 64-core host: the affinity holds all 64 cores, so train.num_threads=64
    passed and torch's default ran 64 threads on 2 CPUs' worth of time, throttled every period."""
    root = fake_cgroups(monkeypatch, tmp_path, "0::/\n")
    write_files(root, cgroup_controllers="cpu", cpu_max="150000 100000")
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert usable_cpus.usable_cpus() == 2  # 1.5 CPUs' worth of time: two threads can use it
    with pytest.raises(ValueError, match=r"^train.num_threads=64 is more than the 2 CPUs .*CPU quota"):
        run_checks.check_num_threads(64)
    run_checks.check_num_threads(2)
    write_files(root, cpu_max="max 100000")
    assert usable_cpus.usable_cpus() == 64


def _io_workers() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("io_engine-"))


@pytest.mark.parametrize("cpus, quota, threads", [
    (1, None, 2),          # one CPU: two workers, so the disk has a next block while one checksums
    (4, None, 4),
    (64, None, 8),         # a large host: bounded, the rest are torch's
    (64, "300000 100000", 3),  # `docker run --cpus 3` on it: the quota, not the 64 cores of the affinity
], ids=["1cpu", "4cpus", "64cpus", "64cpus-quota3"])
def test_an_unset_num_threads_follows_the_usable_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int, quota: "str | None", threads: int
) -> None:
    """IOEngine started 8 workers on any machine: on one CPU, or a 64-core host whose cgroup allows 3,
    they competed with the training thread for it ([Note: How many IO threads] in io_engine/config.py)."""
    root = fake_cgroups(monkeypatch, tmp_path, "0::/\n")
    write_files(root, cgroup_controllers="cpu", cpu_max=quota or "max 100000")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert IOConfig().worker_threads() == threads
    before = _io_workers()
    with IOEngine(IOConfig()) as engine:
        assert engine.num_threads == threads and _io_workers() - before == threads
    # A number set in the config is used as it is; an unset one never exceeds the queue depth.
    assert IOConfig(num_threads=5).worker_threads() == 5
    assert IOConfig(queue_depth=1).worker_threads() == 1
    assert run_checks.io_buffer_bytes(IOConfig()) == threads * run_checks.io_buffer_bytes(IOConfig(num_threads=1))


@pytest.mark.parametrize("value", [0, -1])
def test_a_num_threads_set_must_be_positive(value: int) -> None:
    with pytest.raises(ValueError, match=f"IOConfig.num_threads={value} must be at least 1"):
        IOConfig(num_threads=value)
    with pytest.raises(TypeError, match=r"IOConfig.num_threads='8' must be an int \(or None: one per usable CPU\)"):
        IOConfig(num_threads="8")  # type: ignore[arg-type]
