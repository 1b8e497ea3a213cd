"""Cost model: the predicted time of one optimizer step for a MemoryPlan, phase by phase.

Pure arithmetic over what the engine does (see runtime/residency/scheduler.py,
runtime/groups/shard_group.py and tiers.py, runtime/gradients.py, runtime/optimizer.py), so the
planner can rank thousands of placements without running any:

    forward   per micro-batch and group: the parameter shard is read from NVMe if homed there,
              and copied into a device slot unless homed on the device. The two kinds of fetch
              are not alike (see [Note: Which fetches overlap compute]): an NVMe read runs on an
              io_engine worker, so with a lookahead of at least one group the scheduler overlaps
              it with compute and the phase takes max(compute, reads) plus the first group's
              read (with lookahead 0 the two add up); a copy of a parameter homed in memory is
              made on the training thread, so its seconds add to the compute time whatever the
              lookahead.
    backward  the same for the groups no longer resident after the forward, plus the gradient
              shards: written to NVMe if homed there (and, from the second micro-batch on, read
              back first to accumulate). With several micro-batches the engine may find a
              parameter shard still in a host staging buffer and skip its read: the prediction
              is then an upper bound on the bytes read.
    optimizer reads of NVMe-homed gradients, states and fp32 parameters; the fused update;
              writes of states and parameters. Group k+1 is read while k is updated and k-1 is
              written, so the phase takes max(update, disk) where the disk does the reads and the
              writes one after the other (they share the drive).

[Note: Which fetches overlap compute]
The scheduler fills a device slot at acquisition or, ahead of use, when it prefetches. For a
parameter homed on NVMe that starts an asynchronous io_engine read (straight into the slot on a
machine without a GPU, through a host staging buffer and the copy path on an accelerator), which
runs while the training thread computes: prefetch hides it. For a parameter homed in host memory
it is a copy on the copy path (runtime/device/): a copy worker on the CPU, the host-to-device
stream under CUDA, so it too runs beside compute and prefetch hides it
(COPIES_OVERLAP_COMPUTE = True). Before the copy path existed such copies ran on the training
thread and added to compute; `predict_step(..., copies_overlap_compute=False)` still models
that. PhaseCost keeps the bytes (copy_bytes) and the links' time (io_s); blocking_copy_s says how
much of time_s is copies that did not overlap.

Communication between ranks is not modelled (the planner says so when world size > 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offload_trainer.config import Tier
from offload_trainer.planning.machine import MachineRates
from offload_trainer.runtime.layout.memory_plan import MemoryPlan
from offload_trainer.runtime.layout.partition import PartitionPlan

COPIES_OVERLAP_COMPUTE = True
"""Whether copies of memory-homed parameters into device slots run beside compute: they do, on the
copy path (see [Note: Which fetches overlap compute]), so predict_step overlaps them with compute
as it does NVMe reads."""


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds of pure compute for one micro-batch of the whole model (no IO, no engine)."""

    forward_s: float
    backward_s: float
    """Backward, with the recomputation of activation checkpointing when it is on."""
    update_s: float
    """The optimizer's fused update over this rank's trainable shard."""


@dataclass(frozen=True)
class PhaseCost:
    """One phase of a step: its compute, the IO on each link it needs, and its predicted time."""

    compute_s: float
    nvme_read_bytes: int
    nvme_write_bytes: int
    copy_bytes: int
    """Bytes copied between host memory and device slots."""
    io_s: float
    """Time the links need for this phase's bytes, if nothing else ran."""
    time_s: float
    """Predicted wall time of the phase."""
    blocking_copy_s: float = 0.0
    """Seconds of copies made on the training thread (memory-homed parameters into device slots,
    see [Note: Which fetches overlap compute]): part of io_s, and added to compute in time_s."""

    @property
    def exposed_io_s(self) -> float:
        return max(0.0, self.time_s - self.compute_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.io_s else "io"


@dataclass(frozen=True)
class StepCost:
    """Predicted phases of one optimizer step (all its micro-batches)."""

    forward: PhaseCost
    backward: PhaseCost
    optimizer: PhaseCost
    num_micro_batches: int

    @property
    def step_s(self) -> float:
        return self.num_micro_batches * (self.forward.time_s + self.backward.time_s) + self.optimizer.time_s

    def phases(self) -> dict[str, PhaseCost]:
        return {"forward": self.forward, "backward": self.backward, "optimizer": self.optimizer}

    @property
    def bottleneck(self) -> str:
        """The phase and resource that most of the step waits on, in words."""
        weighted = {
            "forward": self.num_micro_batches * self.forward.time_s,
            "backward": self.num_micro_batches * self.backward.time_s,
            "optimizer": self.optimizer.time_s,
        }
        name = max(weighted, key=weighted.__getitem__)
        phase = self.phases()[name]
        if name == "optimizer":
            what = "the fused update" if phase.bound == "compute" else "NVMe traffic of the optimizer states"
        else:
            what = "compute" if phase.bound == "compute" else "parameter and gradient IO"
        return f"{name} ({what})"


def _disk_s(read_bytes: int, write_bytes: int, rates: MachineRates) -> float:
    if not read_bytes and not write_bytes:
        return 0.0
    if rates.nvme_read_bytes_per_s is None or rates.nvme_write_bytes_per_s is None:
        return math.inf  # no nvme_dir was measured: such a placement cannot run here
    return read_bytes / rates.nvme_read_bytes_per_s + write_bytes / rates.nvme_write_bytes_per_s


def _overlapped(compute_s: float, io_s: float, first_fetch_s: float, lookahead: int) -> float:
    """Wall time of compute and asynchronous IO under the scheduler: overlapped when it may fetch ahead."""
    if lookahead <= 0:
        return compute_s + io_s
    return max(compute_s, io_s) + min(first_fetch_s, io_s)


@dataclass(frozen=True)
class _Fetch:
    """What filling one group's device copy moves, and whether the training thread waits for it."""

    read_bytes: int
    """Read from the group's NVMe home."""
    copy_bytes: int
    """Counted on the host -> device link (the whole gathered group, when it needs a slot)."""
    blocking: bool
    """Made on the training thread, so it adds to compute (see [Note: Which fetches overlap compute])."""


def effective_lookahead(plan: MemoryPlan, lookahead_groups: int) -> int:
    """Groups the scheduler can really fetch ahead: one slot holds the group in use."""
    return min(lookahead_groups, max(plan.num_device_slots - 1, 0)) if plan.uses_slots else lookahead_groups


def predict_step(
    partition: PartitionPlan,
    plan: MemoryPlan,
    rates: MachineRates,
    compute: ComputeTimes,
    lookahead_groups: int,
    num_micro_batches: int,
    copies_overlap_compute: bool = COPIES_OVERLAP_COMPUTE,
) -> StepCost:
    """Predicted time of one optimizer step of `plan` on a machine with `rates`.

    `copies_overlap_compute`: whether copies of memory-homed parameters into device slots overlap
    compute; False in this version (see [Note: Which fetches overlap compute])."""
    groups = partition.groups
    pbytes = torch.empty((), dtype=plan.param_dtype).element_size()
    copy_rate = rates.host_to_device_bytes_per_s

    fetch: list[_Fetch] = []
    for g, pt in zip(groups, plan.param_tiers):
        shard = g.shard_numel * pbytes
        needs_slot = plan.uses_slots and (partition.world_size > 1 or pt is not Tier.DEVICE)
        from_nvme = pt is Tier.NVME
        fetch.append(_Fetch(
            shard if from_nvme else 0,
            g.flat_numel * pbytes if needs_slot else 0,
            blocking=needs_slot and not from_nvme and not copies_overlap_compute,
        ))
    lookahead = effective_lookahead(plan, lookahead_groups)

    def link_s(read: int, copy: int, write: int = 0) -> float:
        """The links' time for these bytes: the disk and the copy link run side by side."""
        return max(_disk_s(read, write, rates), copy / copy_rate if copy else 0.0)

    def fetch_phase(compute_s: float, fetches: list[_Fetch], first: bool, extra_read: int, write: int) -> PhaseCost:
        """A phase that fills these device copies around `compute_s`, plus `extra_read` and `write`
        bytes of NVMe traffic behind compute (the gradients, in backward). `first`: the first
        group's fetch has nothing to hide behind."""
        read = sum(f.read_bytes for f in fetches)
        copy = sum(f.copy_bytes for f in fetches)
        blocking_s = sum(f.copy_bytes for f in fetches if f.blocking) / copy_rate
        async_io_s = link_s(read + extra_read, sum(f.copy_bytes for f in fetches if not f.blocking), write)
        head = next((f for f in fetches if f.read_bytes or f.copy_bytes), None) if first else None
        # A blocking first copy is already in blocking_s.
        first_s = link_s(head.read_bytes, head.copy_bytes) if head is not None and not head.blocking else 0.0
        time_s = _overlapped(compute_s + blocking_s, async_io_s, first_s, lookahead)
        io_s = link_s(read + extra_read, copy, write)
        return PhaseCost(compute_s, read + extra_read, write, copy, io_s, time_s, blocking_s)

    forward = fetch_phase(compute.forward_s, fetch, first=True, extra_read=0, write=0)

    # Backward re-fetches all but the groups still in their slots at the end of the forward.
    resident = max(plan.num_device_slots - 1, 0)
    slot_fetches = [f for f in fetch if f.copy_bytes]
    refetch = slot_fetches[: max(len(slot_fetches) - resident, 0)]
    grad_write = sum(n * 4 for n, gt in zip(plan.local_trainable_numel, plan.grad_tiers) if gt is Tier.NVME)
    # Averaged over micro-batches: the first writes, the later ones read back, add and write.
    grad_read_avg = grad_write * (num_micro_batches - 1) // max(num_micro_batches, 1)
    backward = fetch_phase(compute.backward_s, refetch, first=False, extra_read=grad_read_avg, write=grad_write)

    # Optimizer: stream NVMe-homed state through the update.
    opt_read = opt_write = 0
    num_states = len(plan.optimizer_states)
    has_master = "master" in plan.optimizer_states
    for g, n, pt, gt, ot in zip(groups, plan.local_trainable_numel, plan.param_tiers, plan.grad_tiers, plan.optimizer_tiers):
        if not n:
            continue
        if gt is Tier.NVME:
            opt_read += n * 4
        if ot is Tier.NVME:
            opt_read += n * 4 * num_states
            opt_write += n * 4 * num_states
        if pt is Tier.NVME:
            # The whole shard moves, so that every chunk's checksum is recorded. fp32: the
            # parameter is the master, read and written; low precision: written from the
            # master, and read only when frozen parameters share the shard.
            shard = g.shard_numel * pbytes
            opt_write += shard
            opt_read += shard if not has_master or g.trainable_numel < g.used_numel else 0
    opt_io = _disk_s(opt_read, opt_write, rates)
    optimizer = PhaseCost(compute.update_s, opt_read, opt_write, 0, opt_io, max(compute.update_s, opt_io))
    return StepCost(forward, backward, optimizer, num_micro_batches)

