"""The memory available in a container: psutil's figure is the host's, a memory cgroup's limit bounds it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from offload_trainer.planning import cgroup_memory, host_memory
from tests.io_engine.test_cgroups import fake_cgroups, write_files

GiB = 2**30


def test_cgroup_v2_room_is_the_least_over_the_levels_less_the_working_set(tmp_path: Path, monkeypatch) -> None:
    root = fake_cgroups(monkeypatch, tmp_path, "0::/kubepods/pod1/ctr\n")
    write_files(root, cgroup_controllers="memory cpu")  # the root: no memory.max
    write_files(root / "kubepods", memory_max="max", memory_current=str(40 * GiB))
    write_files(root / "kubepods" / "pod1", memory_max=str(8 * GiB), memory_current=str(3 * GiB),
           memory_stat=f"anon {2 * GiB}\ninactive_file {1 * GiB}\n")
    write_files(root / "kubepods" / "pod1" / "ctr", memory_max=str(16 * GiB), memory_current=str(3 * GiB))
    # The pod's 8 GiB less its working set (3 GiB used, 1 GiB of it page cache the kernel reclaims first).
    assert cgroup_memory.cgroup_memory_room_bytes() == 6 * GiB


def test_cgroup_v1_room_and_a_path_that_is_the_hosts(tmp_path: Path, monkeypatch) -> None:
    """Without a cgroup namespace /proc/self/cgroup names the host's path, while the container's cgroup
    is mounted at the root of the hierarchy: the missing levels are skipped, the root is read."""
    root = fake_cgroups(monkeypatch, tmp_path, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    write_files(root / "memory", memory_limit_in_bytes=str(4 * GiB), memory_usage_in_bytes=str(1 * GiB),
           memory_stat=f"cache {GiB}\ntotal_inactive_file {GiB // 2}\n")
    assert cgroup_memory.cgroup_memory_room_bytes() == 4 * GiB - GiB + GiB // 2


@pytest.mark.parametrize("self_cgroup, files", [
    ("0::/user.slice\n", {"memory_max": "max", "memory_current": "5"}),
    ("4:memory:/\n", {"memory_limit_in_bytes": "9223372036854771712", "memory_usage_in_bytes": "5"}),
    ("", {}),
], ids=["v2-max", "v1-unlimited", "no-cgroup"])
def test_no_limit_is_no_room_figure(tmp_path: Path, monkeypatch, self_cgroup: str, files: dict) -> None:
    root = fake_cgroups(monkeypatch, tmp_path, self_cgroup)
    write_files(root, cgroup_controllers="memory")
    write_files(root / "user.slice", **files)
    write_files(root / "memory", **files)
    assert cgroup_memory.cgroup_memory_room_bytes() is None


def test_a_container_limit_bounds_the_memory_an_unset_host_budget_plans_with(monkeypatch) -> None:
    """psutil reads /proc/meminfo, the host's: in a pod limited to 8 GiB on a 512 GiB machine an unset
    tiers.host_budget_bytes planned with 80% of about 500 GiB, and the OOM killer ended the run."""
    monkeypatch.setattr(host_memory.psutil, "virtual_memory", lambda: SimpleNamespace(available=500 * GiB))
    monkeypatch.setattr(host_memory, "cgroup_memory_room_bytes", lambda: 6 * GiB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert host_memory.memory_available_bytes() == 6 * GiB
    assert host_memory.host_memory_for_planning() == int(host_memory.HOST_SHARE * 6 * GiB)
    monkeypatch.setattr(host_memory, "cgroup_memory_room_bytes", lambda: None)
    assert host_memory.memory_available_bytes() == 500 * GiB
