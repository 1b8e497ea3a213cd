"""CudaAccelerator: copies on streams of their own, ordered by events (see [Note: Ordering of copies]).

Host memory the copies touch is pinned (io_engine HostArena registers each arena once), so a copy
with non_blocking=True runs on its stream while the host and the compute stream go on.

Which stream computes: torch's current stream is per thread, each thread's device's default stream
unless it chose another. compute_waits() and compute_done() take the calling thread's: the
training thread's, the backward's (autograd runs each backward op on its forward op's stream, and
the engine's hooks within it) and the update thread's (a group updated on the device,
runtime/optimizer_pipeline.py). These agree because all are the default stream, which every thread
of a process shares. So the engine must be called on the default stream (not under
`torch.cuda.stream(s)`): the update thread's kernels would not be ordered with another stream.
Copies and collectives run on the streams below whichever thread issues them.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Deque, Iterator, List, Optional, Sequence, Tuple

import torch

from offload_trainer.runtime.device.accelerator import Accelerator
from offload_trainer.runtime.device.pending import Pending


class CudaPending(Pending):
    """A copy or a collective on a CUDA stream, as the event recorded after it."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()

    @property
    def cuda_event(self) -> Any:
        return self._event


class CudaAccelerator(Accelerator):
    """One GPU: a host-to-device stream, a device-to-host stream and a stream for collectives."""

    is_host = False
    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} but CUDA is not available here; use device 'cpu'")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.torch_device = torch.device("cuda", index)
        with torch.cuda.device(self.torch_device):
            # Parameters and write-backs come in on their own stream, so they overlap compute.
            self._h2d = torch.cuda.Stream(self.torch_device)
            # Gradients leave on their own stream, so the next backward kernels do not wait for them.
            self._d2h = torch.cuda.Stream(self.torch_device)
            # NCCL all-gathers and reduce-scatters run beside compute and beside both copy directions.
            self._comm = torch.cuda.Stream(self.torch_device)
        # Copies are issued from several threads: the training thread (loads, gradients), the
        # optimizer's update thread (device homes off and back) and io_engine's workers (a load's
        # copy chained to its NVMe read). _reap's "is the oldest done? then drop it" is two steps:
        # two threads could both see the oldest done and each drop one, the second dropping a copy
        # still in flight (its source then free for the allocator to reuse). This lock makes every
        # change of _inflight (and the count) one step.
        self._inflight_lock = threading.Lock()
        self._inflight: Deque[Tuple[CudaPending, List[torch.Tensor]]] = collections.deque()
        self.copies_issued = 0

    def _copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Pending]) -> Pending:
        self._reap()
        with torch.cuda.device(self.torch_device), torch.cuda.stream(stream):
            for p in after:
                self._stream_waits(stream, p)
            dst.copy_(src.view(dst.shape) if src.shape != dst.shape else src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        done = CudaPending(event)
        # The source stays referenced until the copy is done, so the caching allocator cannot hand a
        # gradient being copied off the device to other work. The destination is the caller's (a
        # pool's buffer, lent again only after this copy: BufferPool.give), and a reference here
        # would keep a device slot looking in use.
        with self._inflight_lock:
            self._inflight.append((done, [src]))
            self.copies_issued += 1
        return done

    def _stream_waits(self, stream: Any, pending: Pending) -> None:
        for part in pending.parts():
            event = part.cuda_event
            if event is None:
                part.wait()  # host-side work (an NVMe read): the host waits before the stream may go on
            else:
                stream.wait_event(event)

    def _reap(self) -> None:
        """Drop the references of the oldest copies that are done (up to the first one that is not)."""
        with self._inflight_lock:
            while self._inflight and self._inflight[0][0].done():
                self._inflight.popleft()

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Pending] = ()) -> Pending:
        return self._copy(self._h2d, dst, src, after)

    def h2d_new(
        self, src: torch.Tensor, shape: Sequence[int], after: Sequence[Pending] = ()
    ) -> Tuple[torch.Tensor, Pending]:
        # [Note: Copies into new device memory]: allocated on the copy stream, whose memory no compute
        # kernel can still be using (the caching allocator's memory is per stream), and recorded on
        # the compute stream that will read it, so it is not reused before that compute is done.
        compute = torch.cuda.current_stream(self.torch_device)
        with torch.cuda.device(self.torch_device), torch.cuda.stream(self._h2d):
            dst = torch.empty(shape, dtype=src.dtype, device=self.torch_device)
        copied = self._copy(self._h2d, dst.view(-1), src.view(-1), after)
        dst.record_stream(compute)
        return dst, copied

    def d2h(
        self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Pending] = (), written_by: Optional[Pending] = None
    ) -> Pending:
        # Device memory is written by compute: the copy waits for the compute that wrote it (a stream
        # wait), by default all compute issued so far.
        compute = written_by if written_by is not None else self.compute_done()
        return self._copy(self._d2h, dst, src, [compute, *after])

    def compute_waits(self, pending: Pending, why: str) -> None:
        self._stream_waits(torch.cuda.current_stream(self.torch_device), pending)

    def host_waits(self, pending: Pending, why: str) -> None:
        pending.wait()

    def compute_done(self) -> Pending:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.torch_device))
        return CudaPending(event)

    @contextlib.contextmanager
    def collective(self, after: Sequence[Pending] = ()) -> Iterator[None]:
        # Its input was written by compute (a gradient bucket, a device home's shard) or by the copies
        # in `after` (a shard from host memory or NVMe, the scratch's last copy off the device).
        self._comm.wait_stream(torch.cuda.current_stream(self.torch_device))
        for p in after:
            self._stream_waits(self._comm, p)
        with torch.cuda.stream(self._comm):
            yield
        # [Note: Compute after a collective]
        # No compute.wait_stream(self._comm) here: the comm stream holds only the waits above, so that
        # made the compute wait for `after`, at an all-gather ahead the next group's copy from the
        # host, which this group's compute does not read (compute made to wait for more than it
        # needs). NCCL runs the collective on a stream of its own, which waits for this one when it is
        # issued; the compute that reads its output waits for that stream at CollectiveWork.finish()
        # (Work.wait() makes the current stream wait, the host does not).

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)
        # Not clear(): another thread may have issued a copy since the device was synchronized.
        self._reap()

    def close(self) -> None:
        self.synchronize()


