"""The standard streams of a run that may outlive whoever reads them.

    open_closed_std_fds()              # first thing in main(): closed fds 0-2 now point at /dev/null
    escape_unencodable_output()        # and a line naming any path can be printed
    with surviving_lost(sys.stdout):   # a write to a reader that went away: the run goes on
        print(line, flush=True)

A process started with descriptor 0, 1 or 2 closed (`offload-train >&-`, some daemon managers and
job runners) hands that number to the next file it opens: a swap file or a checkpoint would then
receive whatever a C library (torch's own warnings) or Python writes to "stdout" or "stderr". And
Python sets sys.stdout (or sys.stderr) to None, so the first line printed raised AttributeError.
open_closed_std_fds() points each closed one at /dev/null before anything is opened.

A path need not be text in the output's encoding: a file name in Latin-1 on a UTF-8 machine (Python
hands it over with its bytes as surrogates, '\\udce9'), or any non-ASCII name under LC_ALL=C with
PYTHONUTF8=0. Python writes such a character to stderr escaped, but stdout fails on it when its
error handler is "strict" (a locale such as en_US.UTF-8; C and C.UTF-8 pass the bytes through), so
the first progress line naming that path ended the run with exit 2 and "'utf-8' codec can't encode
character '\\udce9'". escape_unencodable_output() gives stdout stderr's handler (backslashreplace).

A stream whose reader is gone (`offload-train | head`, a log shipper that died, a log file on a
full disk) fails every write (EPIPE, EIO, ENOSPC). The run's record is train.out_dir (metrics.jsonl,
the checkpoints), not its stdout: a failed write used to end the run at that step with exit 2 and
"Broken pipe; check the path". Now the stream's descriptor is pointed at /dev/null (so later lines,
and the interpreter's own flush at exit, go nowhere instead of failing again), training goes on,
and a warning (printed with the run's warnings at the end, where stderr still works) says so. A
command whose product is its stdout (offload-plan, the benchmarks) ends instead, as a program killed
by SIGPIPE does (stdout_gone).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import warnings
from typing import IO, Iterator, Optional


def open_closed_std_fds() -> None:
    """Point each of the descriptors 0, 1 and 2 that is closed at /dev/null, and give Python a
    stream for it (sys.stdin/stdout/stderr were None)."""
    for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, mode)
        if null != fd:  # the lowest free number: fd itself when the ones below it are open
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", encoding="utf-8", closefd=False))


def escape_unencodable_output() -> None:
    """Make sys.stdout (and sys.stderr) write a character its encoding lacks as an escape (\\udce9)
    instead of raising, where its error handler is "strict"; a handler already lenient is kept."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


@contextlib.contextmanager
def surviving_lost(stream: Optional[IO[str]], warn: bool = True) -> Iterator[None]:
    """Run the block that writes to `stream` (sys.stdout or sys.stderr); if the write fails because
    the stream is gone (an OSError, or ValueError for a closed file object), drop the stream (its
    descriptor then points at /dev/null), warn (unless `warn` is False: the summary at the very end,
    after the warnings were printed), and return normally."""
    try:
        yield
    except (OSError, ValueError) as exc:
        if isinstance(exc, ValueError) and "closed file" not in str(exc):
            raise
        _drop(stream, exc, warn)


EXIT_STDOUT_GONE = 128 + signal.SIGPIPE
"""141: how a command whose product is its stdout (offload-plan, the benchmarks) ends when the reader
of that stdout went away, as a program killed by SIGPIPE does (`offload-plan | head -1`); it used to
be exit 2 and "Broken pipe; check the path", a mistake of the user's that was none."""


def stdout_gone() -> int:
    """After a BrokenPipeError on stdout: point it at /dev/null (the interpreter's flush at exit then
    stays quiet) and return EXIT_STDOUT_GONE, with nothing on stderr (no one asked for more)."""
    _drop(sys.stdout, BrokenPipeError(), warn=False)
    return EXIT_STDOUT_GONE


def _drop(stream: Optional[IO[str]], exc: BaseException, warn: bool) -> None:
    name = "stdout" if stream is sys.stdout else "stderr" if stream is sys.stderr else "an output stream"
    try:
        fd = stream.fileno() if stream is not None else -1
    except (OSError, ValueError):
        fd = -1
    if fd >= 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    if stream is not None:
        with contextlib.suppress(OSError, ValueError):
            stream.flush()  # what the failed write left buffered now goes to /dev/null
    if not warn:
        return
    warnings.warn(
        f"{name} could not be written ({exc}), so the run went on without its lines there; every step is "
        "in train.out_dir's metrics.jsonl",
        stacklevel=3,
    )


__all__ = ["EXIT_STDOUT_GONE", "escape_unencodable_output", "open_closed_std_fds", "stdout_gone", "surviving_lost"]
