"""ShardGroup: one group's state on every tier, and the only code that changes it.

A group owns its homes (parameter shard, fp32 gradient shard, optimizer states, each on its home
tier) and, while in use, a full copy of its parameters on the device, bound into the module's
`nn.Parameter`s via `param.data`. The device copy is a small state machine (`CopyState`); each
method names the state it starts from and checks it.

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
from offload_trainer.runtime.groups.tiers import Home, MemoryTiers


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
        self.grad_micro_batches = 0
        """Micro-batches of this optimizer step whose gradients reached the grad home."""
        self.got_grad = [False] * len(plan.params)
        """Per parameter: did any micro-batch of this step produce a gradient for it."""
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

    # -- gradients -----------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Forget the last optimizer step's gradient bookkeeping."""
        self.grad_micro_batches = 0
        self.got_grad = [False] * len(self.plan.params)
