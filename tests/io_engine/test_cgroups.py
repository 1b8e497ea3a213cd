"""Which cgroups this process is in: the levels of a controller's cgroup, v1 or v2, from fake trees.

fake_cgroups and write_files make those trees for the readers' tests too (usable_cpus.py here,
the planner's cgroup_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from io_engine import cgroups


def fake_cgroups(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, self_cgroup: str) -> Path:
    """/proc/self/cgroup holding `self_cgroup`, and an empty /sys/fs/cgroup (returned), under tmp_path."""
    (tmp_path / "self_cgroup").write_text(self_cgroup)
    root = tmp_path / "sys_fs_cgroup"
    root.mkdir()
    monkeypatch.setattr(cgroups, "PROC_SELF_CGROUP", tmp_path / "self_cgroup")
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", root)
    return root


def write_files(directory: Path, **files: str) -> None:
    """Files of a cgroup directory; a name's first "_" is its ".": memory_max -> memory.max."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)


def test_v2_levels_are_the_cgroup_and_its_ancestors_leaf_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_cgroups(monkeypatch, tmp_path, "0::/kubepods/pod1\n")
    write_files(root, cgroup_controllers="cpu memory")
    assert cgroups.controller_dirs("cpu") == [(root / "kubepods" / "pod1", True), (root / "kubepods", True), (root, True)]
    assert cgroups.controller_dirs("memory") == cgroups.controller_dirs("cpu")


def test_v1_levels_are_under_the_controllers_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_cgroups(monkeypatch, tmp_path, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/x\n1:name=systemd:/\n")
    (root / "cpu").mkdir()  # the usual link to cpu,cpuacct (without it: test_usable_cpus.py)
    (root / "memory").mkdir()
    assert cgroups.controller_dirs("cpu")[0] == (root / "cpu" / "docker" / "abc", False)
    assert cgroups.controller_dirs("memory") == [
        (root / "memory" / "docker" / "x", False), (root / "memory" / "docker", False), (root / "memory", False)
    ]
    assert cgroups.controller_dirs("pids") == []


def test_no_proc_self_cgroup_is_no_levels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cgroups(monkeypatch, tmp_path, "")
    (tmp_path / "self_cgroup").unlink()
    assert cgroups.controller_dirs("cpu") == []
