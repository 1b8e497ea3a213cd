"""SlotPool: equal-sized buffers on one tier, allocated once and lent out for transient copies.

Device slots hold groups' full parameters while they are in use; host slots stage NVMe reads and
writes (gradient accumulation, optimizer streaming). A slot is lent only when nothing outside the
pool still points into its memory: `torch._C._storage_Use_Count` tells, so a tensor that autograd
kept from a group's last use (a recomputed activation under checkpointing, say) can never see its
memory reused for another group.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from offload_trainer.config import Tier
from offload_trainer.runtime.groups.tiers import MemoryTiers

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_references(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold t's storage; 0 where torch cannot tell."""
    if _use_count is None:
        return 0
    return int(_use_count(t.untyped_storage()._cdata))


class SlotPool:
    """`num_slots` buffers of `slot_numel` elements of `dtype` on `tier`, counted against its budget."""

    def __init__(
        self,
        tiers: MemoryTiers,
        tier: Tier,
        num_slots: int,
        slot_numel: int,
        dtype: torch.dtype,
        what: str,
        guard_references: bool,
    ) -> None:
        """`guard_references`: lend a slot only once nothing outside the pool points into it.
        Needed where autograd can see the memory (device slots); host staging never leaves the engine."""
        self.tier = tier
        self.guard_references = guard_references
        self.slot_numel = slot_numel
        self._slots: List[torch.Tensor] = [
            tiers.allocate(tier, slot_numel, dtype, f"{what} slot {i}") for i in range(num_slots)
        ]
        self._free: List[int] = list(range(num_slots - 1, -1, -1))
        self._ptr_index = {t.data_ptr(): i for i, t in enumerate(self._slots)}
        self._baseline = [storage_references(t) for t in self._slots]
        self.agree: Optional[Callable[[bool], bool]] = None
        """On several ranks: makes every rank take a slot or none, so residency (and with it the
        all-gathers each acquisition issues) stays identical across ranks. The reference guard
        is a local fact (what autograd still holds), and one rank lending a slot where another
        evicts a group would pair different groups' all-gathers."""

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> Optional[torch.Tensor]:
        """A free slot that nothing else references, or None."""
        found = None
        for pos in range(len(self._free) - 1, -1, -1):
            i = self._free[pos]
            if not self.guard_references or storage_references(self._slots[i]) <= self._baseline[i]:
                found = pos
                break
        if self.agree is not None and not self.agree(found is not None):
            return None
        if found is None:
            return None
        return self._slots[self._free.pop(found)]

    def take_as(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A free slot's first `numel` elements viewed as `dtype` (must fit); raises if none is free."""
        slot = self.take()
        if slot is None:
            raise RuntimeError(f"no free slot among the {self.num_slots} of this pool")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        assert nbytes <= slot.numel() * slot.element_size(), "slot too small"
        return slot.view(torch.uint8)[:nbytes].view(dtype)

    def give(self, slot: torch.Tensor) -> None:
        i = self._ptr_index[slot.data_ptr()]
        assert i not in self._free, "slot returned twice"
        self._free.append(i)
