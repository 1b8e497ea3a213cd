"""CopyWorker: copies made in order on a thread of their own, like one copy engine of a GPU.

    worker = CopyWorker("h2d")
    done = worker.submit(dst, src, after=[...])       # returns at once; dst is written later
    done.wait()

A tensor copy releases the GIL, so the training thread computes while the worker copies. Copies
run one at a time in the order they were submitted; each first waits for its `after` work. The
worker holds the source and the destination until the copy is done, so neither is freed early.
The simulated accelerator adds `delay_s` before each copy and fills the destination with NaN at
submission, so a use that does not wait for the copy reads NaN (see host.py); with `lazy_s` it
also holds each copy back until something waits for it ([Note: Lazy copies]).

[Note: Inline copies]
Handing a copy to the thread costs a queue put, a wake-up and a wait on an event: tens of
microseconds, more when the cores are busy, which is more than a memcpy of a few hundred
kilobytes takes. So a copy of at most `inline_max_bytes` (0: never) is made on the calling thread
and returns DONE, when nothing is left for it to wait for: its `after` work is done and the worker
has nothing submitted still to copy (so the order in which copies land is the submission order,
as if the worker had made it). The simulated accelerator never copies inline: its late copies are
what CI's ordering tests rely on.

[Note: Lazy copies]
A copy `delay_s` late shows a missing wait only when the use that skipped it falls inside that
window: a write-back the next forward reads a whole update pass later has long landed, whoever
waited. With `lazy_s` the worker makes a copy only once something waits for it (its Pending's
wait(), or a wait for a later copy of this worker: copies land in order, as on one GPU stream),
or `lazy_s` after its turn came (so that code which only polls done() still moves on). So the
destination of a copy nobody waited for holds NaN, and its source is read only then, for as
long as the program lets it: the latest a GPU could make the copy, with done() False all along.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from io_engine.thread_join import EndingThread, join_through_interrupts

from offload_trainer.runtime.device.pending import DONE, HostEvent, Pending, wait_all


def copy_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst` (host memory, as many elements): one memcpy where both are contiguous
    and of one dtype, else torch's copy.

    torch's copy_ splits a tensor of more than 32768 elements among its intra-op threads and waits
    for all of them: on a busy machine one of those threads may not run for milliseconds, so a
    256 KB copy could take 10 ms (measured on the 2-core CI machine), against 8 us for the memcpy.
    ctypes releases the GIL for the call, as copy_ does."""
    nbytes = dst.numel() * dst.element_size()
    if dst.dtype == src.dtype and dst.is_cpu and src.is_cpu and dst.is_contiguous() and src.is_contiguous():
        if nbytes:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        return
    with torch.no_grad():
        dst.copy_(src.view(dst.shape) if src.shape != dst.shape else src)


@dataclass
class _Copy:
    dst: torch.Tensor
    src: torch.Tensor
    after: Sequence[Pending]
    done: HostEvent
    number: int
    """Its place in the worker's order (from 1)."""


class _LazyCopyDone(HostEvent):
    """A copy of a lazy worker: waiting for it is what lets it (and the copies before it) land."""

    def __init__(self, worker: "CopyWorker", number: int) -> None:
        super().__init__()
        self._worker = worker
        self._number = number

    def wait(self) -> None:
        self._worker.demand(self._number)
        super().wait()


class CopyWorker:
    """One thread that makes the copies submitted to it, in order."""

    def __init__(
        self, name: str, delay_s: float = 0.0, poison: bool = False, inline_max_bytes: int = 0, lazy_s: float = 0.0
    ) -> None:
        """`delay_s`: sleep before each copy; `poison`: fill each destination with NaN when submitted;
        `inline_max_bytes`: copies up to this size may be made on the caller's thread ([Note: Inline
        copies]; only without delay, poison and laziness); `lazy_s`: a copy waits until it is waited
        for, at most this long ([Note: Lazy copies]; 0: it is made as soon as its turn comes)."""
        self.delay_s = delay_s
        self.poison = poison
        self.lazy_s = lazy_s
        self.inline_max_bytes = inline_max_bytes if not delay_s and not poison and not lazy_s else 0
        self._numbers = itertools.count(1)
        self._demanded = 0
        """The last copy (by number) something waited for: it and those before it may land."""
        self._demand_cond = threading.Condition()
        self.num_inline = 0
        """Copies made on the caller's thread so far."""
        self._num_queued = 0
        """Copies submitted to the thread and not yet done: changed under `_count_lock`, read
        without it (0 read by the submitter means every copy it submitted has landed)."""
        self._count_lock = threading.Lock()
        self._queue: "queue.SimpleQueue[Optional[_Copy]]" = queue.SimpleQueue()
        self._thread = EndingThread(target=self._run, name=f"copy-{name}", daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Pending] = ()) -> Pending:
        """Copy `src` into `dst` once `after` is done; returns at once."""
        if self._closed:
            raise ValueError("this copy worker is closed")
        numel = dst.numel()
        if numel != src.numel():
            raise ValueError(f"copy of {src.numel()} elements into {numel}")
        if (
            self._num_queued == 0
            and numel * dst.element_size() <= self.inline_max_bytes
            and (not after or all(p.done() for p in after))
        ):
            if after:
                wait_all(list(after))  # done: raises the error of one that failed, as the worker would
            copy_host(dst, src)
            self.num_inline += 1
            return DONE
        # [Note: A copy queued behind what it waits for]
        # A copy that waits for a Chain (an NVMe read, then a copy that the read's completion issues)
        # goes into this worker's queue only once the Chain's copy is in some queue: that copy may be
        # this worker's too, and queued after this one it never ran, this one waiting for it at the
        # head of the queue (a slot's next load waiting for a cancelled load still reading: a deadlock
        # of the simulated accelerator). CUDA's submit waits the same way, for the Chain's cuda_event.
        for p in after:
            p.wait_issued()
        if self.poison and dst.is_floating_point():
            dst.fill_(float("nan"))
        with self._count_lock:
            self._num_queued += 1
            number = next(self._numbers)
        done = _LazyCopyDone(self, number) if self.lazy_s else HostEvent()
        self._queue.put(_Copy(dst, src, tuple(after), done, number))
        return done

    def demand(self, number: int) -> None:
        """Copy `number` is waited for: it and the copies before it may land ([Note: Lazy copies])."""
        with self._demand_cond:
            if number > self._demanded:
                self._demanded = number
                self._demand_cond.notify_all()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            dst, src, after, done, number = item.dst, item.src, item.after, item.done, item.number
            del item
            if self.lazy_s:
                with self._demand_cond:
                    self._demand_cond.wait_for(lambda: self._demanded >= number, timeout=self.lazy_s)
            try:
                wait_all(list(after))
                if self.delay_s:
                    time.sleep(self.delay_s)
                copy_host(dst, src)
            except BaseException as error:  # noqa: B902 - reported to whoever waits for the copy
                del dst, src, after
                self._one_done()
                done.fail(error)
                continue
            # Let go of both ends before saying so: a device slot is lent again only once nothing
            # but its pool refers to it (groups/buffer_pool.py).
            del dst, src, after
            self._one_done()
            done.set()

    def _one_done(self) -> None:
        with self._count_lock:
            self._num_queued -= 1

    def close(self) -> None:
        """Finish what was submitted, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self.demand(next(self._numbers))  # every copy submitted lands now
        finally:  # interrupted or not: the thread ends after the copies queued, before anything is freed
            self._queue.put(None)
            join_through_interrupts([self._thread])  # [Note: A close interrupted while a thread runs]
