"""GradAccumulator: each parameter's gradient, as autograd finishes it, into its group's fp32 grad home.

A grad home the compute can reach (on the device tier, or in host memory when the device is the
CPU) accumulates in place. Any other home collects a micro-batch's gradients in a host staging
buffer first: on an accelerator whose memory is not host memory each gradient is copied off the
device on the copy path (d2h, returning at once, so the next backward kernels never wait for it),
on the CPU it is copied in place. A group whose gradients are all staged is flushed once its copies
are done, later on the training thread (at another gradient, at the end of backward): into a host
home in place, or to an NVMe home: written as is on a group's first micro-batch, else read, added,
written. The addition order is that of autograd's own accumulation into `.grad` (old + new, per
element), so fp32 results are bitwise those of plain PyTorch.

When the micro-batch is the last of the step (per grad_accum_steps), each parameter's gradient
norm is taken while its final gradient is in memory, so clipping needs no second pass over NVMe:
a group's norms at once, with one torch._foreach_norm over its parameters' views (what
torch.nn.utils.clip_grad_norm_ calls, so the norms are bitwise its), when the group is flushed
or, for a home the compute adds into in place, at the end of the backward. The per-gradient work
is a copy or an addition into a view of the home made once per group (docs/design.md, "The
per-group hot path").

On several ranks each group's gradients are first gathered into a full-size fp32 bucket on the
device; when the group's last trainable parameter has its gradient (or at the end of backward, in
group order) the bucket's reduce-scatter (mean over ranks) is issued, and it runs while backward
goes on: it is finished, and this rank's shard accumulated into its home, at the next group's
flush (one in flight, as the reduce-scatter output is one scratch shard) or at the end of
backward (a host or NVMe home on an accelerator: copied off, and added once that copy is done,
[Note: Merges left for later]). A group whose bucket waits for a parameter that gets no gradient (one the forward did
not use) is reduced at the end of backward, or earlier when both buckets wait so: the oldest is
reduced then, and a gradient of its group that comes later goes into a bucket of its own, whose
reduce-scatter is added to the home (zeros for the parameters already reduced: exact). At the
step, a parameter counts as having a gradient where any rank's backward gave it one (agree_got,
with the global norm's all-reduce), as one rank running the whole batch would see it; one that no
rank's did is skipped by the update, as torch.optim skips a parameter whose .grad is None. Every
rank must still reduce the same groups in the same order: data-dependent routing that differs
between ranks is not supported there.

[Note: Gradient homes lent from the heap]
On the CPU a forward's activations come from the process heap, and backward frees them while the
gradients it computes reach their homes; glibc keeps what is freed inside the heap resident, free,
for the next allocation (the next forward's activations). A gradient home carved from an arena
could never be that next allocation, so at the end of backward the process held every home and,
free, the activations they replaced (on gpt2-124m 471 MiB of homes beside 549 MiB of free heap),
and at the start of backward the homes again, idle since their update. Plain PyTorch's `.grad`
is the tensor autograd allocated from that heap, freed at zero_grad(set_to_none=True). So on the
CPU with one rank (MemoryPlan.grad_homes_lent) a gradient home the compute adds into in place is
lent: no flat tensor (Home.tensor stays None), but one piece per parameter (Home.pieces), its
first gradient of the step itself (`_owned`: autograd's tensor, no copy, where it is a plain fp32
tensor in the parameter's strides in the flat buffers; else a copy in those strides, read back as
ParamLayout.flatten, so a channels-last weight's elements meet its state's), the later
micro-batches' added into it; all dropped once the group's update has read them (discard_home,
at the group's next load: the next forward's activations reuse the memory). A flat home allocated from the heap per step was tried first: on
gpt2-124m its blocks' 28 MB homes found no hole that large among backward's freed activations and
grew the heap by their size (peak RSS 2.00 GiB against 2.14 in the arena); per parameter, as
plain PyTorch, 1.80 GiB. The bytes count against the tier's budget once, at build, as an arena
home's do; nothing is kept across steps, since the first gradient of a step is copied into a home,
never added, and the update skips a parameter without one. The optimizer splits the pieces per
update chunk (`split` in `StreamingOptimizer._update_chunk`; no view of them is cached: they are new each
step). Accelerators keep arena homes: their activations are not on the host heap, and their host
homes must be pinned. Several ranks keep them too (their reduced shards reach the home flat).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from io_engine import IOHandle

from offload_trainer.config import Tier
from offload_trainer.runtime.collectives import CollectiveWork, Collectives
from offload_trainer.runtime.device.pending import DONE, Pending, all_of
from offload_trainer.runtime.groups.buffer_pool import BufferPool
from offload_trainer.runtime.groups.homes import Home
from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.groups.tiers import MemoryTiers
from offload_trainer.runtime.layout.partition import ParamLayout
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.trace import Tracer


@dataclass
class _Stage:
    """One group's gradients of this micro-batch, gathered in a host staging buffer."""

    group: ShardGroup
    buffer: torch.Tensor
    fresh: List[bool]
    """Per parameter: its gradient of this micro-batch is in the buffer (or on its way there)."""
    micro_batch: int
    """The micro-batch whose gradients these are (a later one's go into a new entry, this one merged
    first: [Note: Merges left for later])."""
    final: bool
    """Whether that micro-batch is the step's last (its merge takes the final gradients' norms)."""
    num_fresh_trainable: int = 0
    """How many of the trainable parameters are fresh (the group is complete at all of them)."""
    copies: List[Pending] = field(default_factory=list)
    """The copies off the device still filling the buffer."""
    regions: Optional[List[torch.Tensor]] = None
    """Each parameter's flat region of the buffer (kept by the staging pool, see on_grad)."""


@dataclass
class _FlushHolds:
    """The staging buffers one flush holds until they go back or its write takes them, and the read
    in flight into one of them ([Note: A flush interrupted])."""

    buffers: List[torch.Tensor]
    read: Optional[IOHandle] = None


@dataclass
class _ReducedMerge:
    """This rank's reduced shard of a group, in host memory, to be added into its host or NVMe home."""

    group: ShardGroup
    incoming: torch.Tensor
    """The shard (its trainable elements), in `buffer` or (the CPU) the reduce-scatter's scratch."""
    buffer: Optional[torch.Tensor]
    """The staging buffer it was copied off the device into (None: the CPU's scratch, read at once)."""
    copy: Pending
    """That copy."""
    first: bool
    """The step's first shard of the group to reach its home (copied in, not added)."""
    final: bool
    """Of the step's last micro-batch (the merge takes the final gradients' norms)."""


def _owned(grad: torch.Tensor, layout: ParamLayout) -> torch.Tensor:
    """A parameter's first gradient of a step as a lent home's piece, in the strides the parameter has
    in its group's flat buffers (`layout`: row-major, or its own, e.g. channels-last): autograd's own
    tensor where it is a plain fp32 tensor of exactly its elements in those strides (the engine holds
    the only reference once `.grad` is cleared), else an fp32 copy in them (a view, a gradient of other
    strides, one with a graph of its own). Its elements in memory order are then those a copy into an
    arena home would hold: the optimizer and the norms read it as `layout.flatten(piece)`, a view
    ([Note: Gradient homes lent from the heap])."""
    if (
        grad.dtype is torch.float32
        and not grad.requires_grad
        and grad._base is None
        and (grad.is_contiguous() if layout.stride is None else grad.stride() == layout.stride)
        and grad.storage_offset() == 0
        and grad.untyped_storage().nbytes() == grad.numel() * 4
    ):
        return grad
    if layout.stride is None:
        return grad.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return torch.empty_strided(layout.shape, layout.stride, dtype=torch.float32, device=grad.device).copy_(grad)


def _to_nvme(group: ShardGroup) -> bool:
    """Whether the group's gradient home is on NVMe (a merge into it reads the home into a second buffer)."""
    return group.grad_home is not None and group.grad_home.tier is Tier.NVME


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
        self.accel = tiers.accelerator
        self.tracer = tracer if tracer is not None else Tracer()
        self.collectives = collectives
        self.buckets = buckets
        self.scratch = scratch
        self._bucket: Dict[int, Tuple[ShardGroup, torch.Tensor, List[bool]]] = {}
        self._reducing: Optional[Tuple[ShardGroup, torch.Tensor, torch.Tensor, CollectiveWork]] = None
        """The reduce-scatter in flight: (group, its bucket, the scratch shard it fills, the work)."""
        self._scratch_readers: List[Pending] = []
        """The copy off the device that last read the scratch: the next reduce-scatter writes it after."""
        self._merges: Dict[int, "_ReducedMerge"] = {}
        """Per group index, in the order they came: its reduced shard copied off the device and not yet
        added into its home (one per group at most: [Note: Merges left for later])."""
        self.staging = staging
        self.reclaim_staging: Optional[Callable[[], bool]] = None
        """Gives back staging buffers held for later (the optimizer's read-ahead), True if it did:
        tried when nothing of the gradients' own can be freed (set by the engine)."""
        self.stats = stats
        self.grad_accum_steps = grad_accum_steps
        self.micro_batch = 0
        """Index of the running micro-batch within the optimizer step."""
        self._stage: Dict[int, _Stage] = {}
        self._ready: List[int] = []
        """Groups whose gradients are all staged, in the order they completed, waiting to be flushed."""
        self._writes: List[Tuple[IOHandle, torch.Tensor, Home]] = []
        """Gradient writes in flight: (handle, staging buffer to free, home being written)."""
        self._held: List[_FlushHolds] = []
        """Per flush that raised: the staging buffers it held and the read in flight into one
        ([Note: A flush interrupted]), given back at abandon_step or drain."""
        self.norms: Dict[int, torch.Tensor] = {}
        """model.parameters() index -> norm of its final gradient (filled on the last micro-batch)."""
        self._got_grad: Dict[int, List[bool]] = {}
        """Per group index, per parameter: did any micro-batch of this step produce a gradient for it."""
        self._reduced: Dict[int, int] = {}
        """Per group index (several ranks): reduce-scatters of this step whose gradients reached the home."""
        self._local_got: Dict[int, Tuple[ShardGroup, List[bool]]] = {}
        """Per group index (several ranks): per parameter, whether this rank's backward gave it a gradient
        this step (the reduced home holds zeros for one that no rank's did; agree_got)."""
        self._home_views: Dict[int, List[torch.Tensor]] = {}
        """Per group index whose grad home is added into in place: each parameter's view of the home,
        in its shape, made once for the engine's life (the home never moves); for a lent home, its
        pieces themselves (Home.pieces, the same list)."""
        self._num_trainable: Dict[int, int] = {}
        """Per group index: its trainable parameters (made once)."""
        self._norms_due: Dict[int, ShardGroup] = {}
        """Groups added into in place on the last micro-batch whose norms end_backward takes."""
        self._discarded: Set[int] = set()
        """Group indices whose grad home discard_home() gave back this step (so it is done once)."""

    @property
    def final_micro_batch(self) -> bool:
        return self.micro_batch + 1 >= self.grad_accum_steps

    def begin_step(self) -> None:
        """Forget the last optimizer step's gradients: the next backward starts a new accumulation."""
        self._drop_unmerged()
        self.micro_batch = 0
        self.norms = {}
        self._norms_due = {}
        self._got_grad = {}
        self._reduced = {}
        self._local_got = {}
        self._discarded = set()

    def abandon_step(self) -> None:
        """A backward raised part-way (one rank): forget this step's gradients, its earlier
        micro-batches' too, as plain PyTorch's `optimizer.zero_grad()` after the error would; the
        next backward starts the step's accumulation over. What it had staged is given back once
        its copies and writes are done; the homes are overwritten by the next first gradient
        (begin_step), so what the abandoned backward left in them is never read."""
        assert self.collectives.world_size == 1, "a backward that raised cannot be abandoned on several ranks"
        self._drop_unmerged()
        self.drain()
        self._give_back_held()
        self.begin_step()

    def discard_home(self, group: ShardGroup) -> None:
        """Give the memory of the group's grad home back while it holds nothing live: no gradient of
        this step has reached it yet, and its last step's values have been used (the caller waited
        for the group's update). The first gradient of the step is copied into the home, not added
        (on_grad, flush, _finish_reduce), so what it reads meanwhile never matters. A lent home's
        tensor goes back to torch's allocator (the next forward's activations reuse it: [Note:
        Gradient homes lent from the heap]); an arena's pages go back to the OS, and come back as
        the next backward writes them (MemoryTiers.discard: under tiers.release_idle_memory, and
        nothing where its memory cannot be discarded). A memory home only, once per step. This keeps
        the homes, like plain PyTorch's `.grad` after zero_grad(), out of the resident set from the
        update to the next backward, the forward's activations included (docs/design.md, Memory)."""
        home = group.grad_home
        if home is None or group.index in self._got_grad or group.index in self._discarded:
            return
        if home.lent:
            if home.pieces is not None:
                self._discarded.add(group.index)
                home.pieces = None
                self._home_views.pop(group.index, None)  # the same list
            return
        if home.tensor is None:
            return
        self._discarded.add(group.index)
        self.tiers.discard(home.tensor)

    def _drop_unmerged(self) -> None:
        """Give back the staging buffers of gradients not merged into their homes (this micro-batch's,
        or an earlier one's left for later: [Note: Merges left for later]), once their copies are
        done: their step is abandoned or started over."""
        for entry in self._stage.values():
            for copy in entry.copies:
                self.accel.host_waits(copy, "gradient copy")
            self.staging.give(entry.buffer)  # type: ignore[union-attr]
        self._stage = {}
        self._ready = []
        for merge in self._merges.values():
            self.accel.host_waits(merge.copy, "gradient copy")
            if merge.buffer is not None:
                self.staging.give(merge.buffer)  # type: ignore[union-attr]
        self._merges = {}

    def resume_micro_batch(self, index: int) -> None:
        """The gradients that follow belong to micro-batch `index` of this step (a layer-major step
        hands each unit's gradients, its micro-batches summed, over as the last micro-batch's, and ends
        them with end_backward; runtime/layer_major.py)."""
        assert 0 <= index <= self.grad_accum_steps, f"micro-batch {index} of {self.grad_accum_steps}"
        assert not self._bucket, "a piece of backward left gradients unreduced"
        # Merges left for later may be of any micro-batch (an earlier unit's last one): a group's entry
        # is merged before a gradient of another micro-batch goes in (on_grad), so its home still sees
        # its micro-batches in order ([Note: Merges left for later]).
        self.micro_batch = index

    def got_grad(self, group: ShardGroup) -> List[bool]:
        """Per parameter of `group`: whether this step's micro-batches gave it a gradient (read-only)."""
        return self._got_grad.get(group.index) or [False] * len(group.plan.params)

    def _mark(self, group: ShardGroup) -> List[bool]:
        got = self._got_grad.get(group.index)
        if got is None:  # made once per group per step, not per gradient
            got = self._got_grad[group.index] = [False] * len(group.plan.params)
        return got

    def is_staged(self, home: Home) -> bool:
        """Whether gradients reach `home` through host staging (else the compute adds into it in place)."""
        return home.tier is Tier.NVME or (home.tier is Tier.HOST and not self.accel.is_host)

    # -- one rank --------------------------------------------------------------------------------

    def on_grad(self, group: ShardGroup, i: int, grad: torch.Tensor) -> None:
        """Called once per parameter per backward, after autograd has summed all its contributions."""
        gi = group.index
        views = self._home_views.get(gi)
        if views is not None:  # the common case on one rank: add into the home in place
            got = self._got_grad.get(gi)
            if got is None:
                got = self._mark(group)
            if got[i]:
                views[i].add_(grad)
            else:
                view = views[i]
                if view is None:  # a lent home's: the gradient itself, where it can be
                    views[i] = _owned(grad, group.plan.params[i])
                else:
                    view.copy_(grad)
                got[i] = True
            if self.micro_batch + 1 >= self.grad_accum_steps:  # final_micro_batch, inline
                self._norms_due[gi] = group
            return
        layout = group.plan.params[i]
        flat_grad = layout.flatten(grad)
        if self.collectives.world_size > 1:
            self._into_bucket(group, i, flat_grad)
            return
        home = group.grad_home
        if home is None and layout.numel == 0:
            # An empty parameter in a group with nothing else to train: nothing to keep but its norm,
            # 0, which clip_grad_norm_ counts too (its place in the stack of norms changes the sum).
            self.norms[layout.index] = torch.zeros(())
            return
        assert home is not None, f"group {group.plan.name} got a gradient but has no grad home"
        if not self.is_staged(home):
            if home.lent:  # its pieces, filled by each parameter's first gradient of the step
                if home.pieces is None:
                    home.pieces = [None] * len(group.plan.params)
                self._home_views[group.index] = home.pieces  # type: ignore[assignment]
            else:
                self._home_views[group.index] = self._views_of(group, home.tensor)
            self.on_grad(group, i, grad)
            return
        entry = self._staging_for(group)
        if entry.fresh[i] or entry.micro_batch != self.micro_batch:
            # A second gradient of this parameter in one backward: autograd accumulates once per
            # backward, but a nested backward accumulates on its own (a reentrant checkpoint of a
            # module called twice, a reversible block). The staged one goes to the home first (the
            # region would be overwritten), and this one into a new entry, added to it at its flush.
            # So does an earlier micro-batch's entry whose merge was left for later ([Note: Merges
            # left for later]): its copies were issued a whole forward ago.
            self.flush(group)
            entry = self._staging_for(group)
        if entry.regions is None:  # each parameter's region of this staging buffer, made once per (buffer, group)
            entry.regions = self.staging.cached_views(  # type: ignore[union-attr]
                entry.buffer, group.index, lambda: self._views_of(group, entry.buffer, flat=True)
            )
        region = entry.regions[i]
        if self.accel.is_host:
            if self.tracer.active:  # once per parameter: no clock reads nor span where nothing records
                start = self.tracer.now()
                region.copy_(flat_grad)
                self.tracer.span("gradient copies", f"copy {layout.name}", start, self.tracer.now())
            else:
                region.copy_(flat_grad)
        else:
            copy = self.accel.d2h(region, flat_grad)
            self.stats.d2h_bytes += layout.numel * 4
            self.tracer.io("gradient copies", f"copy {layout.name}", copy)
            entry.copies.append(copy)
        if not entry.fresh[i]:
            entry.fresh[i] = True
            entry.num_fresh_trainable += 1
            if entry.num_fresh_trainable == self._trainable(group):
                self._ready.append(group.index)
        if self._ready:  # once per parameter: no call while no group is complete
            self._flush_ready(block=False)

    def _views_of(self, group: ShardGroup, buffer: Optional[torch.Tensor], flat: bool = False) -> List[torch.Tensor]:
        """Each trainable parameter's view of `buffer` (a grad home or a staging buffer), in the
        parameter's shape (or flat). A frozen parameter (LoRA's base weights) gets none: it never
        has a gradient, and a grad home holds only the trainable part of the group."""
        assert buffer is not None
        params = group.plan.params
        views = [buffer[p.offset_numel : p.offset_numel + p.numel] if p.requires_grad else None for p in params]
        if flat:
            return views  # type: ignore[return-value]
        return [p.view(v) if v is not None else None for v, p in zip(views, params)]  # type: ignore[misc]

    def _trainable(self, group: ShardGroup) -> int:
        n = self._num_trainable.get(group.index)
        if n is None:
            n = self._num_trainable[group.index] = sum(p.requires_grad for p in group.plan.params)
        return n

    def _take_norms(self, flat: torch.Tensor, group: ShardGroup, which: List[int]) -> None:
        """The final gradient norms of the group's parameters `which` (indices into plan.params), read
        from `flat` (laid out as the group's flat buffer), in one call."""
        if not which:
            return
        params = group.plan.params
        views = [flat[params[i].offset_numel : params[i].offset_numel + params[i].numel] for i in which]
        self._store_norms([params[i].index for i in which], views)

    def _store_norms(self, indices: Sequence[int], views: List[torch.Tensor]) -> None:
        """The norm of each of `views` as that of model parameter `indices` (model.parameters()
        order): one _foreach_norm, as clip_grad_norm_ takes them (on the CPU bitwise
        linalg_vector_norm's, whatever the views' shapes: a contiguous tensor is reduced as one run
        of elements; each tensor's norm is its own, whatever else is in the call)."""
        for index, norm in zip(indices, torch._foreach_norm(views, 2)):
            self.norms[index] = norm

    def _take_due_norms(self) -> None:
        """The norms of the groups added into in place on the last micro-batch (end of a backward),
        all in one _store_norms (the values are those of one call per group)."""
        if not self._norms_due:
            return
        indices: List[int] = []
        views: List[torch.Tensor] = []
        for group in self._norms_due.values():
            home_views = self._home_views[group.index]
            params = group.plan.params
            for i, g in enumerate(self._got_grad[group.index]):
                if g:
                    indices.append(params[i].index)
                    views.append(home_views[i])
        self._store_norms(indices, views)
        self._norms_due = {}

    def _staging_for(self, group: ShardGroup) -> _Stage:
        entry = self._stage.get(group.index)
        if entry is None:
            self._keep_one_for_merges(group, group.plan.shard_numel)
            entry = _Stage(
                group, self._take_staging(group.plan.shard_numel), [False] * len(group.plan.params),
                self.micro_batch, self.final_micro_batch,
            )
            self._stage[group.index] = entry
        return entry

    def _keep_one_for_merges(self, group: ShardGroup, numel: int) -> None:
        """Before `group`'s gradients (a new entry, or on several ranks its reduced shard) take a
        staging buffer of `numel`'s size class: merge what holds buffers of that class (staged entries,
        reduced shards) until, the new one taken, a buffer of it is still free or coming back from a
        write.

        [Note: A merge's second buffer]
        Once a step has gradients in its homes, merging gradients held in a staging buffer into an
        NVMe home holds two buffers of its class at once (the gradients and the home read back to add
        them to). Gradients stay in their buffer until their copies land (late on an accelerator), so
        where a step has more groups of a class than that class has buffers (a tree of many small
        modules), every buffer could be held by gradients waiting for their merge: the merge that
        frees one then found none for its read, and merged others to get one, which needed one too,
        until "no host staging buffer is free and none can be freed". One rank's staged entries (a
        flush) and several ranks' reduced shards copied off the device ([Note: Merges left for later])
        are held alike: under CUDA the host runs ahead of the GPU through backward, so every reduced
        shard of a class could be waiting for its copy. A merge here has a buffer for its read, and
        gives its own back: each leaves one more free or writing, so the loop ends. A merge into a
        host home adds in place and needs no second buffer: where none of the class goes to NVMe
        nothing is merged early (under CUDA each early merge waits for the GPU on the host, [Note:
        Host waits in a step] in runtime/device/accelerator.py)."""
        if not self._got_grad or self.staging is None:
            return  # nothing in the homes yet: a merge holds one buffer
        size = self.staging.class_numel(numel)
        while True:
            spare = self.staging.num_free_of_class(numel) + sum(1 for _, b, _ in self._writes if b.numel() == size)
            if spare >= 2:
                return
            same = [e for e in self._stage.values() if self.staging.class_numel(e.group.plan.shard_numel) == size]
            reduced = [m for m in self._merges.values() if m.buffer is not None and m.buffer.numel() == size]
            holders = [e.group for e in same] + [m.group for m in reduced]
            if not holders or not any(_to_nvme(g) for g in (group, *holders)):
                return
            if same:
                self.flush(same[0].group)
            else:
                self._add_reduced(self._merges.pop(reduced[0].group.index))

    def _take_staging(self, numel: int) -> torch.Tensor:
        """A host staging buffer of at least `numel` fp32 elements (its size class: buffer_pool.py)."""
        assert self.staging is not None, "staged gradients need host staging buffers"
        while True:
            buffer = self.staging.take(numel)
            if buffer is not None:
                return buffer
            if self._writes:
                self._reap(block=True)
            elif self._ready:
                self._flush_ready(block=True, limit=1)
            elif self._stage:
                self.flush(next(iter(self._stage.values())).group)
            elif self._merges:  # the oldest reduced shard waiting for its merge (never one being merged)
                self._add_reduced(self._merges.pop(next(iter(self._merges))))
            elif self.reclaim_staging is None or not self.reclaim_staging():
                raise RuntimeError("no host staging buffer is free and none can be freed")

    def _flush_ready(self, block: bool, limit: Optional[int] = None) -> None:
        """Flush the complete groups whose copies are done (all of them, or `limit` of them, if `block`)."""
        flushed = 0
        for gi in list(self._ready):
            if limit is not None and flushed >= limit:
                break
            entry = self._stage.get(gi)
            if entry is not None and (block or all(c.done() for c in entry.copies)):
                self.flush(entry.group)
                flushed += 1

    def _reap(self, block: bool) -> None:
        """Give back the staging buffers of the writes that are over (the first one waited for if `block`)."""
        if block and self._writes:
            self._finish_write(0)
        i = 0
        while i < len(self._writes):
            if self._writes[i][0].done():
                self._finish_write(i)
            else:
                i += 1

    def _finish_write(self, i: int) -> None:
        """Wait for write i; once it is over, failed or not, it leaves the list and its buffer goes back,
        in that order: a write that failed (raised here) or a wait interrupted (Ctrl-C) never gives a
        buffer back twice, nor keeps one that is free."""
        handle, buffer, _ = self._writes[i]
        try:
            handle.wait()
        finally:
            if handle.done():
                del self._writes[i]
                self.staging.give(buffer)  # type: ignore[union-attr]

    def _read_after_writes(self, home: Home, into: torch.Tensor, holds: _FlushHolds) -> None:
        """Read `home` into `into` once every write to it still in flight has landed; the read's
        handle goes into `holds` as soon as it is issued (see flush)."""
        for handle, _, pending in self._writes:
            if pending is home:
                handle.wait()
        handle = home.start_read(self.tiers, into)
        assert handle is not None
        holds.read = handle
        handle.wait()
        self.stats.add_bytes(self.stats.bytes_read, Tier.NVME, home.nbytes)

    def flush(self, group: ShardGroup) -> None:
        """Merge the group's staged micro-batch gradients into its home (host memory or NVMe).

        [Note: A flush interrupted]
        Its waits (the copies, the writes before its read, the read) may raise: a Ctrl-C lands
        there, or an IO error. The entry leaves `_stage` only once its copies are done, so until
        then abandon_step finds it; after that, the buffers the flush holds (the staged gradients,
        the buffer the home is read into, and the read in flight into it) are kept in `_held` on
        the way out, and given back only once nothing writes them any more (`_give_back_held`, at
        abandon_step and drain). Before, they were lost, and every step after a Ctrl-C there failed
        with "all host staging buffers are busy"."""
        entry = self._stage.get(group.index)
        if group.index in self._ready:
            self._ready.remove(group.index)
        if entry is None:
            return
        # The host reads the staged gradients next: under CUDA this waits for the GPU to reach the
        # group's last gradient ([Note: Host waits in a step] in runtime/device/accelerator.py).
        for copy in entry.copies:
            self.accel.host_waits(copy, "gradient copy")
        del self._stage[group.index]
        holds = _FlushHolds([entry.buffer])
        try:
            self._merge(group, entry, holds)
        except BaseException:
            self._held.append(holds)
            raise

    def _give_back_held(self) -> None:
        """Give back the buffers of interrupted flushes, once the reads into them are over."""
        for holds in self._held:
            if holds.read is not None:
                try:
                    holds.read.wait()
                except Exception:  # noqa: BLE001 - the read's own error was raised where it was waited for
                    pass
            for buffer in holds.buffers:
                self.staging.give(buffer)  # type: ignore[union-attr]
        self._held = []

    def _merge(self, group: ShardGroup, entry: _Stage, holds: _FlushHolds) -> None:
        """flush's work once the entry's copies are done; every buffer it takes goes into `holds`
        until it is given back or handed to a write."""
        stage, fresh = entry.buffer, entry.fresh
        home = group.grad_home
        assert home is not None
        got = self._mark(group)
        params = group.plan.params
        which = [i for i, f in enumerate(fresh) if f]
        if home.tier is Tier.HOST:
            assert home.tensor is not None
            for i in which:
                p = params[i]
                view = home.tensor[p.offset_numel : p.offset_numel + p.numel]
                (view.add_ if got[i] else view.copy_)(stage[p.offset_numel : p.offset_numel + p.numel])
                got[i] = True
            if entry.final:
                self._take_norms(home.tensor, group, which)
            holds.buffers = []
            self.staging.give(stage)  # type: ignore[union-attr]
            return
        numel = group.plan.trainable_numel
        out = stage
        # The write below covers the whole shard: where the home holds any of this step's gradients
        # already (an earlier entry of the group flushed early, [Note: A merge's second buffer], or a
        # micro-batch before), it is read back and only the fresh parameters change. Asked of the
        # fresh parameters alone, a second entry of other parameters wrote its buffer's stale regions
        # over the first entry's gradients (the root's group: the head's flushed early, the embedding's after).
        if any(got):
            old = self._take_staging(group.plan.shard_numel)
            holds.buffers.append(old)
            self._read_after_writes(home, old[: home.numel], holds)
            for i, f in enumerate(fresh):
                p = params[i]
                if not f:
                    continue
                if got[i]:
                    old[p.offset_numel : p.offset_numel + p.numel].add_(stage[p.offset_numel : p.offset_numel + p.numel])
                else:
                    old[p.offset_numel : p.offset_numel + p.numel].copy_(stage[p.offset_numel : p.offset_numel + p.numel])
            holds.buffers = [old]
            self.staging.give(stage)  # type: ignore[union-attr]
            out = old
        for i in which:
            got[i] = True
        if entry.final:
            self._take_norms(out, group, which)
        handle = home.start_write(self.tiers, out[:numel][: home.numel])
        self._writes.append((handle, out, home))  # the write's buffer from here on, not the flush's
        holds.buffers = []
        self.stats.add_bytes(self.stats.bytes_written, Tier.NVME, home.nbytes)
        self.tracer.io("gradient writes", f"write {group.plan.name}", handle)
        self._reap(block=False)

    def end_backward(self, pieces_follow: bool = False) -> None:
        """The micro-batch is over: its reduce-scatters are issued and finished, and its staged groups
        merged into their homes, at the end of the step's backward every one (merge_all: the step
        reads the homes next), before it those whose copies off the device are done. `pieces_follow`:
        this backward is a piece of the step's, and more of it follows whatever the micro-batch (a
        layer-major unit but the last, which runs the last micro-batch's piece of every block:
        runtime/layer_major.py, which calls merge_all once its last unit is done).

        [Note: Merges left for later]
        Merging a staged group reads its gradients on the host, so it waits for their copies off the
        device, and under CUDA for the GPU to reach the backward kernels that made them. Made at the
        end of every backward, that wait let the next micro-batch's forward be issued only once the
        GPU had finished this backward: the host's run-ahead, which keeps the GPU fed, was gone at
        each micro-batch. So before the step's last micro-batch a group whose copies are not done
        stays staged, and is merged later: once its copies are (polled at each gradient), when the
        group's next gradient comes (the next micro-batch's, a forward later), when a staging buffer
        is needed, or at the end of the step's last backward, which waits for the GPU anyway (the
        step reads the homes). Each group's micro-batches still reach its home in order, so the sums
        are bitwise those of merging at once. A step abandoned or started over (abandon_step,
        begin_step at a checkpoint's load) drops what is left.
        A layer-major step closes the last micro-batch's piece of every unit (each block, the end, the
        begin) with an end_backward: each merged all at once, so under CUDA the host waited for the GPU
        to finish every block's backward before it could issue the next block's recomputation and
        backward (a bubble per block, in an hhh step 9 host waits per block on the fakes of
        runtime/device/test_cuda_host_waits.py). Those pieces leave their merges for later too
        (`pieces_follow`), and the schedule merges all once its last unit is done.
        On several ranks a reduced shard bound for a host or NVMe home goes the same way: the host
        waited for its copy off the device at once, once per group in backward, since the next
        reduce-scatter rewrites the scratch it is copied from. Now that reduce-scatter waits for the
        copy on its stream (collective's `after`), and the shard, in a staging buffer of its own, is
        added into the home once its copy is done (polled at each reduce-scatter), at the group's
        next shard, when a staging buffer is needed, or at the end of the step's last backward."""
        for gi in sorted(self._bucket):
            self._flush_bucket(self._bucket[gi][0])
        self._finish_reduce()
        if self.final_micro_batch and not pieces_follow:
            self.merge_all()
        else:
            self._merge_reduced(block=False)
            self._flush_ready(block=False)
            for entry in list(self._stage.values()):
                if all(c.done() for c in entry.copies):
                    self.flush(entry.group)
        self._take_due_norms()
        self.micro_batch += 1

    def merge_all(self) -> None:
        """Merge every staged group and every reduced shard into its home, waiting for their copies
        off the device: the step's backward is over, and the step reads the homes next."""
        self._merge_reduced(block=True)
        self._flush_ready(block=True)
        for entry in list(self._stage.values()):
            self.flush(entry.group)

    # -- several ranks ---------------------------------------------------------------------------

    def _into_bucket(self, group: ShardGroup, i: int, flat_grad: torch.Tensor) -> None:
        entry = self._bucket.get(group.index)
        if entry is None:
            assert self.buckets is not None
            bucket = self.buckets.take()
            if bucket is None:  # the reduce-scatter in flight still reads one: finish it first
                self._finish_reduce()
                bucket = self.buckets.take()
            if bucket is None:
                # Every bucket waits for a parameter without a gradient yet (an unused one, say): the
                # oldest is reduced now, the same one on every rank (autograd's order is theirs).
                self._flush_bucket(self._bucket[next(iter(self._bucket))][0])
                self._finish_reduce()
                bucket = self.buckets.take()
            assert bucket is not None, "no gradient bucket free"
            # Its last reader (the reduce-scatter) is done for the compute that follows: a stream wait
            # under CUDA, where a host wait stalled backward until the device caught up with it.
            self.accel.compute_waits(all_of(self.buckets.reuse_after(bucket)), "bucket reuse")
            bucket = bucket[: group.plan.flat_numel]
            bucket.zero_()
            entry = (group, bucket, [False] * len(group.plan.params))
            self._bucket[group.index] = entry
        p = group.plan.params[i]
        region = entry[1][p.offset_numel : p.offset_numel + p.numel]
        # Added where this backward gave it one already (a nested backward's: see the staged path).
        (region.add_ if entry[2][i] else region.copy_)(flat_grad)
        entry[2][i] = True
        local = self._local_got.get(group.index)
        if local is None:
            local = self._local_got[group.index] = (group, [False] * len(group.plan.params))
        local[1][i] = True
        if all(entry[2][j] for j, q in enumerate(group.plan.params) if q.requires_grad):
            self._flush_bucket(group)

    def _flush_bucket(self, group: ShardGroup) -> None:
        """Issue the reduce-scatter of the group's bucket (a collective, in autograd's order on every
        rank), after finishing the one in flight (whose output scratch it reuses) and, on the comm
        stream under CUDA, after the copy off the device that last read the scratch."""
        _, bucket, _ = self._bucket.pop(group.index)
        assert self.scratch is not None and self.buckets is not None
        self._finish_reduce()
        shard = self.scratch[: group.plan.shard_numel]
        with self.accel.collective(after=self._scratch_readers):
            work = self.collectives.start_reduce_scatter_mean(shard, bucket, group.plan.name)
        self._scratch_readers = []
        self._reducing = (group, bucket, shard, work)

    def _finish_reduce(self) -> None:
        """Wait for the reduce-scatter in flight (if any) and accumulate this rank's shard into its home:
        a device home at once; a host or NVMe home on an accelerator through a copy off the device,
        whose merge is left for later ([Note: Merges left for later]: a reduced shard's too)."""
        if self._reducing is None:
            return
        group, bucket, shard, work = self._reducing
        self._reducing = None
        work.finish()
        assert self.buckets is not None
        self.buckets.give(bucket, [self.accel.compute_done()])
        home = group.grad_home
        n = group.local_trainable_numel
        if home is None or n == 0:
            return
        first = self._reduced.get(group.index, 0) == 0
        self._reduced[group.index] = self._reduced.get(group.index, 0) + 1
        got = self._mark(group)
        for piece in group.pieces:
            got[piece.param] = True
        if not self.is_staged(home):
            assert home.tensor is not None
            target = home.tensor[:n]
            (target.copy_ if first else target.add_)(shard[:n])
            if self.final_micro_batch:
                self._take_reduced_norms(group, target)
            return
        if self.accel.is_host:
            self._add_reduced(_ReducedMerge(group, shard[:n], None, DONE, first, self.final_micro_batch))
            return
        # Under CUDA the host would wait here for the GPU to reach this group's reduce-scatter (once
        # per group in backward): the shard is copied off into a staging buffer, the next reduce-scatter
        # rewrites the scratch after that copy on its stream, and the host adds it into the home once
        # the copy is done.
        pending = self._merges.pop(group.index, None)
        if pending is not None:  # a group's shards reach its home in order
            self._add_reduced(pending)
        self._keep_one_for_merges(group, n)
        buffer = self._take_staging(n)
        copy = self.accel.d2h(buffer[:n], shard[:n])
        self.stats.d2h_bytes += n * 4
        self.tracer.io("gradient copies", f"copy {group.plan.name} shard", copy)
        self._scratch_readers = [copy]
        self._merges[group.index] = _ReducedMerge(group, buffer[:n], buffer, copy, first, self.final_micro_batch)
        self._merge_reduced(block=False)

    def _merge_reduced(self, block: bool) -> None:
        """Add the reduced shards copied off the device into their homes: those whose copies are done,
        or all of them if `block`."""
        for gi in list(self._merges):
            pending = self._merges.get(gi)
            if pending is not None and (block or pending.copy.done()):
                del self._merges[gi]
                self._add_reduced(pending)

    def _add_reduced(self, merge: "_ReducedMerge") -> None:
        """Add one reduced shard (host memory) into its group's host or NVMe home, once its copy off the
        device is done; an NVMe home is written (read and added first, but for the step's first)."""
        # The host reads the shard next: under CUDA a wait for the GPU to reach the group's
        # reduce-scatter ([Note: Host waits in a step] in runtime/device/accelerator.py).
        self.accel.host_waits(merge.copy, "gradient copy")
        group, incoming, owned = merge.group, merge.incoming, merge.buffer
        home = group.grad_home
        assert home is not None
        n = incoming.numel()
        if home.tier is Tier.HOST:
            assert home.tensor is not None
            target = home.tensor[:n]
            (target.copy_ if merge.first else target.add_)(incoming)
            if owned is not None:
                self.staging.give(owned)  # type: ignore[union-attr]
        elif merge.first and owned is not None:
            target, owned = incoming, owned  # written as it came off the device
        else:
            buf = self._take_staging(n)
            holds = _FlushHolds([buf] if owned is None else [buf, owned])
            try:
                if merge.first:
                    buf[:n].copy_(incoming)
                else:
                    self._read_after_writes(home, buf[:n], holds)
                    buf[:n].add_(incoming)
            except BaseException:
                self._held.append(holds)  # given back once the read is over ([Note: A flush interrupted])
                raise
            if owned is not None:
                self.staging.give(owned)  # type: ignore[union-attr]
            target, owned = buf[:n], buf
        if merge.final:
            self._take_reduced_norms(group, target)
        if home.tier is Tier.NVME:
            assert owned is not None
            handle = home.start_write(self.tiers, target)
            self.stats.add_bytes(self.stats.bytes_written, Tier.NVME, home.nbytes)
            self.tracer.io("gradient writes", f"write {group.plan.name}", handle)
            self._writes.append((handle, owned, home))

    def _take_reduced_norms(self, group: ShardGroup, shard: torch.Tensor) -> None:
        """The final gradient norms of the group's parameter pieces in this rank's reduced `shard`."""
        for piece in group.pieces:
            view = shard[piece.shard_offset : piece.shard_offset + piece.numel]
            self.norms[group.plan.params[piece.param].index] = torch.linalg.vector_norm(view, 2)

    def local_got(self, num_params: int) -> torch.Tensor:
        """(Several ranks.) Per model parameter (model.parameters() order), float64: 1 where this rank's
        backward gave it a gradient this step, else 0; summed over the ranks for agree_got."""
        flags = torch.zeros(num_params, dtype=torch.float64)
        for group, got in self._local_got.values():
            for layout, g in zip(group.plan.params, got):
                if g:
                    flags[layout.index] = 1.0
        return flags

    def agree_got(self, num_ranks_got: torch.Tensor) -> None:
        """(Several ranks.) `num_ranks_got`: local_got summed over the ranks. A parameter has a gradient
        this step where any rank's backward gave it one; the others (unused by every rank) are skipped
        by the update, their reduced zeros left unread."""
        counts = num_ranks_got.tolist()
        for gi, got in self._got_grad.items():
            if gi in self._local_got:
                for i, layout in enumerate(self._local_got[gi][0].plan.params):
                    got[i] = counts[layout.index] > 0

    def drain(self) -> None:
        """Wait for every gradient write (before the optimizer reads the homes)."""
        while self._writes:
            self._finish_write(0)
        if self._held:
            self._give_back_held()
