"""ShardGroup: one group's homes on their tiers, and the device copy of its parameters while in use.

A group owns its homes (parameter shard, fp32 gradient shard, optimizer states, each on its home
tier) and, while in use, a full copy of its parameters on the device, bound into the module's
`nn.Parameter`s via `param.data`. The device copy is a small state machine (`CopyState`) that only
this class changes; each method names the state it starts from and checks it. What the homes hold
is written by the gradient accumulator (gradients), the optimizer (parameters and states) and, at
start-up or from files, by write_shard and write_param here.

[Note: Binding parameters]
Outside its use a parameter's `.data` is a 0-element tensor, so a use without acquisition fails
loudly instead of reading stale values. `bind()` points each parameter at its view of the device
copy; `unbind()` restores the empty placeholder. Nothing else is stored on the Parameter (its
class is model_changes.HeldParameter while the engine is open and the parameter bound, [Note: In-place
ops on p.data], and hooks.UnresidentParameter while it holds the placeholder, [Note: Reads of unbound
parameters]).
Autograd's saved tensors that point into the device copy are swapped for (group, offset) records
by hooks.py, so backward re-acquires evicted groups instead of reading reused memory.

[Note: Parameters changed in place]
The device copy is read-only to the model: what the step trains is the parameter home (and the
fp32 master), and eviction drops the copy. Code that changes a bound parameter in place
(`nn.Embedding(max_norm=...)` renormalises the rows it looks up, in forward; a
`with torch.no_grad(): p.mul_(...)` in the training loop) would see its change kept by plain
PyTorch and silently lost here; so would a write to a parameter outside its use, which changes
the empty placeholder only (`model.apply(init_fn)`, a `p.mul_()` or `p.data = t` in the loop).
Each parameter's own version counter (`p._version`: a parameter bound through `.data` counts its
own in-place ops, not the slot's or the placeholder's; `.data =` counts none) is noted once, when
the engine has placed the values, and never moves while nothing but the engine touches the
parameter; nor does its storage, which is the device copy's while bound and the group's
placeholder's otherwise. `p.data = t` gives the parameter t's storage: a momentum encoder's
`p_k.data = m * p_k.data + (1 - m) * p_q.data` in forward (MoCo) or in the loop (BYOL), WGAN's
`p.data = p.data.clamp(-c, c)`. Storages are told apart by their StorageImpl (storage_identity.py),
not by their bytes' address, so even an empty t (what such code computes from the placeholder)
shows: a 0-element tensor's data_ptr() is 0 whatever its storage. The scheduler compares both at eviction
(`changed_in_place`); the engine compares them at a step's first forward, at step() and at each
save (`changed_outside`, about 1 us per parameter on the loaded 2-core machine), and refuses the
change by name. In-place ops on `p.data` (`p.data.clamp_(-c, c)`, `p.data.mul_(m)`) move the
counter because the engine's parameters' `.data` is `p.detach()` ([Note: In-place ops on p.data]
in model_changes.py).
"""

from __future__ import annotations

import enum
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from offload_trainer.runtime.collectives import CollectiveWork, Collectives
from offload_trainer.config import Tier
from offload_trainer.runtime.layout.partition import GroupPlan
from offload_trainer.runtime.device.pending import DONE, Chain, FailedRead, IOPending, Pending, all_of
from offload_trainer.runtime.groups.buffer_pool import BufferPool
from offload_trainer.runtime.groups.homes import Home
from offload_trainer.runtime.groups.tiers import MemoryTiers
from offload_trainer.runtime.storage_identity import storage_key


_bypass_unresident_reads = torch._C.DisableTorchFunctionSubclass
"""Around the engine's own reads and writes of every parameter (`_version`, its storage, `.data =`): an
unbound parameter's `__torch_function__` ([Note: Reads of unbound parameters] in hooks.py) would cost a
Python call each, for nothing. A bound one (HeldParameter) has none, but torch treats only Tensor and
nn.Parameter themselves as plain: for any other class each attribute read or write of a tensor, and each
tensor argument of a C function, first looks the class's `__torch_function__` up (an interned string and a
generic attribute lookup, about 1.3 us on the loaded 2-core machine, where nn.Parameter's check takes
none). Inside this context that check is skipped: a group's bind and unbind took about 94 us for 9
parameters, about 40-60 us here, and the eviction's check 52 us, about 21-42 (interleaved timeit, noisy)."""


class CopyState(enum.Enum):
    """The device copy of a group's full parameters."""

    ABSENT = "absent"
    """No device copy; the parameters are bound to empty placeholders."""
    LOADING = "loading"
    """A device slot is assigned and its bytes are in flight from the home tier."""
    GATHERING = "gathering"
    """Several ranks: the all-gather of the full parameters into the slot is in flight (issued
    ahead of the acquisition, see [Note: All-gather ahead] in residency/scheduler.py)."""
    READY = "ready"
    """The device copy is complete and bound into the parameters."""


class ShardGroup:
    """One group of parameters: homes on their tiers, and the device copy while in use."""

    def __init__(
        self,
        plan: GroupPlan,
        params: List[nn.Parameter],
        param_home: Home,
        grad_home: Optional[Home],
        optimizer_homes: Dict[str, Home],
        device: torch.device,
        rank: int = 0,
    ) -> None:
        """`param_home` (rank's shard, compute dtype); grad and optimizer homes (fp32) hold the
        trainable part of the shard."""
        self.plan = plan
        self.index = plan.index
        """The group's index (plan.index), read on every acquisition and gradient."""
        self.params = params
        """The module's Parameters, in plan.params order."""
        self.param_home = param_home
        self.grad_home = grad_home
        self.optimizer_homes = optimizer_homes
        self.state = CopyState.ABSENT
        self.slot: Optional[torch.Tensor] = None
        self._pending: Pending = DONE
        self._gather: Optional[CollectiveWork] = None
        # A storage of its own ([Note: Parameters changed in place]).
        self._placeholder = torch.empty(1, dtype=param_home.dtype, device=device)[:0]
        self.rank = rank
        self.world_size = plan.flat_numel // plan.shard_numel
        self.shares_home_as_device_copy = param_home.tier is Tier.DEVICE and self.world_size == 1
        """True when the parameter home is on the device and holds all of it (one rank): bound without a copy."""
        self.shard_start, self.shard_end = plan.shard_range(rank)
        self.pieces = plan.shard_pieces(rank)
        """The trainable parameters' parts in this rank's shard (whole parameters on one rank)."""
        self.local_trainable_numel = plan.trainable_shard_numel(rank)
        self._slot_views: Optional[List[torch.Tensor]] = None
        """While a pool's slot is loaded or bound: [the device copy, this rank's shard of it, each
        parameter's view], made once per (slot, group) by the pool (BufferPool.cached_views) rather
        than per acquisition."""
        self._home_views: Optional[List[torch.Tensor]] = None
        """The parameter views of the device home, when it is bound as the device copy."""
        self._versions: List[int] = [p._version for p in params]
        """Each parameter's `_version` when the engine last placed its values (note_values; [Note:
        Parameters changed in place])."""
        self._placeholder_storage_key = storage_key(self._placeholder)
        self.resident_storage_key = 0
        """While READY, the key of the device copy's storage (storage_identity.py; 0 otherwise): the
        scheduler maps it back to this group for the saved-tensor hooks (hooks.py)."""
        self.resident_copy: Optional[torch.Tensor] = None
        """While READY, the device copy (None otherwise): a saved tensor's unpack rebuilds its view
        from it without a state check (hooks.py)."""
        self._bound_classes: List[Optional[type]] = [None] * len(self.params)
        self._unbound_classes: List[Optional[type]] = [None] * len(self.params)
        """set_param_classes: per parameter, the class it has while bound and the one it takes while unbound."""

    # -- the device copy -----------------------------------------------------------------------

    def start_fill(
        self,
        slot: torch.Tensor,
        after: Sequence[Pending],
        slots: Optional[BufferPool],
        fill: Callable[[int, torch.Tensor, Sequence[Pending]], Optional[Pending]],
    ) -> bool:
        """ABSENT -> LOADING without reading the home, where `fill(index, shard, after)` gives what fills
        this rank's shard in `slot` instead (the optimizer's update pass, still computing the new
        values: [Note: The next forward's load from the update] in runtime/optimizer_pipeline.py).
        Only for a parameter home on NVMe, into a slot whose last users are done (else the pass's
        copies into it, and the staging buffers they read, would wait for them: under CUDA the update
        thread for the device's compute, [Note: Host waits in a step]); False (still ABSENT) where
        there is no such fill."""
        assert self.state is CopyState.ABSENT, f"group {self.plan.name}: start_fill from {self.state}"
        if self.param_home.tier is not Tier.NVME or self.shares_home_as_device_copy:
            return False
        if not all(p.done() for p in after):
            return False
        assert slot.numel() >= self.plan.flat_numel
        if slots is not None:
            views = slots.cached_views(slot, self.index, lambda: self._make_slot_views(slot))
            full, shard = views[0], views[1]
        else:
            full = slot[: self.plan.flat_numel]
            shard = full[self.shard_start : self.shard_end]
            views = None
        assert shard.numel() == self.param_home.numel, (self.plan.name, shard.numel(), self.param_home.numel)
        pending = fill(self.index, shard, after)
        if pending is None:
            return False
        self.slot, self._slot_views, self._pending = full, views, pending
        self.state = CopyState.LOADING
        return True

    def start_load(
        self,
        tiers: MemoryTiers,
        slot: Optional[torch.Tensor],
        after: Sequence[Pending] = (),
        staging: Optional[BufferPool] = None,
        slots: Optional[BufferPool] = None,
    ) -> None:
        """ABSENT -> LOADING: start filling `slot` with this rank's shard from the parameter home.

        No slot when the home is on the device and holds all of it (one rank): the home is bound as
        it is, once the writes in flight into it are done. `after`: what the slot's last users still
        do (BufferPool.reuse_after); the copy into it waits for them. `staging`: host buffers for a
        parameter home on NVMe when the device is not host memory (the read lands there, then the
        copy path takes it to the device). `slots`: the pool `slot` was taken from (it keeps the
        parameters' views of the slot, see _bind)."""
        assert self.state is CopyState.ABSENT, f"group {self.plan.name}: start_load from {self.state}"
        home = self.param_home
        if self.shares_home_as_device_copy:
            assert slot is None
            self._pending = all_of(home.writes)
            self.state = CopyState.LOADING
            return
        assert slot is not None and slot.numel() >= self.plan.flat_numel
        if slots is not None:
            views = slots.cached_views(slot, self.index, lambda: self._make_slot_views(slot))
            self.slot, shard = views[0], views[1]
            self._slot_views = views
        else:
            self.slot = slot[: self.plan.flat_numel]
            shard = self.slot[self.shard_start : self.shard_end]
            self._slot_views = None
        accel = tiers.accelerator
        try:
            if home.tier is Tier.NVME and accel.is_host:
                for pending in after:
                    accel.host_waits(pending, "slot reuse")
                self._pending = IOPending(home.start_read(tiers, shard))
            elif home.tier is Tier.NVME:
                assert staging is not None, "NVMe parameters on an accelerator need host staging buffers"
                buffer = staging.take(home.numel)
                if buffer is None:
                    raise RuntimeError(f"no parameter staging buffer is free for group {self.plan.name!r}")
                source = buffer.view(torch.uint8)[: home.nbytes].view(home.dtype)
                try:
                    read = home.start_read(tiers, source)
                except BaseException:
                    staging.give(buffer)
                    raise
                chain = Chain(read, lambda: accel.h2d(shard, source, after))
                staging.give(buffer, [chain])  # written again only once the copy has read it
                self._pending = chain
            elif home.tier is Tier.HOST:
                self._pending = accel.h2d(shard, home.tensor, after)
            else:  # a device home on several ranks: the shard is copied on the device, then all-gathered
                accel.compute_waits(all_of([*after, *home.writes]), "slot reuse")
                assert home.tensor is not None
                shard.copy_(home.tensor)
                self._pending = DONE
        except Exception as error:
            if not self.needs_gather:
                self._unstarted()
                raise
            # Several ranks: told at the check before its all-gather ([Note: A load that failed on one
            # rank]); a prefetch that never reaches it (cancelled) tries the read again at its next load.
            # Without its traceback: its frames hold views of the slot, which the pool would then count
            # as still referenced (guard_references) on this rank alone, and lend it on the others.
            self._pending = FailedRead(error.with_traceback(None))
        except BaseException:
            self._unstarted()
            raise
        self.state = CopyState.LOADING

    def _unstarted(self) -> None:
        """Nothing was issued into the slot (a wait before it interrupted, a refused request): still
        ABSENT, and the caller gives the slot back ([Note: A load that never started] in
        residency/scheduler.py)."""
        self.slot = None
        self._slot_views = None

    @property
    def pending(self) -> Pending:
        """What filling the device copy still waits for while LOADING (DONE when nothing)."""
        return self._pending

    def is_loaded(self) -> bool:
        """True if finish_load() would not have to wait."""
        if self.state is CopyState.GATHERING:
            assert self._gather is not None
            return self._gather.done()
        return self._pending.done()

    @property
    def needs_gather(self) -> bool:
        """True when the full parameters come from an all-gather of the ranks' shards."""
        return not self.shares_home_as_device_copy and self.world_size > 1

    def start_gather(self, tiers: MemoryTiers, collectives: Collectives) -> None:
        """LOADING -> GATHERING: once this rank's shard is in the slot, issue the all-gather of the
        others (a collective: every rank issues it for the same group at the same point)."""
        assert self.state is CopyState.LOADING and self.needs_gather, f"group {self.plan.name}: start_gather from {self.state}"
        full = self.device_copy()
        # [Note: A load that failed on one rank]
        # A rank whose read of its shard failed (its disk, a write the last update pass lost) raised here
        # or at the load, alone, while its peers issued the all-gather and waited in it: until the
        # process group's timeout, or until that rank's next collective met it, paired out of step.
        # The host waits for the read before the check (it waits for as much before the all-gather
        # anyway: accelerator.collective's `after`), and the check carries its failure: every rank
        # raises there, the failed one its own error, and none issues the all-gather.
        failed: Optional[BaseException] = None
        try:
            self._pending.wait_read()
        except BaseException as error:  # noqa: B902 - a Ctrl-C too: raised on every rank by the check
            failed = error
        collectives.check_same(self.index, "the group to all-gather", failed)
        with tiers.accelerator.collective(after=[self._pending]):
            self._gather = collectives.start_all_gather(full, full[self.shard_start : self.shard_end], self.plan.name)
        self._pending = DONE
        self.state = CopyState.GATHERING

    def finish_load(self, tiers: MemoryTiers, collectives: Collectives) -> None:
        """LOADING or GATHERING -> READY: wait for this rank's shard and the all-gather of the others
        (issued now if it was not yet), bind the parameters.

        A collective: every rank calls it for the same groups in the same order (acquisitions).
        """
        assert self.state in (CopyState.LOADING, CopyState.GATHERING), f"group {self.plan.name}: finish_load from {self.state}"
        full = self.device_copy()
        if self.state is CopyState.LOADING and not self.needs_gather:
            tiers.accelerator.compute_waits(self._pending, "param load")
        else:
            if self.state is CopyState.LOADING:
                self.start_gather(tiers, collectives)
            assert self._gather is not None
            self._gather.finish()
            self._gather = None
        self._pending = DONE
        self._bind(full)
        # Saved tensors are recorded by their offset in this storage (hooks.py): it must start here.
        assert full.storage_offset() == 0, f"group {self.plan.name}: device copy at storage offset {full.storage_offset()}"
        self.resident_storage_key = storage_key(full)
        self.resident_copy = full
        self.state = CopyState.READY

    def cancel_load(self) -> Tuple[Optional[torch.Tensor], Pending]:
        """LOADING -> ABSENT without binding (no collective); returns the slot and what still writes it."""
        assert self.state is CopyState.LOADING, f"group {self.plan.name}: cancel_load from {self.state}"
        slot, self.slot = self.slot, None
        self._slot_views = None
        pending, self._pending = self._pending, DONE
        pending.cancel()  # a fill the update pass has not begun: nothing will write the slot
        self.state = CopyState.ABSENT
        return slot, pending

    def device_copy(self) -> torch.Tensor:
        """The flat full parameters on the device (LOADING or READY)."""
        assert self.state is not CopyState.ABSENT, f"group {self.plan.name} has no device copy"
        if self.shares_home_as_device_copy:
            assert self.param_home.tensor is not None
            return self.param_home.tensor
        assert self.slot is not None
        return self.slot

    def changed_in_place(self) -> List[str]:
        """READY: the names of the parameters changed in place since the engine placed their values, or
        given other data (`p.data = t`): see [Note: Parameters changed in place]."""
        key = self.resident_storage_key
        with _bypass_unresident_reads():
            return [
                layout.name for layout, p, version in zip(self.plan.params, self.params, self._versions)
                if p._version != version or storage_key(p) != key
            ]

    def changed_outside(self) -> List[str]:
        """Not READY: the names of the parameters written outside their use (their placeholder changed in
        place, or other data given): see [Note: Parameters changed in place]."""
        key = self._placeholder_storage_key  # p.is_set_to(placeholder) is exact, and slower
        with _bypass_unresident_reads():
            return [
                layout.name for layout, p, version in zip(self.plan.params, self.params, self._versions)
                if p._version != version or storage_key(p) != key
            ]

    def note_values(self) -> None:
        """The parameters' values are the engine's as they are now (after initialize; after a change
        outside was refused and dropped): their placeholders back, their versions noted."""
        if self.state is not CopyState.READY:
            self._unbind()
        with _bypass_unresident_reads():
            self._versions = [p._version for p in self.params]

    def evict(self) -> Optional[torch.Tensor]:
        """READY -> ABSENT: unbind the parameters; returns the freed slot (None if it had none)."""
        assert self.state is CopyState.READY, f"group {self.plan.name}: evict from {self.state}"
        self._unbind()
        self.resident_storage_key = 0
        self.resident_copy = None
        slot, self.slot = self.slot, None
        self._slot_views = None
        self.state = CopyState.ABSENT
        return slot

    def set_param_classes(self, classes: Optional[Sequence[Tuple[Optional[type], Optional[type]]]]) -> None:
        """From now on parameter i, while of class classes[i][0] (a held class: model_changes.held_class),
        takes class classes[i][1] (the engine's UnresidentParameter for it) while it holds the placeholder,
        and classes[i][0] again once bound ([Note: Reads of unbound parameters] in hooks.py); (None, None)
        for a parameter never swapped; None: no more (the engine closed, model_changes.let_go)."""
        if classes is None:
            classes = [(None, None)] * len(self.params)
        self._bound_classes = [bound for bound, _ in classes]
        self._unbound_classes = [unbound for _, unbound in classes]
        if self.state is not CopyState.READY:
            for p, bound, unbound in zip(self.params, self._bound_classes, self._unbound_classes):
                if unbound is not None and type(p) is bound:
                    p.__class__ = unbound

    def _bind(self, flat: torch.Tensor) -> None:
        if self.slot is None:  # the device home itself (never lent to another group)
            if self._home_views is None:
                self._home_views = self._make_views(flat)
            views = self._home_views
        elif self._slot_views is not None:
            views = self._slot_views[2:]
        else:
            views = self._make_views(flat)
        with _bypass_unresident_reads():
            for p, view, bound, unbound in zip(self.params, views, self._bound_classes, self._unbound_classes):
                if type(p) is unbound:  # never while None
                    p.__class__ = bound
                p.data = view

    def _make_views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [s.view(flat[s.offset_numel : s.offset_numel + s.numel]) for s in self.plan.params]

    def _make_slot_views(self, slot: torch.Tensor) -> List[torch.Tensor]:
        flat = slot[: self.plan.flat_numel]
        return [flat, flat[self.shard_start : self.shard_end], *self._make_views(flat)]

    def _unbind(self) -> None:
        placeholder = self._placeholder
        with _bypass_unresident_reads():
            for p, bound, unbound in zip(self.params, self._bound_classes, self._unbound_classes):
                p.data = placeholder
                if type(p) is bound and unbound is not None:
                    p.__class__ = unbound

    def unbind_placeholder(self, param: nn.Parameter) -> None:
        """Point one of this group's parameters back at the empty placeholder (see [Note: Binding parameters])."""
        param.data = self._placeholder
        i = next(i for i, p in enumerate(self.params) if p is param)
        if type(param) is self._bound_classes[i] and self._unbound_classes[i] is not None:
            param.__class__ = self._unbound_classes[i]

    # -- the homes -------------------------------------------------------------------------------

    def write_param(self, tiers: MemoryTiers, i: int, value: torch.Tensor) -> None:
        """This rank's part of parameter i (`value`, the whole parameter) into the parameter home, and
        into the fp32 master when there is one and the parameter is trainable. No device copy may exist."""
        layout = self.plan.params[i]
        lo = max(layout.offset_numel, self.shard_start)
        hi = min(layout.offset_numel + layout.numel, self.shard_end)
        if lo >= hi:
            return
        part = layout.flatten(value)[lo - layout.offset_numel : hi - layout.offset_numel]
        targets: List[Home] = [self.param_home]
        master = self.optimizer_homes.get("master")
        if master is not None and layout.requires_grad:
            targets.append(master)
        for home in targets:
            home.write(tiers, part.to(home.dtype), offset=lo - self.shard_start)

    def write_shard(self, tiers: MemoryTiers, params: List[torch.Tensor], staging: Optional[torch.Tensor]) -> None:
        """This rank's shard of `params` (the group's parameters as tensors, in plan order) into the
        parameter home (compute dtype) and the fp32 master; padding is zeros. An NVMe or off-device
        home is filled in `staging` (a host buffer) first, one write per home, or per window of
        `staging`'s size (whole IO blocks) where the home is larger (a group updated in chunks has
        no staging buffer of its size: [Note: Chunked updates] in runtime/optimizer.py)."""
        for home in (self.param_home, self.optimizer_homes.get("master")):
            if home is None:
                continue
            through_staging = home.tier is Tier.NVME or home.crosses(tiers)
            window = home.numel
            if through_staging:
                assert staging is not None, "an NVMe or accelerator home is written through a staging buffer"
                window_bytes = staging.numel() * staging.element_size()
                block_bytes = tiers.io.config.block_bytes if tiers.io is not None else 0
                if home.nbytes > window_bytes and block_bytes and window_bytes >= block_bytes:
                    window_bytes -= window_bytes % block_bytes
                window = min(home.numel, window_bytes // home.dtype.itemsize)
            for start in range(0, home.numel, window):
                n = min(window, home.numel - start)
                if through_staging:
                    assert staging is not None
                    shard = staging.view(torch.uint8)[: n * home.dtype.itemsize].view(home.dtype)
                else:
                    assert home.tensor is not None
                    shard = home.tensor
                shard.zero_()
                first = self.shard_start + start
                with torch.no_grad():
                    for p, layout in zip(params, self.plan.params):
                        lo = max(layout.offset_numel, first)
                        hi = min(layout.offset_numel + layout.numel, first + n)
                        if lo < hi:
                            flat = layout.flatten(p.detach())
                            shard[lo - first : hi - first].copy_(flat[lo - layout.offset_numel : hi - layout.offset_numel])
                if through_staging:
                    home.write(tiers, shard, start)

