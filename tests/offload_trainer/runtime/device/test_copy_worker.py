"""The CPU's copy path: small copies with nothing to wait for are made inline, in submission order;
the simulated accelerator's copies stay late ([Note: Inline copies] in runtime/device/copy_worker.py),
and with `lazy_s` land only once waited for ([Note: Lazy copies])."""

import threading
import time

import torch

from offload_trainer.runtime.device.copy_worker import CopyWorker, copy_host
from offload_trainer.runtime.device.host import CpuAccelerator, SimulatedAccelerator
from offload_trainer.runtime.device.pending import DONE, Chain, HostEvent


def test_small_copy_with_nothing_to_wait_for_is_made_inline() -> None:
    accel = CpuAccelerator()
    try:
        src, dst = torch.randn(1000), torch.zeros(1000)
        done = accel.h2d(dst, src)
        assert done is DONE and torch.equal(dst, src)  # written before h2d returned
        assert accel.copies_issued == 1 and accel.copies_inline == 1
    finally:
        accel.close()


def test_copy_above_the_threshold_goes_to_the_worker() -> None:
    accel = CpuAccelerator()
    try:
        numel = accel.inline_copy_max_bytes // 4 + 1
        src, dst = torch.randn(numel), torch.zeros(numel)
        accel.host_waits(accel.h2d(dst, src), "test")
        assert torch.equal(dst, src)
        assert accel.copies_inline == 0
    finally:
        accel.close()


def test_copy_whose_after_is_pending_waits_for_it() -> None:
    worker = CopyWorker("test", inline_max_bytes=1 << 20)
    try:
        gate = HostEvent()
        src, dst = torch.ones(10), torch.zeros(10)
        done = worker.submit(dst, src, after=[gate])
        assert done is not DONE and worker.num_inline == 0
        gate.set()
        done.wait()
        assert torch.equal(dst, src)
    finally:
        worker.close()


def test_copy_behind_a_queued_one_is_not_made_inline() -> None:
    # Copies land in submission order: a small copy submitted while an earlier one into the same
    # memory waits in the queue must not overtake it.
    worker = CopyWorker("test", inline_max_bytes=1 << 20)
    try:
        gate = HostEvent()
        first, second, dst = torch.full((10,), 1.0), torch.full((10,), 2.0), torch.zeros(10)
        a = worker.submit(dst, first, after=[gate])
        b = worker.submit(dst, second)
        assert b is not DONE and worker.num_inline == 0
        gate.set()
        a.wait()
        b.wait()
        assert torch.equal(dst, second)
        # The queue is empty again: the next small copy is inline.
        assert worker.submit(dst, first) is DONE and torch.equal(dst, first)
    finally:
        worker.close()


def test_simulated_accelerator_never_copies_inline() -> None:
    accel = SimulatedAccelerator(h2d_delay_s=0.01, d2h_delay_s=0.01)
    try:
        src, dst = torch.randn(100), torch.zeros(100)
        done = accel.h2d(dst, src)
        assert torch.isnan(dst).all()  # poisoned until the late copy lands
        accel.host_waits(done, "test")
        assert torch.equal(dst, src) and accel.copies_inline == 0
    finally:
        accel.close()


def test_copy_host_takes_strided_and_odd_sized_tensors() -> None:
    for numel in (1, 4096 * 10 + 1):
        src, dst = torch.randn(numel), torch.zeros(numel)
        copy_host(dst, src)
        assert torch.equal(dst, src)
    src = torch.randn(6, 4).t()  # not contiguous: torch's copy
    dst = torch.zeros(4, 6)
    copy_host(dst, src)
    assert torch.equal(dst, src)
    empty = torch.zeros(0)
    copy_host(empty, torch.zeros(0))


def test_a_lazy_copy_lands_only_once_waited_for_and_reads_its_source_then() -> None:
    """[Note: Lazy copies]: nothing waits for the copy, so however long the program goes on its
    destination holds NaN and its source is still to be read; a wait makes it land, with what the
    source holds then (a source overwritten before its copy was waited for shows as wrong numbers)."""
    accel = SimulatedAccelerator(h2d_delay_s=0.0, d2h_delay_s=0.0, lazy_s=60.0)
    try:
        src, dst = torch.ones(8), torch.zeros(8)
        done = accel.h2d(dst, src)
        time.sleep(0.05)  # the worker is free all along: a copy that is not lazy would have landed
        assert not done.done() and torch.isnan(dst).all()
        src.fill_(2.0)
        accel.host_waits(done, "test")
        assert torch.equal(dst, torch.full((8,), 2.0))
    finally:
        accel.close()


def test_waiting_for_a_lazy_copy_lands_the_earlier_ones_of_its_direction_first() -> None:
    """Copies of one direction land in order, as on one GPU stream: a wait for the last is a wait for all."""
    accel = SimulatedAccelerator(h2d_delay_s=0.0, d2h_delay_s=0.0, lazy_s=60.0)
    try:
        dsts = [torch.zeros(4) for _ in range(3)]
        copies = [accel.d2h(dst, torch.full((4,), float(i))) for i, dst in enumerate(dsts)]
        copies[-1].wait()
        assert all(c.done() for c in copies)
        assert all(torch.equal(dst, torch.full((4,), float(i))) for i, dst in enumerate(dsts))
    finally:
        accel.close()


def test_a_lazy_copy_nobody_waits_for_still_lands_after_lazy_s() -> None:
    """So that code which only polls done() (a buffer pool preferring buffers whose users are done) moves on."""
    worker = CopyWorker("test", poison=True, lazy_s=0.01)
    try:
        src, dst = torch.ones(4), torch.zeros(4)
        done = worker.submit(dst, src)
        for _ in range(1000):
            if done.done():
                break
            time.sleep(0.01)
        assert done.done() and torch.equal(dst, src)
    finally:
        worker.close()


def test_closing_a_lazy_worker_lands_what_was_submitted() -> None:
    worker = CopyWorker("test", lazy_s=60.0)
    src, dst = torch.ones(4), torch.zeros(4)
    done = worker.submit(dst, src)
    worker.close()
    assert done.done() and torch.equal(dst, src)


class _Read:
    """An io_engine read's handle, done when the test says (what a Chain needs of it)."""

    def __init__(self) -> None:
        self._callbacks: list = []
        self._done = threading.Event()

    def add_done_callback(self, callback) -> None:  # type: ignore[no-untyped-def]
        self._callbacks.append(callback)

    def finish(self) -> None:
        self._done.set()
        for callback in self._callbacks:
            callback(self)

    def wait(self) -> None:
        self._done.wait()

    def done(self) -> bool:
        return self._done.is_set()


def test_a_copy_waiting_for_a_chain_is_queued_after_the_chains_own_copy() -> None:
    """[Note: A copy queued behind what it waits for]: a slot's next load waited for a cancelled load
    still reading from NVMe, whose copy goes to the same worker once the read is done. Queued first,
    the next load's copy sat at the head of the queue waiting for a copy behind it: the simulated
    accelerator deadlocked (seen as a hung default run of test_residency)."""
    worker = CopyWorker("test", delay_s=0.001)
    try:
        read = _Read()
        earlier_src, earlier_dst = torch.full((8,), 1.0), torch.zeros(8)
        chain = Chain(read, lambda: worker.submit(earlier_dst, earlier_src))
        later_src, later_dst = torch.full((8,), 2.0), torch.zeros(8)
        threading.Timer(0.2, read.finish).start()  # the read lands while the next load is submitted
        outcome: list = []

        def next_load() -> None:
            done = worker.submit(later_dst, later_src, after=[chain])
            done.wait()
            outcome.append(torch.equal(later_dst, later_src) and torch.equal(earlier_dst, earlier_src))

        thread = threading.Thread(target=next_load, daemon=True)
        thread.start()
        thread.join(timeout=20)
        assert outcome == [True], "the copy waiting for the chain never ran (deadlock)"
    finally:
        if outcome:  # a deadlocked worker cannot be closed: its daemon thread is left to the process's end
            worker.close()
