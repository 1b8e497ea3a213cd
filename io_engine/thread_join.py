"""Waiting for a worker thread's end when its owner frees what it works on next: the wait finishes
whatever interrupts it.

    worker = EndingThread(target=loop, name="io_engine-0", daemon=True)
    ...
    join_through_interrupts([worker])            # a Ctrl-C meanwhile is raised once `worker` has ended

[Note: A close interrupted while a thread runs]
A close() stops its worker threads, waits for them, and then frees what they work on (arenas
unpinned, swap files removed, descriptors closed). A second Ctrl-C that landed in the wait (the
first one started the close) left it without the thread ended, and close() went on freeing: the
update thread ran its fused kernel over an arena being unpinned, an IO worker wrote through a file
descriptor just closed (whose number the next open() reuses: another file's bytes). So the waits of
a close are finished whatever interrupts them: the interruption (KeyboardInterrupt, offload-train's
Terminated) is held and raised once the thread has ended, and nothing is freed before. The threads
end after the work already queued, which is finite; a hang there is ended by SIGKILL (as a hang in
offload-train's cleanup is: app/signals.py's [Note: A second signal during cleanup]).

The wait is on an Event the thread sets as it ends, not on Thread.join(): a join interrupted by
Ctrl-C (CPython 3.11's `_wait_for_tstate_lock`, bpo-45274's handling) can mark a thread that still
runs as stopped, so that is_alive() is False and every later join() returns at once.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence


class EndingThread(threading.Thread):
    """A thread that says when its target has returned (or raised): `ended`, set last."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.ended = threading.Event()

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.ended.set()


def join_through_interrupts(
    threads: Sequence[EndingThread], poll_s: Optional[float] = None, on_poll: Optional[Callable[[], None]] = None
) -> None:
    """Wait until every one of `threads` (started) has ended; the first exception raised into the wait
    (a signal's) is raised after. `poll_s`: wake every so often and call `on_poll` while a thread is
    still there."""
    held: Optional[BaseException] = None
    for thread in threads:
        while not thread.ended.is_set():
            try:
                if not thread.ended.wait(poll_s) and on_poll is not None:
                    on_poll()
            except BaseException as exc:  # noqa: B902 - raised below, once every thread has ended
                if held is None:
                    held = exc
    if held is not None:
        raise held
