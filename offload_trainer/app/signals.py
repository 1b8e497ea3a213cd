"""Ending a command on SIGTERM or SIGHUP the way Ctrl-C ends it: by unwinding, so that its cleanup runs.

    with ending_signals():              # SIGTERM, SIGHUP -> Terminated; SIGINT -> KeyboardInterrupt
        run(...)                        # `with engine:` blocks and `finally:` clauses run on the way out
    except Terminated as t:
        return t.exit_status            # 143 for SIGTERM, 129 for SIGHUP (128 + the signal's number)

Batch schedulers, torchrun's teardown and `docker stop` end a job with SIGTERM, a closed terminal
with SIGHUP. Python's default for both is to die at once, leaving the engine's swap directory and
any half-written temporary file behind. Here the first such signal raises `Terminated` in the main
thread, a BaseException (like KeyboardInterrupt) so that no `except Exception` swallows it, and
every `with` block and `finally` clause on the way out runs: the engine closes (its swap files are
removed) and the caller removes what the run left half written. Under torchrun every rank gets the
signal and handles its own.

The command lines enter ending_signals() before they import anything heavy (app/launch.py), so a
signal during the seconds torch takes to import is answered too; the command's own
ending_signals() inside it then does nothing (one handler for the whole command).

[Note: A second signal during cleanup]
Once the first signal has been raised, later SIGTERM, SIGHUP and SIGINT are ignored until the
command ends: raised again, one would interrupt the very cleanup the first one started (a swap
directory half removed). Cleanup is short; SIGKILL still ends a process that hangs in it, and the
next run reclaims what it leaves (see io_engine/swap_dirs.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Dict, Iterator, Optional, Tuple

ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals that end a command like Ctrl-C does."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C (a BaseException), so the run's files are cleaned up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        """"SIGTERM" or "SIGHUP"."""
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number (143, 129)."""
        return 128 + self.signum


def interruption_status(stopped: BaseException) -> Tuple[str, int]:
    """How an interruption is named in a command's last line, and the exit status it ends with:
    ("Ctrl-C", 130) for KeyboardInterrupt, ("SIGTERM", 143) or ("SIGHUP", 129) for Terminated."""
    if isinstance(stopped, Terminated):
        return stopped.signal_name, stopped.exit_status
    return "Ctrl-C", 128 + signal.SIGINT


class _Handler:
    """The handler of SIGTERM, SIGHUP and SIGINT while ending_signals() is active."""

    def __init__(self) -> None:
        self.ending = False
        """True once a signal has been raised: later ones are ignored (see [Note: A second signal during cleanup])."""

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.ending:
            return
        self.ending = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)


@contextlib.contextmanager
def ending_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Terminated, SIGINT KeyboardInterrupt, in the main thread; the handlers
    in place before are restored at the end. Elsewhere than in the main thread (where Python cannot
    install handlers), and inside another ending_signals() (the command's, around its imports), this
    does nothing."""
    if threading.current_thread() is not threading.main_thread() or isinstance(
        signal.getsignal(signal.SIGTERM), _Handler
    ):
        yield
        return
    handler = _Handler()
    previous: Dict[int, object] = {}
    try:
        for signum in (*ENDING_SIGNALS, signal.SIGINT):
            previous[signum] = signal.signal(signum, handler)
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)  # type: ignore[arg-type]
