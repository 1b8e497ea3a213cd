"""Accelerator: the compute device and the copy path between it and host memory.

    accel = accelerator_for("cuda")                   # choose.py: "cpu", "cuda", or a SimulatedAccelerator(...)
    copied = accel.h2d(slot[lo:hi], home)             # host tier -> device tier, returns at once
    accel.compute_waits(copied, "param load")         # whoever uses the slot waits first
    pool.give(slot, [accel.compute_done()])           # the slot is lent again once its users are done

Every movement of bytes between the host tier and the device tier goes through h2d() and d2h():
nothing else in the engine copies across. Three implementations: the CPU (host.py: the device tier
is host memory, copies run on a worker thread so a host-homed parameter is really prefetched while
the model computes; small ones with nothing to wait for are made inline, see copy_worker.py), the
simulated accelerator (host.py: device memory kept apart, every copy finishing late, its
destination NaN until then, for CI), and CUDA (cuda.py: streams and events).

[Note: Ordering of copies]
- A copy returns a Pending at once; its destination may not be used before it is done. The
  compute that uses the destination waits with compute_waits() (under CUDA the compute stream
  waits on the copy's event, without blocking the host); the host itself, before it reads or
  writes host memory a copy touches, waits with host_waits().
- A copy starts only after its `after` work: a buffer lent again carries the Pendings of
  everything that read or wrote it (BufferPool.give), and its next writer waits for them. A device
  buffer's readers are compute: compute_done() is a Pending that completes once all compute issued
  so far has, recorded when the buffer is given back. A copy off the device follows the compute
  that wrote its source: by default all compute issued so far, or an earlier compute_done() where
  the caller knows no later compute writes the source (d2h's `written_by`: an update pass copying
  a device home off follows the compute before the step, not the next forward's).
- Whoever uses a buffer next waits for its earlier users in its own way: compute with
  compute_waits() (a stream wait under CUDA), a copy through its `after`; only the host blocks, and
  only where the host itself (or an NVMe transfer, which the host issues) touches the memory next
  ([Note: Host waits in a step]).
- The source of a copy is kept alive until the copy is done (the CPU's copy worker holds it; under
  CUDA the accelerator keeps a reference until the event has completed), so a gradient dropped by
  the engine is never reused by the allocator while it is still being copied.
- Collectives run on a stream of their own under CUDA (collective()), after the copies that filled
  their input; the compute that uses their output waits for them when it finishes them
  (CollectiveWork.finish()), not for the copies they waited for ([Note: Compute after a
  collective] in device/cuda.py).

[Note: Host waits in a step]
Under CUDA a host wait on an event that follows compute (compute_done(), a copy off the device, a
copy that waited for either) blocks the thread until the GPU has caught up with that compute: the
CPU's run-ahead, which keeps the GPU fed, is gone. So in a step the engine's next users of a buffer
wait on their own stream wherever they can (device slots and gradient buckets: the copy or the
compute that writes them next; the update pass's copies of device homes: the compute before the
step, PreparedStep.compute in optimizer.py, not all compute issued so far, which would tie each
group's update to the next forward's progress), and the host waits only where the host itself, or
an NVMe transfer it issues, touches the memory next:
- the merge of staged gradients copied off the device into their host or NVMe home (gradients.py
  flush): at the end of the step's last backward, where a staging buffer is short in backward, or
  at a group's first gradient of a micro-batch while its previous micro-batch's are still staged;
  a backward before the step's last leaves the merges whose copies are not done for later, so the
  next micro-batch's forward is issued without waiting for the GPU, and so does each unit of a
  layer-major step but its last, so the next block's backward is issued without waiting ([Note:
  Merges left for later] in gradients.py);
- several ranks with a host or NVMe grad home (gradients.py _add_reduced), at the same points and
  at a group's next reduced shard: the host adds the reduced shard copied off (the next
  reduce-scatter, which rewrites the scratch it was copied from, waits for that copy on its
  stream);
- a host staging buffer lent again (BufferPool host_waits): its next writer is the host, an NVMe
  read or a copy issued after it, and its last user may have been a copy to the device that
  followed compute (a parameter load into an evicted slot, a write-back);
- the update pass's copies off the device, once per pass (the host updates from them);
- prepare's global norm, once per step (step() decides on the host whether to update, and returns
  the norm): the norms of gradients on the device are copied off, after the backward.
Device memory a host thread reads with `.cpu()`, `.item()` or `.tolist()` waits the same way: the
step has no such read but the norm's; the step counts of a group updated on the device stay there
([Note: Step counts on the device] in optimizer.py). The other way is free: a CPU 0-dim tensor given
to a device op (the unscale/clip multiplier of `torch._foreach_mul_`) is read by torch in host
memory, with no wait. runtime/device/test_cuda_host_waits.py holds
this list off a GPU, with fakes of torch.cuda that follow what each stream waits for.

[Note: Copies into new device memory]
A buffer of the engine's (a device slot) is written by a copy only after its last users
(`after`). A tensor just allocated has no such list, but its memory may still be read or written
by kernels the compute stream has not run yet: CUDA's caching allocator hands the memory of a
tensor freed on a stream to the next allocation on that stream at once, since work on one stream
runs in order, and a copy on another stream is not in that order. So a copy into new device
memory goes through h2d_new(): under CUDA the tensor is allocated on the copy stream, whose
memory no compute kernel can be using, and marked as used by the compute stream
(`record_stream`), so that once freed it is not reused before the compute that read it is done.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence, Tuple

import torch

from offload_trainer.runtime.device.pending import Pending


class Accelerator:
    """The compute device: where device-tier memory lives and how bytes cross to and from it."""

    torch_device: torch.device
    """The torch device compute and device-tier tensors are on."""
    is_host: bool
    """True when the device tier is host memory itself (the CPU): parameters read from NVMe land in
    a device slot directly, and gradients are host tensors already."""
    name: str

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Pending] = ()) -> Pending:
        """Start copying host memory `src` into device memory `dst` once `after` is done."""
        raise NotImplementedError

    def h2d_new(
        self, src: torch.Tensor, shape: Sequence[int], after: Sequence[Pending] = ()
    ) -> Tuple[torch.Tensor, Pending]:
        """Start copying host memory `src` (as many elements) into a new device tensor of `shape` and
        src's dtype once `after` is done (the copy that filled `src`, say); returns the tensor and the
        copy ([Note: Copies into new device memory])."""
        dst = torch.empty(shape, dtype=src.dtype, device=self.torch_device)
        return dst, self.h2d(dst.view(-1), src.view(-1), after)

    def d2h(
        self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Pending] = (), written_by: Optional[Pending] = None
    ) -> Pending:
        """Start copying device memory `src` into host memory `dst` once `after` is done, and after the
        compute that wrote `src`: `written_by` (a compute_done() taken earlier), or by default all
        compute issued so far ([Note: Ordering of copies])."""
        raise NotImplementedError

    def compute_waits(self, pending: Pending, why: str) -> None:
        """The compute issued from now on runs after `pending` (`why` names the wait, for tests)."""
        raise NotImplementedError

    def host_waits(self, pending: Pending, why: str) -> None:
        """The host blocks until `pending` is done (before it touches host memory a copy used)."""
        raise NotImplementedError

    def compute_done(self) -> Pending:
        """Completes once all compute issued so far has: what a device buffer's next writer waits for."""
        raise NotImplementedError

    @contextlib.contextmanager
    def collective(self, after: Sequence[Pending] = ()) -> Iterator[None]:
        """Issue collectives inside, after `after` and the compute issued so far; the compute that
        reads their output waits for them at CollectiveWork.finish() (collectives.py)."""
        for p in after:
            self.host_waits(p, "collective input")
        yield

    def synchronize(self) -> None:
        """Everything issued so far is done (before the host reads device memory directly)."""

    def close(self) -> None:
        """Finish what is in flight and release threads and streams."""
