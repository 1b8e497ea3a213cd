"""StepStats: what one optimizer step cost, by phase and by tier.

The engine makes one StepStats and hands the same object to every component that counts (the
scheduler, the gradient accumulator, the optimizer, the collectives); at the end of a step it
keeps a snapshot() of it as the step's breakdown and reset()s it in place for the next step.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Dict

from offload_trainer.config import Tier


@dataclass
class StepStats:
    """The breakdown of one optimizer step (all its micro-batches)."""

    step: int = 0
    step_s: float = 0.0
    """Wall time from the end of the previous step() to the end of this one."""
    compute_s: float = 0.0
    """Forward and backward time, less the IO and optimizer-update waits inside them."""
    io_wait_s: float = 0.0
    """Time the training thread waited for parameters from NVMe that prefetch had not brought in
    time (exposed IO; the read and, on an accelerator, its copy to the device)."""
    copy_wait_s: float = 0.0
    """Time the training thread waited for copies of parameters from host memory to the device
    (exposed copies; under CUDA the compute stream waits instead, and this stays near 0)."""
    optimizer_s: float = 0.0
    """Time in step(): the global norm, handing the updates over, and waiting for the updates of
    the groups it prefetches for the next forward (the rest run behind the next forward)."""
    optimizer_total_s: float = 0.0
    """The optimizer's work that finished during this step: the global norm, and the update pass
    (updates and their IO) of the previous step, which ran behind this step's forward."""
    optimizer_exposed_s: float = 0.0
    """The part of the optimizer's time the training thread waited for: the global norm, and the
    waits for group updates not yet done (a load of the group, backward, a checkpoint)."""
    optimizer_read_wait_s: float = 0.0
    """Of optimizer_total_s: the update pass waiting for the states it reads (NVMe, or copies off the
    device) before it can update a group: the reads that neither the read-ahead during backward nor
    the pass's own one-group-ahead reads hid (the pass's time, not necessarily the training thread's)."""
    optimizer_bytes_read_ahead: int = 0
    """Bytes of optimizer states (all but gradients) read for the next update pass before it starts:
    at the end of the pass that finished during this step, behind this step's forward and backward
    (prefetch.optimizer_groups_ahead)."""
    optimizer_groups_read_ahead: int = 0
    """Groups whose optimizer states were read so (counted as optimizer_bytes_read_ahead)."""
    heap_release_s: float = 0.0
    """Time the training thread spent in backward giving the heap memory its activations freed back
    to the OS (tiers.release_idle_memory on the CPU: [Note: Freed heap memory in backward]); part of
    compute_s."""
    communication_s: float = 0.0
    """Time the training thread spent in collectives, issuing them or waiting for them: the exposed
    communication (zero on one rank). Under NCCL a wait is a stream wait, so this is host time."""
    comm_total_s: float = 0.0
    """Time collectives took from issue to completion, summed (overlapped ones counted in full)."""
    all_gather_exposed_s: float = 0.0
    """Of communication_s: waiting for parameter all-gathers (issued ahead, see residency/scheduler.py)."""
    all_gather_total_s: float = 0.0
    """Of comm_total_s: parameter all-gathers from issue to completion."""
    all_gathers_ahead: int = 0
    """All-gathers issued ahead of their group's acquisition, to run behind the compute before it."""
    reduce_scatter_exposed_s: float = 0.0
    """Of communication_s: waiting for gradient reduce-scatters (finished one flush later)."""
    reduce_scatter_total_s: float = 0.0
    """Of comm_total_s: gradient reduce-scatters from issue to completion."""
    bytes_read: Dict[Tier, int] = field(default_factory=dict)
    """Bytes read from each tier (into a faster one)."""
    bytes_written: Dict[Tier, int] = field(default_factory=dict)
    """Bytes written to each tier (from a faster one)."""
    h2d_bytes: int = 0
    """Bytes copied from host memory to the device tier (parameters, write-backs)."""
    d2h_bytes: int = 0
    """Bytes copied from the device tier to host memory (gradients, optimizer reads)."""
    optimizer_nvme_requests: int = 0
    """io_engine requests of the optimizer's update passes to NVMe homes, reads and writes: one read
    and one write per group whose state is on NVMe ([Note: Batched per-group work])."""
    param_bytes_read: int = 0
    """Bytes of parameter shards loaded for forward and backward (every tier): the traffic a
    schedule that fetches each group once per step, not once per micro-batch, saves."""
    param_bytes_from_update: int = 0
    """Of param_bytes_read: shards filled by the optimizer's update pass from its staging buffers as it
    computed them, not read from their NVMe homes (not in bytes_read: [Note: The next forward's load
    from the update] in runtime/optimizer_pipeline.py)."""
    prefetch_hits: int = 0
    """Acquisitions the schedule predicted (the group was loaded or loading)."""
    prefetch_misses: int = 0
    """Acquisitions that had to start loading on demand."""
    prefetches_issued: int = 0
    slots_added: int = 0
    """Device slots added beyond the plan because more groups were in use at once than it foresaw."""
    unpack_refetches: int = 0
    """Groups re-fetched because backward needed an evicted group's saved tensor, or a parameter of
    an evicted group about to take its gradient (hooks.py, [Note: Gradients after the acquisition moved on])."""
    re_records: int = 0
    """Times the schedule was recorded again so far because a step diverged from it."""
    peak_bytes: Dict[Tier, int] = field(default_factory=dict)
    """Highest bytes resident per tier since the engine started."""
    grad_norm: float = float("nan")
    """The global gradient norm before clipping (unscaled under fp16); inf or nan when non-finite."""
    skipped: bool = False
    """True if the update was skipped because a gradient held inf or nan (no state changed)."""
    nonfinite: bool = False
    """True if a gradient held inf or nan in fp32/bf16, or in fp16 at precision.min_loss_scale (above
    it, fp16's loss scaler treats that as an overflow and halves the scale)."""
    loss_scale: float = 1.0
    """The loss scale after this step (1 unless compute is fp16)."""

    def snapshot(self) -> "StepStats":
        """An independent copy of the counts so far."""
        return copy.deepcopy(self)

    def reset(self) -> None:
        """Every count back to its start value, in place (the components keep this same object)."""
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(self, f.name, default)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if not isinstance(v, dict)}
        for name in ("bytes_read", "bytes_written", "peak_bytes"):
            out[name] = {tier.value: n for tier, n in getattr(self, name).items()}
        return out

    def add_counts(self, other: "StepStats") -> None:
        """Add an update pass's counts into this one: bytes, NVMe requests, optimizer_total_s, the read-wait and read-ahead counts."""
        for name in ("bytes_read", "bytes_written"):
            for tier, n in getattr(other, name).items():
                self.add_bytes(getattr(self, name), tier, n)
        self.h2d_bytes += other.h2d_bytes
        self.d2h_bytes += other.d2h_bytes
        self.optimizer_nvme_requests += other.optimizer_nvme_requests
        self.optimizer_total_s += other.optimizer_total_s
        self.optimizer_read_wait_s += other.optimizer_read_wait_s
        self.optimizer_bytes_read_ahead += other.optimizer_bytes_read_ahead
        self.optimizer_groups_read_ahead += other.optimizer_groups_read_ahead

    def add_bytes(self, table: Dict[Tier, int], tier: Tier, nbytes: int) -> None:
        table[tier] = table.get(tier, 0) + nbytes
