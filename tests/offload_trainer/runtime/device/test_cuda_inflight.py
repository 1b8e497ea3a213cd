"""CudaAccelerator keeps each copy's source alive until the copy's event is done, whichever threads
issue copies at once (the training thread, the optimizer's update thread, io_engine's workers).

Runs on the CPU: torch.cuda's streams and events are replaced by fakes whose completion the test
controls, and the copies themselves are CPU copies. What is checked is the accelerator's own
bookkeeping of copies in flight, not CUDA.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from typing import Callable, List, Optional

import pytest
import torch

from offload_trainer.runtime.device.cuda import CudaAccelerator


class FakeEvent:
    """A CUDA event whose query() answers as the test says (`behaviours`, in order of creation)."""

    behaviours: List[Callable[[], bool]] = []

    def __init__(self) -> None:
        self._query: Callable[[], bool] = FakeEvent.behaviours.pop(0) if FakeEvent.behaviours else (lambda: True)

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return self._query()

    def synchronize(self) -> None:
        pass


@pytest.fixture
def accel(monkeypatch) -> CudaAccelerator:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: object())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.behaviours = []
    return CudaAccelerator(torch.device("cuda", 0))


def _copy_of_a_dropped_source(accel: CudaAccelerator, query: Optional[Callable[[], bool]] = None) -> "weakref.ref":
    """Issue a copy whose event answers `query`; the caller keeps no reference to its source."""
    if query is not None:
        FakeEvent.behaviours.append(query)
    src = torch.randn(64)
    accel.h2d(torch.empty(64), src)
    ref = weakref.ref(src)
    del src
    return ref


def test_two_threads_reaping_at_once_never_drop_a_copy_in_flight(accel: CudaAccelerator) -> None:
    both_looking = threading.Barrier(2)
    armed = threading.Event()

    def oldest_done() -> bool:
        """Done, once armed; without the accelerator's lock the two threads both get here and pass
        the barrier together (with it, the second waits for the lock and the barrier times out)."""
        if not armed.is_set():
            return False
        with contextlib.suppress(threading.BrokenBarrierError):
            both_looking.wait(timeout=1.0)
        return True

    oldest = _copy_of_a_dropped_source(accel, oldest_done)
    in_flight = _copy_of_a_dropped_source(accel, lambda: False)  # its copy never finishes here
    armed.set()
    threads = [threading.Thread(target=accel.h2d, args=(torch.empty(4), torch.randn(4))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert oldest() is None, "a finished copy's source was released"
    assert in_flight() is not None, "the source of a copy still in flight was released"


def test_synchronize_keeps_a_copy_another_thread_issued_after_the_device_was_synchronized(
    accel: CudaAccelerator, monkeypatch
) -> None:
    finished = _copy_of_a_dropped_source(accel)
    later: List["weakref.ref"] = []

    def device_synchronize(device: object = None) -> None:
        # Everything issued so far is done; then another thread issues a copy, before synchronize() returns.
        later.append(_copy_of_a_dropped_source(accel, lambda: False))

    monkeypatch.setattr(torch.cuda, "synchronize", device_synchronize)
    accel.synchronize()
    gc.collect()
    assert finished() is None
    assert later[0]() is not None, "synchronize() dropped a copy issued while it ran"
