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
copy; `unbind()` restores the empty placeholder. Nothing else is stored on the Parameter.
Autograd's saved tensors that point into the device copy are swapped for (group, offset) records
by hooks.py, so backward re-acquires evicted groups instead of reading reused memory.
"""

from __future__ import annotations

import enum
from typing import Dict, List, Optional

import torch
from torch import nn

from io_engine import IOHandle

from offload_trainer.runtime.collectives import Collectives
from offload_trainer.config import Tier
from offload_trainer.runtime.layout.partition import GroupPlan
from offload_trainer.runtime.groups.homes import Home
from offload_trainer.runtime.groups.tiers import MemoryTiers


class CopyState(enum.Enum):
    """The device copy of a group's full parameters."""

    ABSENT = "absent"
    """No device copy; the parameters are bound to empty placeholders."""
    LOADING = "loading"
    """A device slot is assigned and its bytes are in flight from the home tier."""
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
        self.params = params
        """The module's Parameters, in plan.params order."""
        self.param_home = param_home
        self.grad_home = grad_home
        self.optimizer_homes = optimizer_homes
        self.state = CopyState.ABSENT
        self.slot: Optional[torch.Tensor] = None
        self._pending: Optional[IOHandle] = None
        self._placeholder = torch.empty(0, dtype=param_home.dtype, device=device)
        self.rank = rank
        self.world_size = plan.flat_numel // plan.shard_numel
        self.shard_start, self.shard_end = plan.shard_range(rank)
        self.pieces = plan.shard_pieces(rank)
        """The trainable parameters' parts in this rank's shard (whole parameters on one rank)."""
        self.local_trainable_numel = plan.trainable_shard_numel(rank)

    @property
    def index(self) -> int:
        return self.plan.index

    @property
    def shares_home_as_device_copy(self) -> bool:
        """True when the parameter home is on the device and holds all of it (one rank): bound without a copy."""
        return self.param_home.tier is Tier.DEVICE and self.world_size == 1

    # -- the device copy -----------------------------------------------------------------------

    def start_load(self, tiers: MemoryTiers, slot: Optional[torch.Tensor]) -> None:
        """ABSENT -> LOADING: fill `slot` from the parameter home (no slot if the home is on the device)."""
        assert self.state is CopyState.ABSENT, f"group {self.plan.name}: start_load from {self.state}"
        if self.shares_home_as_device_copy:
            assert slot is None
            self.state = CopyState.LOADING
            return
        assert slot is not None and slot.numel() >= self.plan.flat_numel
        self.slot = slot[: self.plan.flat_numel]
        self._pending = self.param_home.start_read(tiers, self.slot[self.shard_start : self.shard_end])
        self.state = CopyState.LOADING

    @property
    def pending_io(self) -> Optional[IOHandle]:
        """The NVMe read filling the device copy while LOADING (None for memory copies or when done)."""
        return self._pending

    def is_loaded(self) -> bool:
        """True if finish_load() would not wait for IO."""
        return self._pending is None or self._pending.done()

    def finish_load(self, collectives: Collectives) -> None:
        """LOADING -> READY: wait for this rank's shard, all-gather the others, bind the parameters.

        A collective: every rank calls it for the same groups in the same order (acquisitions).
        """
        assert self.state is CopyState.LOADING, f"group {self.plan.name}: finish_load from {self.state}"
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        full = self.device_copy()
        if not self.shares_home_as_device_copy:
            collectives.check_same(self.index, "the group to all-gather")
            collectives.all_gather_into(full, full[self.shard_start : self.shard_end])
        self._bind(full)
        self.state = CopyState.READY

    def cancel_load(self) -> Optional[torch.Tensor]:
        """LOADING -> ABSENT without binding (no collective); returns the slot."""
        assert self.state is CopyState.LOADING, f"group {self.plan.name}: cancel_load from {self.state}"
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        slot, self.slot = self.slot, None
        self.state = CopyState.ABSENT
        return slot

    def device_copy(self) -> torch.Tensor:
        """The flat full parameters on the device (LOADING or READY)."""
        assert self.state is not CopyState.ABSENT, f"group {self.plan.name} has no device copy"
        if self.shares_home_as_device_copy:
            assert self.param_home.tensor is not None
            return self.param_home.tensor
        assert self.slot is not None
        return self.slot

    def evict(self) -> Optional[torch.Tensor]:
        """READY -> ABSENT: unbind the parameters; returns the freed slot (None if it had none)."""
        assert self.state is CopyState.READY, f"group {self.plan.name}: evict from {self.state}"
        self._unbind()
        slot, self.slot = self.slot, None
        self.state = CopyState.ABSENT
        return slot

    def _bind(self, flat: torch.Tensor) -> None:
        for p, s in zip(self.params, self.plan.params):
            p.data = flat[s.offset_numel : s.offset_numel + s.numel].view(s.shape)

    def _unbind(self) -> None:
        for p in self.params:
            p.data = self._placeholder

    def unbind_placeholder(self, param: nn.Parameter) -> None:
        """Point one of this group's parameters back at the empty placeholder (see [Note: Binding parameters])."""
        param.data = self._placeholder

    # -- the homes -------------------------------------------------------------------------------

    def write_param(self, tiers: MemoryTiers, i: int, value: torch.Tensor) -> None:
        """This rank's part of parameter i (`value`, the whole parameter) into the parameter home, and
        into the fp32 master when there is one and the parameter is trainable. No device copy may exist."""
        layout = self.plan.params[i]
        lo = max(layout.offset_numel, self.shard_start)
        hi = min(layout.offset_numel + layout.numel, self.shard_end)
        if lo >= hi:
            return
        part = value.reshape(-1)[lo - layout.offset_numel : hi - layout.offset_numel]
        targets: List[Home] = [self.param_home]
        master = self.optimizer_homes.get("master")
        if master is not None and layout.requires_grad:
            targets.append(master)
        for home in targets:
            home.write(tiers, part.to(home.dtype), offset=lo - self.shard_start)

    def write_shard(self, tiers: MemoryTiers, params: List[torch.Tensor], staging: Optional[torch.Tensor]) -> None:
        """This rank's shard of `params` (the group's parameters as tensors, in plan order) into the
        parameter home (compute dtype) and the fp32 master; padding is zeros. One write per home: an
        NVMe home is filled in `staging` (a host buffer of at least the shard's bytes) first."""
        for home in (self.param_home, self.optimizer_homes.get("master")):
            if home is None:
                continue
            if home.tier is Tier.NVME:
                assert staging is not None, "an NVMe home is written through a staging buffer"
                shard = staging.view(torch.uint8)[: home.nbytes].view(home.dtype)
            else:
                assert home.tensor is not None
                shard = home.tensor
            shard.zero_()
            with torch.no_grad():
                for p, layout in zip(params, self.plan.params):
                    lo = max(layout.offset_numel, self.shard_start)
                    hi = min(layout.offset_numel + layout.numel, self.shard_start + home.numel)
                    if lo < hi:
                        flat = p.detach().reshape(-1)
                        shard[lo - self.shard_start : hi - self.shard_start].copy_(
                            flat[lo - layout.offset_numel : hi - layout.offset_numel]
                        )
            if home.tier is Tier.NVME:
                home.write(tiers, shard)
