"""A call SIGKILLed in a forked child at a chosen moment, as an OOM kill or a scheduler kills a run:
nothing on the way out runs (no finally, no atexit). The kill sweeps of the atomic writers and caches
use it to stop a write before each of its file-system changes in turn.

    n = 1
    while killed_at(n, lambda: write_atomic(path, "new"), file_system_change):
        ...   # what the killed call left on disk
        n += 1
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable


CHANGES = ("os.rename", "os.replace", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.symlink", "os.truncate")
"""Audit events that change the file system; `open` counts when it writes (file_system_change)."""


def file_system_change(event: str, args: tuple) -> bool:
    """Whether an audit event changes the file system: one of CHANGES, or a file opened for writing."""
    if event in CHANGES:
        return True
    if event == "open":
        mode, flags = args[1], args[2]
        if isinstance(mode, str):
            return any(c in mode for c in "wax+")
        return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
    return False


def killed_at(n: int, call: Callable[[], object], counts: Callable[[str, tuple], bool] = file_system_change) -> bool:
    """Run `call()` in a forked child, SIGKILLed just before the n-th audit event `counts` accepts.
    Whether the kill came (False: the call finished first). The child never returns into pytest."""
    pid = os.fork()
    if pid == 0:
        try:
            seen = [0]

            def hook(event: str, args: tuple) -> None:
                if counts(event, args):
                    seen[0] += 1
                    if seen[0] == n:
                        os.kill(os.getpid(), signal.SIGKILL)

            sys.addaudithook(hook)
            call()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
