"""CudaAccelerator's stream ordering, in both directions ([Note: Ordering of copies], [Note: Copies
into new device memory]): a copy waits for the compute that last used its memory, the compute waits
for the copy (a stream wait, never the host), and new device memory for a copy is the copy stream's.

Runs on the CPU: torch.cuda's streams and events are replaced by fakes that log what waits for what,
per thread as torch's current stream is; the copies themselves are CPU copies. test_cuda.py shows
the same on a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, List, Optional, Tuple

import pytest
import torch

from offload_trainer.runtime.device.cuda import CudaAccelerator, CudaPending


class FakeStream:
    def __init__(self, name: str, log: List[Tuple[str, ...]]) -> None:
        self.name = name
        self._log = log

    def wait_event(self, event: "FakeEvent") -> None:
        self._log.append(("wait", self.name, event.stream.name if event.stream else "?"))

    def wait_stream(self, other: "FakeStream") -> None:
        self._log.append(("wait", self.name, other.name))

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    def __init__(self) -> None:
        self.stream: Optional[FakeStream] = None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        assert self.stream is not None
        self.stream._log.append(("host waits", self.stream.name))


class ThreadStreams:
    """torch.cuda's current stream, faked: per thread, the compute stream unless under
    `with torch.cuda.stream(...)`. Subclasses set `compute` and `_local` (a threading.local)."""

    compute: Any
    _local: threading.local

    def current_stream(self, device: object = None) -> Any:
        return getattr(self._local, "stream", self.compute)

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        before = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before


def install_fake_streams(monkeypatch: pytest.MonkeyPatch, fake: Any, event: type) -> None:
    """torch.cuda as CudaAccelerator sees it: available, its streams `fake`'s, its events `event`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(torch.cuda, "Stream", fake.new_stream)
    monkeypatch.setattr(torch.cuda, "Event", event)


class FakeCuda(ThreadStreams):
    """Streams that log what they are asked to do."""

    def __init__(self) -> None:
        self.log: List[Tuple[str, ...]] = []
        self.compute = FakeStream("compute", self.log)
        self._local = threading.local()
        self._made = iter(["h2d", "d2h", "comm"])

    def new_stream(self, *args: object, **kwargs: object) -> FakeStream:
        return FakeStream(next(self._made), self.log)


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda()
    install_fake_streams(monkeypatch, fake, FakeEvent)
    real_copy = torch.Tensor.copy_

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        fake.log.append(("copy", fake.current_stream().name))
        return real_copy(self, src)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return fake


@pytest.fixture
def accel(cuda: FakeCuda) -> CudaAccelerator:
    accel = CudaAccelerator(torch.device("cuda", 0))
    accel.torch_device = torch.device("cpu")  # the "device" memory of these tests is the CPU's
    return accel


def test_a_copy_into_a_slot_waits_for_the_compute_that_last_read_it_and_the_compute_waits_for_the_copy(
    cuda: FakeCuda, accel: CudaAccelerator
) -> None:
    slot_users = accel.compute_done()  # recorded when the slot was given back
    copied = accel.h2d(torch.empty(4), torch.ones(4), after=[slot_users])
    accel.compute_waits(copied, "param load")
    assert cuda.log == [("wait", "h2d", "compute"), ("copy", "h2d"), ("wait", "compute", "h2d")]


def test_a_gradient_leaves_the_device_after_the_compute_that_wrote_it(cuda: FakeCuda, accel: CudaAccelerator) -> None:
    grad = torch.ones(4)  # as backward wrote it, on the compute stream
    copied = accel.d2h(torch.empty(4), grad)
    assert cuda.log == [("wait", "d2h", "compute"), ("copy", "d2h")]
    assert isinstance(copied, CudaPending) and copied.cuda_event.stream.name == "d2h"


def test_a_copy_issued_from_another_thread_still_runs_on_the_copy_stream(cuda: FakeCuda, accel: CudaAccelerator) -> None:
    """io_engine's workers issue the copy of a load chained to its NVMe read; their current stream
    is the compute stream (streams are per thread), which the copy must not run on."""
    worker = threading.Thread(target=accel.h2d, args=(torch.empty(4), torch.ones(4)))
    worker.start()
    worker.join()
    assert cuda.log == [("copy", "h2d")]


def test_new_device_memory_for_a_copy_is_the_copy_streams_and_recorded_on_the_compute_stream(
    cuda: FakeCuda, accel: CudaAccelerator, monkeypatch
) -> None:
    """A boundary copied back for backward: allocated on the compute stream, its memory could be what
    a kernel not run yet still reads (the caching allocator reuses a stream's freed memory at once),
    and the copy on its own stream would overwrite it."""
    allocated_on: List[str] = []
    recorded_on: List[str] = []
    real_empty = torch.empty

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        allocated_on.append(cuda.current_stream().name)
        return real_empty(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded_on.append(stream.name))
    src = torch.arange(6, dtype=torch.float32)
    back, copied = accel.h2d_new(src, (2, 3))
    accel.compute_waits(copied, "boundary copy to the device")
    assert allocated_on == ["h2d"] and recorded_on == ["compute"]
    assert cuda.log == [("copy", "h2d"), ("wait", "compute", "h2d")]
    assert back.shape == (2, 3) and torch.equal(back.view(-1), src)


def test_a_device_home_written_from_the_host_waits_for_the_compute_that_may_still_read_it(
    cuda: FakeCuda, accel: CudaAccelerator
) -> None:
    """Home.write (new weights loaded, a checkpoint resumed): a forward whose output nobody read yet
    may still have kernels queued that read the home."""
    from types import SimpleNamespace

    from offload_trainer.config import Tier
    from offload_trainer.runtime.groups.homes import Home

    home = Home(Tier.DEVICE, 4, torch.float32, tensor=torch.zeros(4))
    home.write(SimpleNamespace(accelerator=accel), torch.ones(4))  # type: ignore[arg-type]
    assert cuda.log == [("wait", "h2d", "compute"), ("copy", "h2d"), ("host waits", "h2d")]
    assert torch.equal(home.tensor, torch.ones(4))


def test_a_collective_runs_after_the_compute_and_the_copies_that_filled_its_input_and_leaves_the_compute_alone(
    cuda: FakeCuda, accel: CudaAccelerator
) -> None:
    """A slot's all-gather (ShardGroup.start_gather): its input was written by compute (a device
    home's shard) or by a copy (a shard from host memory or NVMe). The compute is not made to wait
    at the block's end ([Note: Compute after a collective] in device/cuda.py): at an all-gather
    ahead the copy is the next group's, which the compute of the group acquired now does not read;
    before, the compute stream waited for the comm stream, and with it for that copy. The compute
    that reads the gathered parameters waits for NCCL's stream at CollectiveWork.finish()."""
    copied = accel.h2d(torch.empty(4), torch.ones(4))
    cuda.log.clear()
    with accel.collective(after=[copied]):
        cuda.log.append(("collective", cuda.current_stream().name))
    assert cuda.log == [("wait", "comm", "compute"), ("wait", "comm", "h2d"), ("collective", "comm")]


def test_a_boundary_kept_in_host_memory_comes_back_after_its_copy_off_without_the_host_waiting(
    cuda: FakeCuda, accel: CudaAccelerator, monkeypatch
) -> None:
    """Layer-major's host boundaries (runtime/boundary_store.py): put() copies a block's input off
    the device behind the forward; take(), in backward, copies it back into new device memory. The
    copy back waits for the copy off on its stream: before, the host waited for it, and with it for
    the GPU to reach the forward's kernels that made the boundary."""
    from offload_trainer.config import Tier
    from offload_trainer.runtime.boundary_store import BoundarySpill, BoundaryStore
    from offload_trainer.runtime.groups.tiers import MemoryTiers

    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    tiers = MemoryTiers(accel, 0, None, None, None)  # type: ignore[arg-type]  # no room on the device
    store = BoundaryStore(tiers, [6 * 4, 6 * 4], [0], BoundarySpill(tiers))
    assert store.tier_of == {0: Tier.HOST}
    h = [torch.arange(6, dtype=torch.float32) + m for m in range(2)]
    for m in range(2):
        store.put(0, m, h[m])
    assert cuda.log == [("wait", "d2h", "compute"), ("copy", "d2h")] * 2
    cuda.log.clear()
    for m in range(2):
        assert torch.equal(store.take(0, m), h[m])
    assert cuda.log == [("wait", "h2d", "d2h"), ("copy", "h2d"), ("wait", "compute", "h2d")] * 2
    store.close()
