"""Pending: work in flight that a caller may have to wait for, whatever runs it.

    pending.done()        # finished (successfully or not)? never blocks
    pending.wait()        # the host blocks until it has finished; raises its error, if any

Four kinds: a copy on an accelerator (the CPU's copy worker, or a CUDA stream: `cuda_event` is then
the event a stream waits on), an io_engine request (IOHandle), one already finished (DONE), and a
load from NVMe onto a device that is not host memory: an NVMe read into a host staging buffer
chained to the copy onto the device, issued when the read completes. (A fifth, a load filled by
the optimizer's update pass, is OptimizerPipeline's ParamFill.)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, List, Optional, Sequence

from io_engine import IOHandle


class Pending:
    """Work in flight. Subclasses say how to tell it is done and how to wait for it."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    @property
    def cuda_event(self) -> Optional[Any]:
        """The torch.cuda.Event a stream waits on (None: the host must wait, see wait())."""
        return None

    def parts(self) -> List["Pending"]:
        """The pieces of work this is made of (itself, unless several are waited for together)."""
        return [self]

    def wait_issued(self) -> None:
        """The host waits until this work's copy, if it issues one later (a Chain), has been issued:
        what a copy queued behind it must wait for first, as a CUDA stream's wait on its event does
        (cuda_event). Nothing to wait for otherwise."""

    def add_done_callback(self, callback: Callable[[], None]) -> bool:
        """Call `callback()` (from whichever thread finishes the work) when done; False if this kind
        of work cannot say (the caller then waits for it instead)."""
        return False

    def wait_read(self) -> None:
        """The host waits until what this work reads from a file, if anything, is read, and raises that
        read's error: what a rank must know before it tells its peers its shard is coming (ShardGroup.
        start_gather). Copies, which do not fail on their own, are not waited for."""

    def cancel(self) -> None:
        """Drop the work if it has not begun (a load cancelled before the update pass that was to fill
        it began: OptimizerPipeline.fill_params); nothing otherwise. The caller still waits for it to
        be over before the memory it writes is used again."""


class FailedRead(Pending):
    """A read that failed as it was requested (a lost write's extent, a request refused): over, its
    error raised by wait() and wait_read() (ShardGroup.start_load, on several ranks)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        raise self.error

    def wait_read(self) -> None:
        raise self.error


class _Done(Pending):
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE: Pending = _Done()
"""Work that needs no waiting: a copy the compute itself made, say."""


class HostEvent(Pending):
    """A piece of work finished by some thread (a copy worker): set() or fail() it exactly once."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._callbacks: List[Callable[[], None]] = []

    def set(self) -> None:
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.set()

    def add_done_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return True
        callback()
        return True

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error


class IOPending(Pending):
    """An io_engine request (its TransferError is raised by wait())."""

    def __init__(self, handle: IOHandle) -> None:
        self.handle = handle

    def done(self) -> bool:
        return self.handle.done()

    def wait(self) -> None:
        self.handle.wait()

    def wait_read(self) -> None:
        self.handle.wait()

    def add_done_callback(self, callback: Callable[[], None]) -> bool:
        self.handle.add_done_callback(lambda _handle: callback())
        return True


class Chain(Pending):
    """An io_engine read followed by a copy that `then()` issues once the read is done.

    `then` runs on the IO worker that completes the read (so the copy starts at once, without the
    training thread's help) and returns the copy's Pending. wait() waits for both; cuda_event
    blocks the host only until the copy has been issued."""

    def __init__(self, handle: IOHandle, then: Callable[[], Pending]) -> None:
        self._handle = handle
        self._then = then
        self._issued = threading.Event()
        self._copy: Optional[Pending] = None
        self._error: Optional[BaseException] = None
        handle.add_done_callback(self._on_read)

    def _on_read(self, handle: IOHandle) -> None:
        try:
            handle.wait()  # raises the read's TransferError: then the copy is never issued
            self._copy = self._then()
        except BaseException as error:  # noqa: B902 - reported to whoever waits
            self._error = error
        finally:
            # The closure holds the copy's destination (a device slot): let go of it once issued, or
            # a staging buffer that keeps this Chain as its last user keeps the slot from being lent.
            self._then = None  # type: ignore[assignment]
            self._issued.set()

    def _issued_copy(self) -> Pending:
        self._issued.wait()
        if self._error is not None:
            raise self._error
        assert self._copy is not None
        return self._copy

    def done(self) -> bool:
        return self._issued.is_set() and (self._copy is None or self._copy.done())

    def wait_issued(self) -> None:
        self._issued.wait()  # an error is raised by wait(), to whoever waits for the copy

    def wait_read(self) -> None:
        self._issued_copy()

    def wait(self) -> None:
        self._issued_copy().wait()

    @property
    def cuda_event(self) -> Optional[Any]:
        return self._issued_copy().cuda_event


class _AllOf(Pending):
    """Done when every one of several pieces of work is."""

    def __init__(self, pendings: List[Pending]) -> None:
        self._pendings = pendings

    def done(self) -> bool:
        return all(p.done() for p in self._pendings)

    def wait(self) -> None:
        wait_all(self._pendings)

    def parts(self) -> List[Pending]:
        return list(self._pendings)

    def wait_issued(self) -> None:
        for p in self._pendings:
            p.wait_issued()

    def wait_read(self) -> None:
        for p in self._pendings:
            p.wait_read()


class _Over(Pending):
    """Another user's work on some memory, as the memory's next user waits for it: over, failed or not."""

    def __init__(self, pending: Pending) -> None:
        self._pending = pending

    def done(self) -> bool:
        return self._pending.done()

    def wait(self) -> None:
        with contextlib.suppress(Exception):  # its failure is its own user's to report
            self._pending.wait()

    @property
    def cuda_event(self) -> Optional[Any]:
        try:
            return self._pending.cuda_event
        except Exception:  # noqa: BLE001 - a Chain whose read failed issued no copy: the host waits (wait())
            return None

    def wait_issued(self) -> None:
        self._pending.wait_issued()

    def add_done_callback(self, callback: Callable[[], None]) -> bool:
        return self._pending.add_done_callback(callback)


def over(pending: Pending) -> Pending:
    """`pending` as the next user of the memory it reads or writes waits for it: until it is over,
    its failure never raised.

    [Note: A failed transfer is its own user's error]
    A read that fails (EIO) is raised to whoever needed its bytes: the load of a group waiting for
    its device copy, the update waiting for its states. The buffer it read into, given back with
    the read as its last user (a parameter staging buffer, a device slot of a load dropped), waits
    for the read to be over before it is written again, and that wait raised the read's error once
    more, at every take of the buffer: after one failed read of a parameter home (a disk's
    transient error) every later forward raised the same error, the engine lost for good. A wait
    for the memory to be free waits for the work to be over, not for it to succeed."""
    return pending if pending is DONE or isinstance(pending, _Over) else _Over(pending)


def all_of(pendings: Sequence[Pending]) -> Pending:
    """One Pending for several: done when all are (DONE when none is left in flight)."""
    live = [p for p in pendings if not p.done()]
    return DONE if not live else live[0] if len(live) == 1 else _AllOf(live)


def wait_all(pendings: List[Pending]) -> None:
    """The host waits for every one of them (the first error is raised after all have finished)."""
    error: Optional[BaseException] = None
    for p in pendings:
        try:
            p.wait()
        except BaseException as e:  # noqa: B902 - waited for the rest first
            error = error or e
    if error is not None:
        raise error
