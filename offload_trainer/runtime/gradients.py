"""GradAccumulator: each parameter's gradient, as autograd finishes it, into its group's fp32 grad home.

Memory homes (device, host) accumulate in place. NVMe homes collect a micro-batch's gradients in
a host staging slot and flush it when the group's last trainable parameter has its gradient (or
at the end of backward): written as is on a group's first micro-batch, else read, added, written.
The addition order is that of autograd's own accumulation into `.grad` (old + new, per element),
so fp32 results are bitwise those of plain PyTorch.

When the micro-batch is the last of the step (per grad_accum_steps), each parameter's gradient
norm is taken while its final gradient is in memory, so clipping needs no second pass over NVMe.

On several ranks each group's gradients are first gathered into a full-size fp32 bucket; when
the group's last trainable parameter has its gradient (or at the end of backward, in group
order) the bucket is reduce-scattered (mean over ranks) and this rank's shard accumulated into
its home. Every trainable parameter then counts as having a gradient (zeros where a rank had
none): data-dependent routing that differs between ranks is not supported there.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from io_engine import IOHandle

from offload_trainer.runtime.collectives import Collectives
from offload_trainer.config import Tier
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.groups.buffer_pool import BufferPool
from offload_trainer.runtime.groups.homes import Home
from offload_trainer.runtime.groups.tiers import MemoryTiers
from offload_trainer.runtime.trace import Tracer


class GradAccumulator:
    """Gradient bookkeeping of one optimizer step, across its micro-batches."""

    def __init__(
        self,
        tiers: MemoryTiers,
        staging: Optional[BufferPool],
        stats: StepStats,
        grad_accum_steps: int,
        collectives: Collectives,
        buckets: Optional[BufferPool] = None,
        scratch: Optional[torch.Tensor] = None,
        tracer: Optional[Tracer] = None,
    ) -> None:
        """`buckets` (full-size fp32) and `scratch` (one shard, fp32) are needed on several ranks only."""
        self.tiers = tiers
        self.tracer = tracer if tracer is not None else Tracer()
        self.collectives = collectives
        self.buckets = buckets
        self.scratch = scratch
        self._bucket: Dict[int, Tuple[ShardGroup, torch.Tensor, List[bool]]] = {}
        self.staging = staging
        self.stats = stats
        self.grad_accum_steps = grad_accum_steps
        self.micro_batch = 0
        """Index of the running micro-batch within the optimizer step."""
        self._stage: Dict[int, Tuple[ShardGroup, torch.Tensor, List[bool]]] = {}
        self._writes: List[Tuple[IOHandle, torch.Tensor, Home]] = []
        """Gradient writes in flight: (handle, staging buffer to free, home being written)."""
        self.norms: Dict[int, torch.Tensor] = {}
        """model.parameters() index -> norm of its final gradient (filled on the last micro-batch)."""
        self._got_grad: Dict[int, List[bool]] = {}
        """Per group index, per parameter: did any micro-batch of this step produce a gradient for it."""
        self._reduced: Dict[int, int] = {}
        """Per group index (several ranks): micro-batches of this step whose gradients reached the home."""

    @property
    def final_micro_batch(self) -> bool:
        return self.micro_batch + 1 >= self.grad_accum_steps

    def begin_step(self) -> None:
        """Forget the last optimizer step's gradients: the next backward starts a new accumulation."""
        self.micro_batch = 0
        self.norms = {}
        self._got_grad = {}
        self._reduced = {}

    def got_grad(self, group: ShardGroup) -> List[bool]:
        """Per parameter of `group`: whether this step's micro-batches gave it a gradient (read-only)."""
        return self._got_grad.get(group.index) or [False] * len(group.plan.params)

    def _mark(self, group: ShardGroup) -> List[bool]:
        return self._got_grad.setdefault(group.index, [False] * len(group.plan.params))

    def on_grad(self, group: ShardGroup, i: int, grad: torch.Tensor) -> None:
        """Called once per parameter per backward, after autograd has summed all its contributions."""
        slot = group.plan.params[i]
        flat_grad = grad.reshape(-1)
        if self.collectives.world_size > 1:
            self._into_bucket(group, i, flat_grad)
            return
        home = group.grad_home
        assert home is not None, f"group {group.plan.name} got a gradient but has no grad home"
        if home.tier is Tier.NVME:
            stage, fresh = self._staging_for(group)
            stage[slot.offset_numel : slot.offset_numel + slot.numel].copy_(flat_grad)
            fresh[i] = True
            if all(fresh[j] for j, s in enumerate(group.plan.params) if s.requires_grad):
                self.flush(group)
            return
        assert home.tensor is not None
        view = home.tensor[slot.offset_numel : slot.offset_numel + slot.numel]
        got = self._mark(group)
        if got[i]:
            view.add_(flat_grad)
        else:
            view.copy_(flat_grad)
            got[i] = True
        if self.final_micro_batch:
            self.norms[slot.index] = torch.linalg.vector_norm(view, 2)

    def _staging_for(self, group: ShardGroup) -> Tuple[torch.Tensor, List[bool]]:
        entry = self._stage.get(group.index)
        if entry is None:
            stage = self._take_staging()
            entry = (group, stage, [False] * len(group.plan.params))
            self._stage[group.index] = entry
        return entry[1], entry[2]

    def _take_staging(self) -> torch.Tensor:
        assert self.staging is not None, "NVMe gradients need host staging slots"
        while True:
            slot = self.staging.take()
            if slot is not None:
                return slot
            if self._writes:
                self._reap(block=True)
            elif self._stage:
                self.flush(next(iter(self._stage.values()))[0])
            else:
                raise RuntimeError("no host staging slot is free and none can be freed")

    def _reap(self, block: bool) -> None:
        still = []
        for n, (handle, slot, home) in enumerate(self._writes):
            if block and n == 0:
                handle.wait()
            if handle.done():
                handle.wait()
                self.staging.give(slot)  # type: ignore[union-attr]
            else:
                still.append((handle, slot, home))
        self._writes = still

    def _read_after_writes(self, home: Home, into: torch.Tensor) -> None:
        """Read `home` into `into` once every write to it still in flight has landed."""
        for handle, _, pending in self._writes:
            if pending is home:
                handle.wait()
        home.read(self.tiers, into)
        self.stats.add_bytes(self.stats.bytes_read, Tier.NVME, home.nbytes)

    def flush(self, group: ShardGroup) -> None:
        """Merge the group's staged micro-batch gradients into its NVMe home."""
        entry = self._stage.pop(group.index, None)
        if entry is None:
            return
        _, stage, fresh = entry
        home = group.grad_home
        assert home is not None
        numel = group.plan.trainable_numel
        out = stage
        got = self._mark(group)
        if any(got[i] for i, f in enumerate(fresh) if f):
            old = self._take_staging()
            self._read_after_writes(home, old[: home.numel])
            for i, f in enumerate(fresh):
                s = group.plan.params[i]
                if not f:
                    continue
                if got[i]:
                    old[s.offset_numel : s.offset_numel + s.numel].add_(stage[s.offset_numel : s.offset_numel + s.numel])
                else:
                    old[s.offset_numel : s.offset_numel + s.numel].copy_(stage[s.offset_numel : s.offset_numel + s.numel])
            self.staging.give(stage)  # type: ignore[union-attr]
            out = old
        for i, f in enumerate(fresh):
            if f:
                got[i] = True
                if self.final_micro_batch:
                    s = group.plan.params[i]
                    self.norms[s.index] = torch.linalg.vector_norm(out[s.offset_numel : s.offset_numel + s.numel], 2)
        handle = home.start_write(self.tiers, out[:numel][: home.numel])
        self.stats.add_bytes(self.stats.bytes_written, Tier.NVME, home.nbytes)
        assert handle is not None
        self.tracer.io("gradient writes", f"write {group.plan.name}", handle)
        self._writes.append((handle, out, home))
        self._reap(block=False)

    def end_backward(self) -> None:
        """Flush every group still staged; the micro-batch is over."""
        for gi in sorted(self._bucket):
            self._flush_bucket(self._bucket[gi][0])
        for group, _, _ in list(self._stage.values()):
            self.flush(group)
        self.micro_batch += 1

    # -- several ranks ---------------------------------------------------------------------------

    def _into_bucket(self, group: ShardGroup, i: int, flat_grad: torch.Tensor) -> None:
        entry = self._bucket.get(group.index)
        if entry is None:
            assert self.buckets is not None
            bucket = self.buckets.take()
            assert bucket is not None, "no gradient bucket free"
            bucket = bucket[: group.plan.flat_numel]
            bucket.zero_()
            entry = (group, bucket, [False] * len(group.plan.params))
            self._bucket[group.index] = entry
        s = group.plan.params[i]
        entry[1][s.offset_numel : s.offset_numel + s.numel].copy_(flat_grad)
        entry[2][i] = True
        if all(entry[2][j] for j, p in enumerate(group.plan.params) if p.requires_grad):
            self._flush_bucket(group)

    def _flush_bucket(self, group: ShardGroup) -> None:
        """Reduce-scatter the group's bucket (a collective) and accumulate this rank's shard."""
        _, bucket, _ = self._bucket.pop(group.index)
        assert self.scratch is not None and self.buckets is not None
        shard = self.scratch[: group.plan.shard_numel]
        self.collectives.reduce_scatter_mean(shard, bucket)
        self.buckets.give(bucket)
        home = group.grad_home
        n = group.local_trainable_numel
        if home is None or n == 0:
            return
        first = self._reduced.get(group.index, 0) == 0
        if home.tier is Tier.NVME:
            buf = self._take_staging()[:n]
            if first:
                buf.copy_(shard[:n])
            else:
                self._read_after_writes(home, buf)
                buf.add_(shard[:n])
            target = buf
        else:
            assert home.tensor is not None
            target = home.tensor[:n]
            if first:
                target.copy_(shard[:n])
            else:
                target.add_(shard[:n])
        self._reduced[group.index] = self._reduced.get(group.index, 0) + 1
        got = self._mark(group)
        for piece in group.pieces:
            got[piece.param] = True
            if self.final_micro_batch:
                view = target[piece.shard_offset : piece.shard_offset + piece.numel]
                self.norms[group.plan.params[piece.param].index] = torch.linalg.vector_norm(view, 2)
        if home.tier is Tier.NVME:
            handle = home.start_write(self.tiers, target)
            assert handle is not None
            self.stats.add_bytes(self.stats.bytes_written, Tier.NVME, home.nbytes)
            self.tracer.io("gradient writes", f"write {group.plan.name}", handle)
            self._writes.append((handle, target, home))

    def drain(self) -> None:
        """Wait for every gradient write (before the optimizer reads the homes)."""
        for handle, slot, _ in self._writes:
            handle.wait()
            self.staging.give(slot)  # type: ignore[union-attr]
        self._writes = []
