"""One offload-train at a time in a train.out_dir: an flock on the directory itself.

    lock = OutDirLock(out_dir)
    lock.acquire()        # rank 0, before out_dir is read; OutDirInUse (a ValueError) if another run holds it
    ...                   # acquire() again once a fresh run has made out_dir (no-op when held)
    lock.release()

A batch scheduler that starts a job again while its first attempt still runs, or a user who starts
the same command twice, put two runs in one out_dir: both appended to metrics.jsonl, saved
checkpoints of the same names (each renaming the other's aside), pruned each other's checkpoints,
and one that failed removed the other's half-written checkpoint as its own leftover (its
`*.tmp-*`). The lock is taken on the directory, not on a file in it, so a run that is refused leaves
out_dir exactly as it was; the kernel releases it however the process ends (a SIGKILL, an OOM kill),
so a killed run never blocks the next. A file system without flock (some network mounts) runs
unlocked, as before.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Optional

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


class OutDirInUse(ValueError):
    """Another offload-train run holds out_dir's lock: nothing in out_dir is this run's."""


class OutDirLock:
    """The exclusive flock of one run on its out_dir, held from acquire() to release()."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Lock out_dir if it exists and is not locked yet by this object. ValueError, naming the
        directory and the fix, when another process holds it. Nothing happens when out_dir does not
        exist yet (call again once it is made), is not a directory (the run's checks say so), or its
        file system has no flock."""
        if self._fd is not None:
            return
        try:
            fd = os.open(self.out_dir, _DIR_FLAGS)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutDirInUse(
                f"train.out_dir={str(self.out_dir)!r} is in use by another offload-train run (it holds the "
                "directory's lock): wait for that run to end, or choose another train.out_dir"
            ) from None
        except OSError:  # ENOLCK, EOPNOTSUPP: no flock here
            os.close(fd)
            return
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


__all__ = ["OutDirInUse", "OutDirLock"]
