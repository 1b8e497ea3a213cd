"""Accelerators whose compute runs on the CPU: the CPU itself, and the simulated accelerator.

CpuAccelerator: the device tier is host memory under its own budget (a machine without a GPU).
Copies between a host home and a device slot run on a copy worker, so prefetching a host-homed
group overlaps the copy with compute; compute that needs a copy's result blocks the host until
it is done (the CPU's compute runs on the host thread). A small copy with nothing to wait for is
made on the calling thread instead (`inline_copy_max_bytes`, [Note: Inline copies] in
copy_worker.py): handing it over would cost more than the copy.

SimulatedAccelerator: an accelerator that behaves like a GPU and runs on the CPU, for CI. Its
device memory is kept apart from the host tiers (own arena, own budget) and it is not host
memory as far as the engine knows (`is_host` False): parameters from NVMe come through a host
staging buffer, gradients are copied off the device, a group's state may be split between the
device and other tiers, exactly the paths a GPU takes. Every copy finishes `*_delay_s` late, on a
copy worker per direction (a GPU's two copy engines), and its destination holds NaN until then:
a use that does not wait for its copy computes with NaN, so the parity tests prove the ordering.
With `lazy_s` a copy is moreover held back until something waits for it ([Note: Lazy copies] in
copy_worker.py): a missing wait is then shown however long after the copy its use comes.
`skip_waits` (tests only) turns named waits into no-ops, to show a missing wait being caught.
"""

from __future__ import annotations

from typing import FrozenSet, Iterable, Optional, Sequence

import torch

from offload_trainer.runtime.device.accelerator import Accelerator
from offload_trainer.runtime.device.copy_worker import CopyWorker
from offload_trainer.runtime.device.pending import DONE, Pending


class CpuAccelerator(Accelerator):
    """The CPU: device-tier memory is host memory; copies to and from it run on worker threads."""

    is_host = True
    name = "cpu"
    inline_copy_max_bytes = 1 << 20
    """Copies up to this size with nothing to wait for are made on the calling thread (none with
    injected delays or poison): a memcpy of 1 MiB takes about as long as a hand-over to the worker."""

    def __init__(
        self, h2d_delay_s: float = 0.0, d2h_delay_s: float = 0.0, poison: bool = False, lazy_s: float = 0.0
    ) -> None:
        self.torch_device = torch.device("cpu")
        self._h2d = CopyWorker("h2d", h2d_delay_s, poison, self.inline_copy_max_bytes, lazy_s)
        self._d2h = CopyWorker("d2h", d2h_delay_s, poison, self.inline_copy_max_bytes, lazy_s)
        self.copies_issued = 0
        """Copies submitted so far, both directions."""

    @property
    def copies_inline(self) -> int:
        """Of copies_issued, those made on the calling thread ([Note: Inline copies] in copy_worker.py)."""
        return self._h2d.num_inline + self._d2h.num_inline

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Pending] = ()) -> Pending:
        self.copies_issued += 1
        return self._h2d.submit(dst, src, after)

    def d2h(
        self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Pending] = (), written_by: Optional[Pending] = None
    ) -> Pending:
        # The compute that wrote `src` ran on the calling thread, before this call: nothing to follow.
        self.copies_issued += 1
        return self._d2h.submit(dst, src, after)

    def compute_waits(self, pending: Pending, why: str) -> None:
        pending.wait()

    def host_waits(self, pending: Pending, why: str) -> None:
        pending.wait()

    def compute_done(self) -> Pending:
        return DONE  # compute runs on the host thread: what was issued has run

    def close(self) -> None:
        self._h2d.close()
        self._d2h.close()


class SimulatedAccelerator(CpuAccelerator):
    """A GPU-like device on the CPU: memory apart, copies late, destinations NaN until copied."""

    is_host = False
    name = "simulated"

    def __init__(
        self,
        h2d_delay_s: float = 0.002,
        d2h_delay_s: float = 0.002,
        skip_waits: Iterable[str] = (),
        lazy_s: float = 0.0,
    ) -> None:
        """`lazy_s`: hold each copy back until it is waited for, at most this long (0: not at all)."""
        super().__init__(h2d_delay_s, d2h_delay_s, poison=True, lazy_s=lazy_s)
        self.skip_waits: FrozenSet[str] = frozenset(skip_waits)
        """Waits (by their `why`) made no-ops: a test-only switch that shows a missing wait is caught."""

    def compute_waits(self, pending: Pending, why: str) -> None:
        if why not in self.skip_waits:
            pending.wait()

    def host_waits(self, pending: Pending, why: str) -> None:
        if why not in self.skip_waits:
            pending.wait()
