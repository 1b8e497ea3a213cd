"""Swap directories: locked by their live owner, reclaimed by the next store once the owner is dead.

Other processes are real child processes (a store that is SIGKILLed, a store still running), so
the locks are the kernel's own; nothing here waits on a clock except the children starting.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator, List

import pytest

import io_engine.file_store
import io_engine.swap_dirs
from io_engine import FileStore, SwapReclaimWarning
from io_engine.swap_dirs import LOCK_NAME, UNLOCKED_GRACE_S, make_swap_dir, remove_swap_dir

from tests.forked_kill import killed_at

REPO = Path(__file__).resolve().parents[2]

# A child that makes a store under argv[1], fills two swap files, prints its directory and waits.
CHILD = textwrap.dedent(
    """
    import sys, time
    from io_engine import FileStore, IOConfig, IOEngine
    engine = IOEngine(IOConfig(num_threads=2, queue_depth=8, block_bytes=8192))
    store = FileStore(engine, sys.argv[1])
    store.allocate({"a": 100_000, "b": 4097})
    store.allocate({"c": 1 << 20})
    store.write("a", b"x" * 100_000)
    print(store.root, flush=True)
    time.sleep(120)
    """
)


class Child:
    """A process holding a live FileStore under `parent`."""

    def __init__(self, parent: Path) -> None:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(parent)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        assert line, f"the child exited ({self.process.wait()}) before making its store"
        self.root = Path(line)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait() == -signal.SIGKILL


@pytest.fixture
def children(tmp_path: Path) -> Iterator[List[Child]]:
    made: List[Child] = []
    yield made
    for child in made:
        if child.process.poll() is None:
            child.kill()
        assert child.process.stdout is not None
        child.process.stdout.close()


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def file_bytes(directory: Path) -> int:
    return sum(p.lstat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def old_format_dir(parent: Path, pid: int, age_s: float = 3600.0, payload_bytes: int = 5000) -> Path:
    """A swap directory as a version without locks left it: no lock file, a swap file."""
    directory = parent / f"offload-swap-{pid}-old1"
    directory.mkdir(mode=0o700)
    (directory / "swap-0000.bin").write_bytes(b"s" * payload_bytes)
    past = time.time() - age_s
    os.utime(directory, (past, past))
    return directory


def dead_locked_dir(parent: Path) -> Path:
    """What a SIGKILLed store leaves (test_a_sigkilled_run_is_reclaimed_by_the_next shows it): a
    directory with a lock file no one holds. Made new, as a run killed a moment ago leaves it."""
    directory = parent / f"offload-swap-{dead_pid()}-lck1"
    directory.mkdir(mode=0o700)
    (directory / LOCK_NAME).write_bytes(b"")
    (directory / "swap-0000.bin").write_bytes(b"s" * 8192)
    return directory


def test_a_sigkilled_run_is_reclaimed_by_the_next(tmp_path, make_engine, children):
    child = Child(tmp_path)
    children.append(child)
    assert (child.root / LOCK_NAME).exists()
    child.kill()
    assert child.root.exists()  # SIGKILL left it behind
    expected_bytes = file_bytes(child.root)
    assert expected_bytes >= 100_000 + 4097 + (1 << 20)
    with FileStore(make_engine(), tmp_path) as store:
        assert store.reclaimed_dirs == [str(child.root)]
        assert store.reclaimed_bytes == expected_bytes
        assert not child.root.exists()
        assert [p.name for p in tmp_path.iterdir()] == [Path(store.root).name]
    with FileStore(make_engine(), tmp_path) as again:
        assert again.reclaimed_dirs == [] and again.reclaimed_bytes == 0


def test_a_live_run_in_another_process_is_left_alone(tmp_path, make_engine, children):
    live = Child(tmp_path)
    children.append(live)
    dead = dead_locked_dir(tmp_path)
    before = {p.name: p.stat().st_size for p in live.root.iterdir()}
    with FileStore(make_engine(), tmp_path) as store:
        assert store.reclaimed_dirs == [str(dead)]
        assert {p.name: p.stat().st_size for p in live.root.iterdir()} == before
    live.kill()
    with FileStore(make_engine(), tmp_path) as store:
        assert store.reclaimed_dirs == [str(live.root)]


def test_a_live_store_of_this_process_is_left_alone(tmp_path, make_engine):
    engine = make_engine()
    with FileStore(engine, tmp_path) as first:
        first.allocate({"a": 4097})
        with FileStore(engine, tmp_path) as second:
            assert second.reclaimed_dirs == [] and Path(first.root).exists()
            first.write("a", b"a" * 4097)
        # closing leaves no directory for anyone to reclaim
        assert sorted(p.name for p in tmp_path.iterdir()) == [Path(first.root).name]


def test_old_format_directories_are_judged_by_their_pid(tmp_path, make_engine):
    dead = old_format_dir(tmp_path, dead_pid(), payload_bytes=5000)
    live = old_format_dir(tmp_path, os.getppid())
    with FileStore(make_engine(), tmp_path) as store:
        assert store.reclaimed_dirs == [str(dead)]
        assert store.reclaimed_bytes == 5000
    assert not dead.exists() and (live / "swap-0000.bin").exists()


def test_a_young_directory_without_a_lock_is_left_alone(tmp_path, make_engine):
    """A store between its mkdir and its lock, or an old-format directory just made: not judged yet."""
    young = old_format_dir(tmp_path, dead_pid(), age_s=0.0)
    half_made = tmp_path / f"offload-swap-{dead_pid()}-half"
    half_made.mkdir()
    (half_made / ".owner.lock.new").write_bytes(b"")
    with FileStore(make_engine(), tmp_path) as store:
        assert store.reclaimed_dirs == []
    assert young.exists() and half_made.exists()
    past = time.time() - 2 * UNLOCKED_GRACE_S
    os.utime(half_made, (past, past))
    with FileStore(make_engine(), tmp_path) as store:
        assert store.reclaimed_dirs == [str(half_made)]


def test_what_a_kill_in_a_stores_mkdir_or_removal_left_is_reclaimed_as_the_next_store_closes(tmp_path, make_engine):
    """A store SIGKILLed before each file-system change of its making and its removal in turn: between
    its mkdir and its lock file's rename, or between that file's removal and the rmdir, it leaves a
    directory without a lock file, too young to judge (UNLOCKED_GRACE_S) at the start of a run resumed
    at once, which then left it behind for good. The resumed run's store looks again as it closes,
    once the run went on past the grace (made so here by ageing the leftover)."""
    survived_the_start = []
    n = 1
    while True:
        parent = tmp_path / f"kill{n}"
        parent.mkdir()

        def make_and_remove() -> None:
            root, lock_fd = make_swap_dir(str(parent))
            remove_swap_dir(root, lock_fd)

        if not killed_at(n, make_and_remove):
            break
        with FileStore(make_engine(), parent) as store:
            left = [p for p in parent.iterdir() if p.name != Path(store.root).name]
            survived_the_start += [n] if left else []
            past = time.time() - 2 * UNLOCKED_GRACE_S
            for leftover in left:
                os.utime(leftover, (past, past))
        assert os.listdir(parent) == [], f"killed before change {n}: {left} left"
        n += 1
    assert n > 5 and len(survived_the_start) >= 2, (n, survived_the_start)


def test_symlinks_and_other_names_are_never_followed_or_removed(tmp_path, make_engine):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.bin").write_bytes(b"p" * 100)
    parent = tmp_path / "scratch"
    parent.mkdir()
    (parent / "offload-swap-x").symlink_to(elsewhere)
    (parent / f"offload-swap-{dead_pid()}-link").symlink_to(elsewhere)
    (parent / f"offload-swap-{dead_pid()}-file").write_bytes(b"f")
    (parent / "offload-swap-notapid").mkdir()
    other = old_format_dir(tmp_path / "scratch", dead_pid())
    other.rename(parent / "not-a-swap-dir")
    past = time.time() - 3600
    for name in os.listdir(parent):
        os.utime(parent / name, (past, past), follow_symlinks=False)
    before = sorted(os.listdir(parent))
    # a dead directory whose lock file is a symlink to the precious file: never opened through it
    dead = old_format_dir(parent, dead_pid())
    (dead / LOCK_NAME).symlink_to(elsewhere / "precious.bin")
    with pytest.warns(SwapReclaimWarning, match=str(dead)):
        with FileStore(make_engine(), parent) as store:
            assert store.reclaimed_dirs == []
    assert (elsewhere / "precious.bin").read_bytes() == b"p" * 100
    assert sorted(os.listdir(parent)) == sorted(before + [dead.name])


def test_a_leftover_that_cannot_be_removed_is_a_warning(tmp_path, make_engine, monkeypatch):
    dead = dead_locked_dir(tmp_path)
    real_unlink = os.unlink

    def refuse_swap_files(path, *args, **kwargs):
        if str(path).startswith("swap-"):
            raise PermissionError(1, "Operation not permitted", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(io_engine.swap_dirs.os, "unlink", refuse_swap_files)
    with pytest.warns(SwapReclaimWarning, match=f"could not remove all of {dead}.*Operation not permitted"):
        store = FileStore(make_engine(), tmp_path)
    monkeypatch.undo()
    assert store.reclaimed_dirs == [] and (dead / "swap-0000.bin").exists()
    store.allocate({"a": 1})
    store.write("a", b"a")
    store.close()
    assert not dead.exists()  # its lock file stayed: the store tried again as it closed


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_another_users_directory_is_left_alone(tmp_path, make_engine):
    theirs = old_format_dir(tmp_path, dead_pid())
    os.chown(theirs, 65534, 65534)
    with FileStore(make_engine(), tmp_path) as store:
        assert store.reclaimed_dirs == []
    assert theirs.exists()


def test_stores_made_at_once_never_remove_each_other(tmp_path, make_engine):
    """Many stores made and closed at the same time in one parent: each keeps its directory."""
    engine = make_engine(num_threads=2, queue_depth=8)
    failures: List[BaseException] = []
    start = threading.Barrier(6)

    def run(seed: int) -> None:
        try:
            start.wait()
            for round_index in range(10):
                with FileStore(engine, tmp_path) as store:
                    payload = bytes([seed, round_index]) * 3000
                    store.allocate({"k": len(payload)})
                    store.write("k", payload)
                    assert Path(store.root, LOCK_NAME).exists()
                    out = bytearray(len(payload))
                    store.read("k", out)
                    assert bytes(out) == payload
                    assert store.reclaimed_dirs == []
        except BaseException as exc:  # noqa: B902 - reported by the test thread
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert list(tmp_path.iterdir()) == []


def test_a_file_system_without_flock_falls_back_to_the_pid(tmp_path, make_engine, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(io_engine.swap_dirs.fcntl, "flock", no_locks)
    with FileStore(make_engine(), tmp_path) as store:
        assert os.listdir(store.root) == []  # no lock file: the pid in the name keeps it alive
        store.allocate({"a": 4097})
        store.write("a", b"a" * 4097)
        past = time.time() - 2 * UNLOCKED_GRACE_S
        os.utime(store.root, (past, past))
        with FileStore(make_engine(), tmp_path) as other:
            assert other.reclaimed_dirs == [] and Path(store.root).exists()
        root = Path(store.root)
    assert not root.exists()


def test_the_parent_may_be_a_symlink(tmp_path, make_engine):
    """Scratch space is often a symlink: the parent itself is followed, nothing in it is."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "scratch"
    link.symlink_to(real)
    dead = dead_locked_dir(real)
    with FileStore(make_engine(), link) as store:
        assert store.reclaimed_dirs == [str(link / dead.name)] and not dead.exists()
        store.allocate({"a": 4097})
        store.write("a", b"a" * 4097)
        assert Path(store.root).parent == link
    assert list(real.iterdir()) == []  # close() removed the directory through the symlink


def test_the_room_for_swap_files_counts_what_dead_runs_hold_and_removes_nothing(tmp_path, make_engine, children, monkeypatch):
    """The room a new store has is the free bytes plus the dead runs' swap directories it reclaims
    first (the planner's NVMe room reads it: a resume after a SIGKILL on a disk sized for one run was
    refused for the room its killed attempt held). A live run's, and the directory's own, are not counted."""
    live = Child(tmp_path)  # first: a store made after the kill would reclaim the killed one's
    killed = Child(tmp_path)
    children.extend([live, killed])
    killed.kill()
    old = old_format_dir(tmp_path, dead_pid())
    held = sum(p.lstat().st_blocks * 512 for d in (killed.root, old) for p in d.iterdir())
    assert held >= 100_000 + 4097 + (1 << 20)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert io_engine.swap_dirs.dead_swap_dir_bytes(str(tmp_path)) == held
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # judged, not removed
    monkeypatch.setattr(io_engine.file_store, "free_bytes", lambda path: 1000)
    assert io_engine.file_store.swap_room_bytes(str(tmp_path)) == 1000 + held
    assert io_engine.file_store.swap_room_bytes(str(tmp_path / "not-made-yet")) == 1000
    with FileStore(make_engine(), tmp_path) as store:
        assert sorted(store.reclaimed_dirs) == sorted([str(killed.root), str(old)])
        assert io_engine.swap_dirs.dead_swap_dir_bytes(str(tmp_path)) == 0
