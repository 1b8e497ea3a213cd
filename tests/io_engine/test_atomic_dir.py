"""io_engine.atomic_dir: a directory replaced as a whole. SIGKILL before each file-system change of
the replacement (with the kernel's exchange and with the rename-aside fallback) leaves the old
complete version or the new complete one at the target (or, in the fallback's one window, none),
never a mix; a re-run, after removing the `*.tmp-*` a killed writer left, gives the new version."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

import io_engine.atomic_dir as atomic_dir_module
from io_engine.atomic_dir import atomic_dir, exchange
from io_engine.atomic_file import TEMP_MARKER
from tests.forked_kill import killed_at

OLD = {"config.json": "old config", "model.safetensors": "old weights", "README.md": "old readme"}
NEW = {"config.json": "new config", "model.safetensors": "new weights", "sub/tokenizer.json": "new tokenizer"}

def _tree(root: Path) -> Optional[Dict[str, str]]:
    if not os.path.lexists(root):
        return None
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _write(into: Path, files: Dict[str, str]) -> None:
    for name, text in files.items():
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        with open(into / name, "w") as f:
            f.write(text)


def _replace_by_new(target: Path, fallback: bool) -> None:
    """Replace `target` by NEW (in a forked child: the fallback is forced there only)."""
    if fallback:
        atomic_dir_module.exchange = lambda a, b: False
    with atomic_dir(target) as into:
        _write(into, NEW)


@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "rename-aside"])
@pytest.mark.parametrize("had_old", [True, False], ids=["replacing", "first"])
def test_a_kill_before_each_change_leaves_the_old_or_the_new_directory(
    tmp_path: Path, fallback: bool, had_old: bool
) -> None:
    if not fallback and not exchange_works(tmp_path):
        pytest.skip("this file system cannot exchange two names in one step")
    trials = 0
    for n in range(1, 200):
        root = tmp_path / f"trial{n}"
        root.mkdir()
        target = root / "hf"
        if had_old:
            target.mkdir()
            _write(target, OLD)
        if not killed_at(n, lambda: _replace_by_new(target, fallback)):
            assert _tree(target) == NEW and os.listdir(root) == ["hf"]
            break
        trials += 1
        seen = _tree(target)
        allowed = [OLD if had_old else None, NEW] + ([None] if fallback else [])
        assert seen in allowed, f"killed before change {n}: {seen}"
        left = [name for name in os.listdir(root) if name != "hf"]
        assert all(TEMP_MARKER in name for name in left), left
        if seen is None and had_old:  # the fallback's window: the old version kept aside, whole
            assert any(_tree(root / name) == OLD for name in left), f"killed before change {n}: old version lost"
        for name in left:  # what the next run does
            atomic_dir_module.remove_path(root / name)
        with atomic_dir(target) as into:  # the re-run
            _write(into, NEW)
        assert _tree(target) == NEW and os.listdir(root) == ["hf"]
    assert trials >= 5, "the sweep never reached the replacement's changes"


def exchange_works(tmp_path: Path) -> bool:
    (tmp_path / "x").mkdir()
    (tmp_path / "y").write_text("y")
    try:
        return exchange(tmp_path / "x", tmp_path / "y") and (tmp_path / "x").read_text() == "y"
    finally:
        atomic_dir_module.remove_path(tmp_path / "x")
        atomic_dir_module.remove_path(tmp_path / "y")


def test_an_error_in_the_block_leaves_the_target_as_it_was(tmp_path: Path) -> None:
    target = tmp_path / "hf"
    target.mkdir()
    _write(target, OLD)
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as into:
            _write(into, NEW)
            raise RuntimeError("the export failed")
    assert _tree(target) == OLD and os.listdir(tmp_path) == ["hf"]


def test_a_failed_rename_into_place_puts_the_old_version_back(tmp_path: Path, monkeypatch) -> None:
    """Without the exchange the old version is renamed aside, then the new one in: where that second
    rename fails, the old version goes back to the target's name, whole."""
    target = tmp_path / "hf"
    target.mkdir()
    _write(target, OLD)
    real_rename = os.rename

    def rename(a, b) -> None:
        if Path(b) == target and TEMP_MARKER in Path(a).name and _tree(Path(a)) == NEW:
            raise OSError(5, "injected", str(b))
        real_rename(a, b)

    monkeypatch.setattr(atomic_dir_module, "exchange", lambda a, b: False)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        with atomic_dir(target) as into:
            _write(into, NEW)
    assert _tree(target) == OLD and os.listdir(tmp_path) == ["hf"]


def test_a_symlink_at_the_target_is_replaced_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    _write(victim, OLD)
    os.symlink(victim, tmp_path / "hf")
    with atomic_dir(tmp_path / "hf") as into:
        _write(into, NEW)
    assert not (tmp_path / "hf").is_symlink() and _tree(tmp_path / "hf") == NEW
    assert _tree(victim) == OLD


@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "rename-aside"])
def test_the_new_version_is_fsynced_before_the_swap_and_the_swap_after(
    tmp_path: Path, monkeypatch, fallback: bool
) -> None:
    """A kill leaves the page cache intact, so the sweep above cannot see a missing fsync; a power
    loss can: swapped in unsynced, the target's name could hold the new files empty or partial.
    Every file and directory of the new version (told by inode: a rename keeps it) is fsynced before
    the swap, and the target's parent after it."""
    if not fallback and not exchange_works(tmp_path):
        pytest.skip("this file system cannot exchange two names in one step")
    target = tmp_path / "hf"
    target.mkdir()
    _write(target, OLD)
    log: List[Tuple[str, Optional[Tuple[int, int]]]] = []
    real_fsync, real_rename, real_exchange = os.fsync, os.rename, atomic_dir_module.exchange

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        log.append(("fsync", (st.st_dev, st.st_ino)))
        real_fsync(fd)

    def rename(a, b) -> None:
        if Path(b) == target:
            log.append(("swap", None))
        real_rename(a, b)

    def exchange_logged(a, b) -> bool:
        if fallback:
            return False
        log.append(("swap", None))
        return real_exchange(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(atomic_dir_module, "exchange", exchange_logged)
    with atomic_dir(target) as into:
        _write(into, NEW)
    assert _tree(target) == NEW
    swap = [event for event, _ in log].index("swap")
    synced_before = {key for event, key in log[:swap] if event == "fsync"}
    new_version = [target, *target.rglob("*")]
    for path in new_version:
        st = os.lstat(path)
        assert (st.st_dev, st.st_ino) in synced_before, f"{path} was not fsynced before the swap"
    parent = os.stat(tmp_path)
    assert ("fsync", (parent.st_dev, parent.st_ino)) in log[swap:], "the swap was not made durable"
