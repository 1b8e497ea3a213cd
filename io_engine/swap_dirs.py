"""Swap directories: made with a lock their live owner holds, and those of dead runs reclaimed.

    root, lock_fd = make_swap_dir("/nvme/scratch")      # offload-swap-<pid>-XXXX, locked
    reclaimed = reclaim_dead_swap_dirs("/nvme/scratch")  # -> Reclaimed(dirs, freed_bytes)
    held = dead_swap_dir_bytes("/nvme/scratch")         # what reclaiming would free, nothing removed

FileStore calls both; this file knows directories, names and locks, nothing of extents.

[Note: Swap directory lifecycle]
A FileStore's directory `offload-swap-<pid>-XXXX` holds an empty lock file, `owner.lock`, on
which its store holds `fcntl.flock(LOCK_EX)` for its whole life. The kernel drops the lock when
the process dies, however it dies (SIGKILL, OOM killer), so at the next start:
- a directory whose lock can be taken (LOCK_EX | LOCK_NB) belongs to a dead run and is removed,
  with the reaper holding the lock meanwhile (a second reaper sees it live and leaves it);
- a directory whose lock is held is live and never touched;
- a directory without a lock file (made by a version before the lock, or caught in the moments
  of being made or removed) is dead only if the pid in its name is no running process and it was
  not modified in the last UNLOCKED_GRACE_S seconds; otherwise it is left alone. The grace keeps a
  store being made in another pid namespace (a container sharing the directory) safe, and leaves
  what a kill in a store's mkdir or removal left to a start more than that after the kill: a run
  resumed at once left it for good, so a store also reclaims as it closes (FileStore).
The lock file is created under another name, locked, then renamed to `owner.lock`, so no one can
see the lock file of a live store unlocked: from its mkdir until then the directory has no lock
file and the pid in its name is alive. A store that closes removes its files, the lock file
last, the directory, and only then releases the lock.
Only real directories named offload-swap-* directly in the parent and owned by this user are
considered; nothing in the parent is followed through a symlink (every open is O_NOFOLLOW,
relative to the parent's open descriptor; the parent itself may be a symlink). A leftover that cannot be removed is reported (FileStore warns with
SwapReclaimWarning) and the new run goes on. Runs on several hosts sharing a directory over NFS
rely on flock reaching the server (Linux emulates it with POSIX locks there); the pid rule for
directories without a lock file assumes one host.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

SWAP_DIR_PREFIX = "offload-swap-"
LOCK_NAME = "owner.lock"
_NEW_LOCK_NAME = ".owner.lock.new"
UNLOCKED_GRACE_S = 10.0
"""A swap directory without a lock file that changed more recently than this is left alone."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PARENT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
"""The parent is the user's choice (scratch space is often a symlink): it alone is followed."""
_NO_FLOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
"""What flock fails with on a file system that has no locks (some FUSE and network ones)."""


@dataclass
class Reclaimed:
    """What reclaim_dead_swap_dirs removed."""

    dirs: List[str] = field(default_factory=list)
    """Swap directories of dead runs removed completely."""
    freed_bytes: int = 0
    """Sizes of the files removed (those of directories only partly removed too)."""
    problems: List[str] = field(default_factory=list)
    """Why a leftover could not be inspected or removed, one sentence each (for a warning)."""


def make_swap_dir(parent: str) -> Tuple[str, Optional[int]]:
    """A new private (0700) swap directory under `parent`, and the descriptor holding its lock.

    The caller keeps the descriptor open while the directory lives and closes it after removing
    the directory (remove_swap_dir does both). On a file system without flock (ENOLCK and the
    like) the directory gets no lock file and the descriptor is None: the pid in its name then
    keeps it alive, as for a directory of a version without locks.
    """
    root = tempfile.mkdtemp(prefix=f"{SWAP_DIR_PREFIX}{os.getpid()}-", dir=parent)
    lock_fd: Optional[int] = None
    try:
        dir_fd = os.open(root, _DIR_FLAGS)
        try:
            lock_fd = os.open(
                _NEW_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
            )
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: no one else holds it
            except OSError as exc:
                if exc.errno not in _NO_FLOCK_ERRNOS:
                    raise
                os.close(lock_fd)
                lock_fd = None
                os.unlink(_NEW_LOCK_NAME, dir_fd=dir_fd)
            else:
                os.rename(_NEW_LOCK_NAME, LOCK_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if lock_fd is not None:
            os.close(lock_fd)
        _remove_quietly(root)
        raise
    return root, lock_fd


def remove_swap_dir(root: str, lock_fd: Optional[int]) -> None:
    """Remove a store's directory and everything in it, then release its lock. Raises nothing of
    its own: what cannot be removed now is reclaimed by the next run, once the lock is released.

    An exception raised into the removal from outside (KeyboardInterrupt, or a signal handler's
    exception: SIGTERM arriving as a finished run removed its swap files) does not stop it: the
    removal is finished, then the exception goes on. Stopped there, it left the directory, and the
    run's last line said the swap files were removed. A program that ignores further signals while
    it cleans up (offload-train does) gets the second pass done."""
    try:
        _remove_quietly(root)
    except BaseException:
        _remove_quietly(root)
        raise
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def _remove_quietly(root: str) -> None:
    try:
        parent_fd = os.open(os.path.dirname(root) or ".", _PARENT_FLAGS)
    except OSError:
        return
    try:
        _remove_tree(parent_fd, os.path.basename(root))
    except Exception:  # noqa: BLE001 - runs in finalizers; the next run reclaims what is left
        pass
    finally:
        os.close(parent_fd)


def reclaim_dead_swap_dirs(parent: str) -> Reclaimed:
    """Remove the swap directories of dead runs directly in `parent` (see [Note: Swap directory
    lifecycle]). Never raises: what cannot be inspected or removed is told in `problems`."""
    reclaimed = Reclaimed()
    try:
        parent_fd = os.open(parent, _PARENT_FLAGS)
    except OSError as exc:
        reclaimed.problems.append(f"cannot look for swap directories of dead runs in {parent}: {exc}")
        return reclaimed
    try:
        with os.scandir(parent_fd) as entries:
            names = sorted(e.name for e in entries if e.name.startswith(SWAP_DIR_PREFIX))
        for name in names:
            path = os.path.join(parent, name)
            try:
                _reclaim_one(parent_fd, name, path, reclaimed)
            except Exception as exc:  # noqa: BLE001 - a leftover must never fail the new run
                reclaimed.problems.append(f"cannot inspect or remove {path}: {type(exc).__name__}: {exc}")
    except OSError as exc:
        reclaimed.problems.append(f"cannot look for swap directories of dead runs in {parent}: {exc}")
    finally:
        os.close(parent_fd)
    return reclaimed


def _reclaim_one(parent_fd: int, name: str, path: str, reclaimed: Reclaimed) -> None:
    with _if_dead(parent_fd, name) as dir_fd:
        if dir_fd is None:
            return
        # Dead. Holding its lock (if it has one) while removing it keeps other reapers away.
        freed, error, removed = _remove_tree(parent_fd, name, dir_fd)
        reclaimed.freed_bytes += freed
        if removed:
            reclaimed.dirs.append(path)
        elif error is not None:  # (neither: another run removed it first)
            reclaimed.problems.append(f"could not remove all of {path}, a swap directory of a dead run: {error}")


def dead_swap_dir_bytes(parent: str) -> int:
    """Bytes on disk that reclaim_dead_swap_dirs(parent) would give back now: the files of the swap
    directories of dead runs directly in `parent`, judged as it judges them, nothing removed (0 where
    `parent` cannot be read). A FileStore reclaims them before it makes its own, so the room it has is
    the file system's free bytes plus these: counted as used, a run resumed after a SIGKILL on a disk
    sized for one run's swap files was refused for the room its own killed attempt held."""
    total = 0
    try:
        parent_fd = os.open(parent, _PARENT_FLAGS)
    except OSError:
        return 0
    try:
        with os.scandir(parent_fd) as entries:
            names = sorted(e.name for e in entries if e.name.startswith(SWAP_DIR_PREFIX))
        for name in names:
            try:
                with _if_dead(parent_fd, name) as dir_fd:
                    if dir_fd is not None:
                        total += _tree_bytes(dir_fd)
            except OSError:
                continue  # cannot be judged or read: counted as used, as reclaiming may fail on it too
    except OSError:
        pass
    finally:
        os.close(parent_fd)
    return total


@contextlib.contextmanager
def _if_dead(parent_fd: int, name: str) -> Iterator[Optional[int]]:
    """The open directory `name` of `parent_fd` if it is the swap directory of a dead run (see [Note:
    Swap directory lifecycle]), its lock held meanwhile if it has one; else None (alive, too young to
    judge, removed meanwhile, not a directory of this user's)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        yield None  # removed meanwhile (by its owner, or another run reclaiming it)
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        yield None  # a symlink or a file: not a swap directory; another user's: not ours to judge
        return
    try:
        dir_fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            yield None  # removed, or replaced by something that is not a directory, since the stat
            return
        raise
    lock_fd: Optional[int] = None
    try:
        opened = os.fstat(dir_fd)
        dead = (opened.st_dev, opened.st_ino) == (st.st_dev, st.st_ino)  # else replaced since the stat: judge it next time
        if dead:
            try:
                lock_fd = os.open(LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
            except FileNotFoundError:
                lock_fd = None
            if lock_fd is not None:
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    dead = False  # its owner is alive
                else:
                    # Unlinked before its lock was released: its owner (or a reaper) is removing it.
                    dead = os.fstat(lock_fd).st_nlink != 0
            else:
                dead = _unlocked_dir_is_dead(name, opened.st_mtime)
        yield dir_fd if dead else None
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
        os.close(dir_fd)


def _tree_bytes(dir_fd: int) -> int:
    """The disk blocks' bytes of the regular files under the open directory `dir_fd` that removing
    them frees (one link each), never following a symlink."""
    total = 0
    with os.scandir(dir_fd) as entries:
        names = [e.name for e in entries]
    for child in names:
        try:
            st = os.stat(child, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(child, _DIR_FLAGS, dir_fd=dir_fd)
                try:
                    total += _tree_bytes(sub)
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                total += st.st_blocks * 512
        except FileNotFoundError:
            continue  # removed meanwhile
    return total


def _unlocked_dir_is_dead(name: str, mtime: float) -> bool:
    """A swap directory without a lock file: dead if its pid is gone and it is not new."""
    pid_text = name[len(SWAP_DIR_PREFIX) :].split("-", 1)[0]
    if not pid_text.isdigit() or int(pid_text) <= 0:
        return False  # not a name FileStore makes: cannot tell, so leave it
    if time.time() - mtime < UNLOCKED_GRACE_S:
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # EPERM: a process of another user has that pid
    return False


def _remove_tree(
    parent_fd: int, name: str, dir_fd: Optional[int] = None
) -> Tuple[int, Optional[OSError], bool]:
    """Remove directory `name` of `parent_fd` and its contents, never following a symlink; the
    lock file goes last, and stays if anything else could not be removed. Returns (bytes of the
    files removed, the first error or None, whether this call removed the directory itself)."""
    own_fd = dir_fd is None
    if own_fd:
        try:
            dir_fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            return 0, None, False
        except OSError as exc:
            return 0, exc, False
    assert dir_fd is not None
    freed = 0
    first_error: Optional[OSError] = None
    try:
        with os.scandir(dir_fd) as entries:
            names = sorted((e.name for e in entries), key=lambda n: n == LOCK_NAME)
        for child in names:
            if child == LOCK_NAME and first_error is not None:
                break  # kept, so that the next run sees an unlocked lock and tries again at once
            try:
                st = os.stat(child, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    child_freed, error, _ = _remove_tree(dir_fd, child)
                    freed += child_freed
                    if error is not None:
                        raise error
                else:
                    os.unlink(child, dir_fd=dir_fd)
                    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                        freed += st.st_size
            except FileNotFoundError:
                continue  # another reaper or the owner removed it first
            except OSError as exc:
                first_error = first_error or exc
    finally:
        if own_fd:
            os.close(dir_fd)
    if first_error is not None:
        return freed, first_error, False
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return freed, None, False
    except OSError as exc:
        return freed, exc, False
    return freed, None, True


__all__ = [
    "LOCK_NAME", "Reclaimed", "SWAP_DIR_PREFIX", "dead_swap_dir_bytes", "make_swap_dir", "reclaim_dead_swap_dirs",
    "remove_swap_dir",
]
