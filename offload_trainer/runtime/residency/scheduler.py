"""PrefetchScheduler: which groups' parameters are on the device, and when they get there.

The engine's hook callbacks tell it what is about to run (`acquire`), what has finished
(`release`), and which phase of the step is running (`begin`/`end`). It lends the device slots,
starts the loads of groups' parameters into them (ShardGroup.start_load), decides what to fetch
ahead from the recorded order (recorded_order.py), and evicts what that order says is used
farthest in the future. It moves parameters only: gradients.py moves gradients to their homes and
optimizer.py streams the optimizer states, each through the host staging buffers.

[Note: Residency rules]
- A group in use by a running forward (`in_use` > 0) is never evicted.
- During backward the groups of the latest backward acquisition are pinned; others may be
  evicted, farthest next use first. Correctness does not depend on this guess: saved tensors
  re-acquire their group on unpack (hooks.py), and a slot still referenced by any tensor is never
  handed out again (groups/buffer_pool.py).
- Prefetch looks `lookahead_groups` distinct groups ahead along the trace and only takes free
  slots, or slots of groups whose next use comes later than the prefetched group's.
- Slots are sized per group (the plan's largest groups, layout/memory_plan.py): a group takes the
  smallest free slot that holds it, and only a group whose slot holds the one being loaded is
  evicted for it.

[Note: All-gather ahead]
On several ranks a group's full parameters are an all-gather of the ranks' shards. At each
acquisition, once the acquired groups are bound and prefetch has started its loads, the next
group the trace predicts has its all-gather issued (GATHERING) if its load was started: it then
runs while the current group computes, and its acquisition only waits for what is left
(`all_gather_exposed_s` against `all_gather_total_s`). One group ahead at most, so one extra slot
at most is tied up. The step's end does the same for the next forward's first group. Which group
is gathered depends only on the trace and on residency, both identical on every rank (slot
lending is agreed), so every rank issues the same all-gathers in the same order ([Note:
Collectives in one order] in collectives.py); the check before each all-gather still refuses a
divergence. Issuing waits (on the host, on the CPU) for this rank's shard to be loaded; a
GATHERING group chosen for eviction is finished first, never abandoned (its peers issued it too).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Set

import torch

from offload_trainer.runtime.collectives import Collectives
from offload_trainer.runtime.device.pending import Pending, over
from offload_trainer.config import Tier
from offload_trainer.errors import PlanError
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.residency.phase import Phase
from offload_trainer.runtime.residency.recorded_order import OrderPhase, RecordedOrder
from offload_trainer.runtime.trace import Tracer
from offload_trainer.runtime.groups.shard_group import CopyState, ShardGroup
from offload_trainer.runtime.groups.buffer_pool import BufferPool
from offload_trainer.runtime.groups.tiers import MemoryTiers


class PrefetchScheduler:
    """Acquires, prefetches and evicts groups' device copies (gradients.py and optimizer.py move the rest)."""

    def __init__(
        self,
        groups: List[ShardGroup],
        tiers: MemoryTiers,
        order: RecordedOrder,
        device_slots: Optional[BufferPool],
        lookahead_groups: int,
        stats: StepStats,
        collectives: Collectives,
        lookahead_bytes: Optional[int] = None,
        tracer: Optional[Tracer] = None,
        param_staging: Optional[BufferPool] = None,
    ) -> None:
        """`param_staging`: host buffers that NVMe parameter reads land in before the copy path takes
        them to the device (an accelerator whose memory is not host memory)."""
        self.groups = groups
        self.param_staging = param_staging
        self.tracer = tracer if tracer is not None else Tracer()
        self.tiers = tiers
        self.order = order
        self.device_slots = device_slots
        self.lookahead_groups = lookahead_groups
        self.lookahead_bytes = lookahead_bytes
        self.stats = stats
        self.collectives = collectives
        self.phase = Phase.IDLE
        """The part of the step running (IDLE, FORWARD, BACKWARD); changed by begin() and end() only. An
        attribute, not a property: every hook and every gradient reads it."""
        self.in_use: Dict[int, int] = {}
        self.pinned: Set[int] = set()
        self._recent: Dict[int, None] = {}
        """Groups acquired and still resident, least recently used first (a dict kept in order)."""
        self._holding: Dict[int, ShardGroup] = {}
        """Groups whose device copy occupies a slot (LOADING or READY): the eviction candidates, so
        that finding a victim looks at the few resident groups, never at every group."""
        self.before_load: Callable[[int], None] = lambda gi: None
        """Called with a group's index before its parameter home is read: waits for that group's
        optimizer update still running behind this forward (optimizer_pipeline.py)."""
        self.fill_from_update: Callable[[int, torch.Tensor, Sequence[Pending]], Optional[Pending]] = (
            lambda gi, shard, after: None
        )
        """Tried first by a load of a group whose parameter home is on NVMe: (index, its shard in the
        slot, the slot's last users) -> what fills the shard from the optimizer update still running
        (OptimizerPipeline.fill_params), or None (before_load, then the home is read)."""
        self.after_fill: Callable[[int], None] = lambda gi: None
        """Called with a group's index once a load filled so has finished: its update is done."""
        self._filled: Set[int] = set()
        """Groups LOADING from a fill_from_update."""
        self.resident_by_storage: Dict[int, int] = {}
        """The storage key (storage_identity.py) of each READY group's device copy -> its index: a saved
        tensor's group is one lookup (hooks.py). Entered when a group becomes READY, removed when it is
        evicted."""
        self._last_in_slot: Dict[int, str] = {}
        """A device slot's address -> the name of the group last loaded into it (for refusals)."""

    # -- the phase -----------------------------------------------------------------------------

    def begin(self, phase: Phase) -> None:
        """A forward or a backward of the wrapped model begins (from IDLE)."""
        assert self.phase is Phase.IDLE and phase is not Phase.IDLE, f"begin {phase} during {self.phase}"
        self.phase = phase

    def end(self) -> None:
        """The forward or backward has returned (or raised): back to IDLE; backward's pins are dropped.

        A forward that raised (a bad batch, out of memory) left the groups of the modules it was
        inside in use (their forward hooks never ran): they are released here, as those modules'
        forwards have ended too, so that training can go on as it does in plain PyTorch once the
        caller has caught the error."""
        self.pinned = set()  # backward's, or a forward's reads outside every module's use
        if self.phase is Phase.FORWARD and self.in_use:
            left = list(self.in_use)
            self.in_use = dict.fromkeys(left, 1)  # however deep the nesting was: one release ends it
            self.release(left)
        self.phase = Phase.IDLE

    # -- acquisition ---------------------------------------------------------------------------

    def acquire(self, group_ids: Sequence[int], backward: bool = False) -> None:
        """Make each group's full parameters resident and bound; blocks until they are. A backward
        acquisition pins its groups in place of the pins before; a forward's ends the pins of reads
        outside every module's use (ensure_resident: [Note: Reads of unbound parameters] in hooks.py)."""
        if backward:
            self.pinned = set(group_ids)
        elif self.pinned:
            self.pinned = set()
        order, groups, stats, recent = self.order, self.groups, self.stats, self._recent
        for gi in group_ids:
            hit = order.on_acquire(gi)
            group = groups[gi]
            state = group.state
            if state is CopyState.READY:
                stats.prefetch_hits += hit
            elif state is CopyState.LOADING or state is CopyState.GATHERING:
                stats.prefetch_hits += hit
                self._finish(group)
            else:
                stats.prefetch_misses += 1
                self._load(group, protect=set(group_ids))
                self._finish(group)
            if not backward:
                self.in_use[gi] = self.in_use.get(gi, 0) + 1
            recent.pop(gi, None)  # most recently used last
            recent[gi] = None
        if self.lookahead_groups > 0 and order.phase is OrderPhase.REPLAY:
            self._prefetch(protect=set(group_ids))
        if self.collectives.world_size > 1:
            self._gather_ahead(set(group_ids))

    def ensure_resident(self, gi: int) -> ShardGroup:
        """For a saved tensor being unpacked in backward, or a parameter read outside every module's use:
        the group, READY, pinned until the next acquisition."""
        group = self.groups[gi]
        if group.state is not CopyState.READY:
            self.stats.unpack_refetches += 1
            if group.state is CopyState.ABSENT:
                self._load(group, protect=self.pinned | {gi})
            self._finish(group)
        self.pinned.add(gi)
        self._touch(gi)
        return group

    def copy_for_unpack(self, gi: int) -> torch.Tensor:
        """The device copy of group `gi` for a saved tensor being unpacked (ensure_resident's result).
        A group of the running backward acquisition is READY and pinned already: its copy at once."""
        copy = self.groups[gi].resident_copy
        if copy is None or gi not in self.pinned:
            copy = self.ensure_resident(gi).resident_copy
            assert copy is not None
        return copy

    def unpin(self) -> None:
        """Drop backward's pins: a backward that acquired without a backward acquisition to replace
        them (a layer-major unit, runtime/layer_major.py) is over, and its saved tensors with it."""
        self.pinned = set()

    def release(self, group_ids: Sequence[int]) -> None:
        """A forward of a module that needed these groups has finished."""
        in_use = self.in_use
        for gi in group_ids:
            count = in_use.get(gi, 0) - 1
            if count > 0:
                in_use[gi] = count
                continue
            in_use.pop(gi, None)
            if not self.order.used_within(gi, self._horizon()):
                self._evict(self.groups[gi])

    def evict_all(self) -> None:
        """Drop every device copy (before the optimizer changes the homes they were read from). A group
        whose parameters were changed in place is evicted too, and its refusal (ValueError) raised once
        every group is: it stopped the eviction of the groups after it, so which groups stayed resident
        depended on the change, and on several ranks (a change one rank's loop made) the next forward's
        all-gathers differed between them ([Note: A step that failed on one rank] in collectives.py)."""
        assert not self.in_use, f"groups still in use: {sorted(self.in_use)}"
        self.pinned = set()
        refused: Optional[ValueError] = None
        for group in self.groups:
            if group.state is CopyState.LOADING:
                self._cancel(group)
            if group.state is CopyState.GATHERING:
                self._finish(group)
            if group.state is CopyState.READY:
                try:
                    self._evict(group)
                except ValueError as error:  # the group is evicted: its refusal waits for the others
                    refused = refused or error
        if refused is not None:
            raise refused

    def finish_gathers(self) -> None:
        """Wait for every all-gather in flight (before the slots they write are freed); issues none."""
        for group in self.groups:
            if group.state is CopyState.GATHERING:
                self._finish(group)

    def prefetch_next_step(self) -> None:
        """After the optimizer step: start loading the groups the next forward begins with, and
        the all-gather of the first of them (see [Note: All-gather ahead])."""
        self._prefetch(protect=set())
        self._gather_ahead(set())

    # -- internals -----------------------------------------------------------------------------

    def _horizon(self) -> int:
        return max(1, self.lookahead_groups) * 4

    def _touch(self, gi: int) -> None:
        self._recent.pop(gi, None)
        self._recent[gi] = None

    def _forget(self, gi: int) -> None:
        self._recent.pop(gi, None)
        self._holding.pop(gi, None)

    def _finish(self, group: ShardGroup) -> None:
        """LOADING or GATHERING -> READY (waiting for the load, counted), and its storage known.

        A load that failed (its read's EIO, raised here) is dropped, its slot lent again once the read
        is over: the group's next acquisition reads its home again. Kept LOADING, every later one
        raised the same error from the same failed read, the engine lost for good. A wait interrupted
        (Ctrl-C) keeps the load, still good, for the next acquisition to finish."""
        try:
            if group.is_loaded():
                group.finish_load(self.tiers, self.collectives)
            else:
                self._count_wait(group, lambda: group.finish_load(self.tiers, self.collectives))
        except Exception:
            # Still LOADING: no all-gather was issued (on several ranks the check before it raised on
            # every rank: [Note: A load that failed on one rank] in groups/shard_group.py).
            if group.state is CopyState.LOADING:
                self._cancel(group)
            raise
        self.resident_by_storage[group.resident_storage_key] = group.index
        if group.index in self._filled:
            self._filled.discard(group.index)
            self.after_fill(group.index)

    def _count_wait(self, group: ShardGroup, work: Callable[[], None]) -> None:
        """Run `work`, counting the time it waits for the group's load (less communication) as exposed."""
        start = time.perf_counter()
        wait_comm = self.stats.communication_s
        wait_update = self.stats.optimizer_exposed_s  # a load filled by the update pass waits for it
        work()
        waited = time.perf_counter() - start - (self.stats.communication_s - wait_comm)
        waited -= self.stats.optimizer_exposed_s - wait_update
        # What the training thread waited for: the disk (a read, or a read and its copy), or a copy.
        if group.param_home.tier is Tier.NVME:
            self.stats.io_wait_s += waited
        else:
            self.stats.copy_wait_s += waited

    def _gather_ahead(self, current: Set[int]) -> None:
        """Issue the all-gather of the next group the trace predicts, if its load was started
        ([Note: All-gather ahead])."""
        if self.collectives.world_size == 1:
            return
        for gi in self.order.upcoming(self._horizon()):
            if gi in current:
                continue
            group = self.groups[gi]
            if group.state is CopyState.LOADING and group.needs_gather:
                try:
                    self._count_wait(group, lambda: group.start_gather(self.tiers, self.collectives))
                except Exception:
                    if group.state is CopyState.LOADING:  # as _finish: none was issued, its next use reads again
                        self._cancel(group)
                    raise
                self.stats.all_gathers_ahead += 1
            return

    def _load(self, group: ShardGroup, protect: Set[int]) -> None:
        """Start loading `group`, evicting others if no slot is free; raises if none can be freed."""
        if group.shares_home_as_device_copy:
            self.before_load(group.index)
            group.start_load(self.tiers, None)
            return
        slot = self._take_slot(protect | {group.index}, needed_by=None, numel=group.plan.flat_numel)
        if slot is None:
            slot = self._add_slot(group)
        self._start_load(group, slot, "load")

    def _add_slot(self, group: ShardGroup) -> torch.Tensor:
        """One more device slot, when every slot holds a group still in use together with this one (a
        checkpointed region recomputed in backward keeps all of its groups referenced; so may a module
        that reads many groups at once): the plan's minimum was too low. Taken within the device
        budget if there is one, else refused with the number the step needs."""
        pool = self.device_slots
        assert pool is not None
        slot = pool.add(self.tiers, group.plan.flat_numel)
        if slot is not None:
            self.stats.slots_added += 1
            return slot
        # The last group loaded into each slot: it holds the slot, or autograd still holds its memory
        # (the tensors a checkpointed region recomputed): the groups used together with this one.
        holding = sorted(set(self._last_in_slot.values()))
        account = self.tiers.accounts[Tier.DEVICE]
        slot_bytes = group.plan.flat_numel * pool.element_bytes
        need = account.resident_bytes + slot_bytes
        raise PlanError(
            f"group {group.plan.name!r} needs a device slot, but all {pool.num_buffers} slots hold groups that "
            f"are in use at the same time: {holding} (a checkpointed region recomputed in backward, or a module "
            f"that uses them together); this step needs at least {pool.num_buffers + 1} slots (the next of {slot_bytes} bytes): "
            f"raise tiers.device_budget_bytes from {account.budget_bytes} to at least {need}, or make groups "
            "smaller (grouping.max_group_bytes)"
        )

    def _start_load(self, group: ShardGroup, slot: torch.Tensor, why: str) -> None:
        """Start loading `group` into `slot` (taken for it), counted as a read.

        [Note: A load that never started]
        group.start_load may raise before it issues anything into the slot: a Ctrl-C landing in its
        wait for a parameter staging buffer or for the slot's last users (where a forward spends its
        waits), an IO request refused. The slot then goes back to the pool with what it waited for.
        Before, it stayed taken by nobody: one device slot fewer for every later step, and past the
        spare ones, steps refused for want of a slot."""
        traced = self.tracer.active
        start = self.tracer.now() if traced else 0.0
        assert self.device_slots is not None
        after = self.device_slots.reuse_after(slot)
        try:
            filled = group.start_fill(slot, after, self.device_slots, self.fill_from_update)
            if not filled:
                self.before_load(group.index)  # the update, if one runs, writes the home first
                group.start_load(self.tiers, slot, after, self.param_staging, self.device_slots)
        except BaseException:
            self.device_slots.give(slot, after)
            raise
        self._count_read(group, filled)
        if filled:
            self._filled.add(group.index)
        self._holding[group.index] = group
        self._last_in_slot[slot.data_ptr()] = group.plan.name
        if traced:
            track = "param io" if group.param_home.tier is Tier.NVME else "param copies"
            self.tracer.io(track, f"{why} {group.plan.name}", group.pending, start)

    def _count_read(self, group: ShardGroup, filled: bool = False) -> None:
        """Count a load: `filled` by the update pass (no read of the home), or read from the home."""
        home = group.param_home
        self.stats.param_bytes_read += home.nbytes
        if filled:
            self.stats.param_bytes_from_update += home.nbytes
        else:
            self.stats.add_bytes(self.stats.bytes_read, home.tier, home.nbytes)
        if home.tier is Tier.HOST or (home.tier is Tier.NVME and not self.tiers.accelerator.is_host):
            self.stats.h2d_bytes += home.nbytes

    def _take_slot(self, protect: Set[int], needed_by: Optional[int], numel: int) -> Optional[torch.Tensor]:
        """A slot of at least `numel` elements: a free one, else one freed by evicting (or cancelling)
        groups not needed before `needed_by` (None: any not in use), farthest next use first."""
        pool = self.device_slots
        assert pool is not None
        slot = pool.take(numel)
        if slot is not None:
            return slot
        horizon = self._horizon()
        need_at = horizon if needed_by is None else needed_by
        # Resident groups, and groups a prefetch is still loading (a wrong prediction must cost time
        # only: their loads are cancelled, and the slot is filled again once the copy into it is done).
        # A victim frees a slot only if that slot is large enough (slots are sized per group).
        candidates = [
            g
            for gi, g in sorted(self._holding.items())
            if gi not in protect and gi not in self.in_use and gi not in self.pinned
            and g.slot is not None and pool.capacity(g.slot) >= numel
        ]
        # Farthest next use first; among equals, least recently used first (never acquired: first of all).
        if len(candidates) > 1:
            recency = {gi: n for n, gi in enumerate(self._recent)}
            candidates.sort(key=lambda g: (-self.order.next_use_distance(g.index, horizon), recency.get(g.index, -1)))
        for victim in candidates:
            if needed_by is not None and self.order.next_use_distance(victim.index, horizon) <= need_at:
                break
            if victim.state is CopyState.LOADING:
                pending = self._cancel(victim)
                slot = pool.take(numel)
                if slot is None and needed_by is None:
                    # The copy into the slot still holds it: an acquisition waits for that copy to land.
                    self.tiers.accelerator.host_waits(pending, "cancelled load")
                    slot = pool.take(numel)
            else:
                if victim.state is CopyState.GATHERING:
                    self._finish(victim)  # issued on every rank: finished, never abandoned
                self._evict(victim)
                slot = pool.take(numel)
            if slot is not None:
                return slot
        return None

    def _cancel(self, group: ShardGroup) -> Pending:
        """Drop a load in flight: its slot is lent again once the copy into it is done (returned)."""
        self._filled.discard(group.index)
        slot, pending = group.cancel_load()
        if slot is not None:
            assert self.device_slots is not None
            self.device_slots.give(slot, [pending])
        else:  # over, failed or not: what it copied is never used
            self.tiers.accelerator.host_waits(over(pending), "cancelled load")
        self._forget(group.index)
        return pending

    def _evict(self, group: ShardGroup) -> None:
        changed = group.changed_in_place()
        self.resident_by_storage.pop(group.resident_storage_key, None)
        slot = group.evict()
        if slot is not None:
            assert self.device_slots is not None
            # Filled again only after the compute that read it (under CUDA still running, maybe).
            self.device_slots.give(slot, [self.tiers.accelerator.compute_done()])
        self._forget(group.index)
        if changed:  # [Note: Parameters changed in place] in groups/shard_group.py
            group.note_values()  # refused once: the eviction is done, so the loop may go on
            raise ValueError(
                f"parameters {changed[:3]} were changed in place or given other data outside the optimizer "
                "(nn.Embedding(max_norm=...) renormalises the rows it looks up in forward; a torch.no_grad() edit of a "
                "parameter in the loop; a momentum encoder's p.data = m * p.data + ... or p.data.mul_(m) in forward), a change the engine "
                "would lose: its copy of a parameter is dropped after use; drop max_norm (renormalise out of place in "
                "forward: F.embedding(ids, w) * scale), make the edit a term of the loss, or keep weights the model "
                "updates itself in buffers (register_buffer), which stay in place"
            )

    def _prefetch(self, protect: Set[int]) -> None:
        if self.lookahead_groups <= 0:
            return
        horizon = self._horizon()
        wanted: List[int] = []
        ahead_bytes = 0
        for gi in self.order.upcoming(horizon):
            if gi in wanted or gi in self.in_use:
                continue
            if self.lookahead_bytes is not None:
                ahead_bytes += self.groups[gi].param_home.nbytes
                if ahead_bytes > self.lookahead_bytes:
                    break
            wanted.append(gi)
            if len(wanted) >= self.lookahead_groups:
                break
        for distance, gi in enumerate(wanted):
            group = self.groups[gi]
            if group.state is not CopyState.ABSENT:
                continue
            if group.shares_home_as_device_copy:
                self.before_load(gi)
                group.start_load(self.tiers, None)
                continue
            slot = self._take_slot(
                protect | set(wanted[: distance + 1]),
                needed_by=self.order.next_use_distance(gi, horizon),
                numel=group.plan.flat_numel,
            )
            if slot is None:
                return
            self._start_load(group, slot, "prefetch")
            self.stats.prefetches_issued += 1


__all__ = ["PrefetchScheduler"]
