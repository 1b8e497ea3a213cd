"""The three tiers, each with byte accounting: device memory, host memory, NVMe files.

A `TierAccount` counts the bytes resident in one tier against its budget and remembers the
peak; every allocation of engine state goes through one, so a budget is a checked invariant,
not a hope. The engine's memory is allocated once, at construction, from one arena per tier.

Host memory comes from io_engine arenas (page-aligned, pinned under CUDA), so it is ready for
direct IO and asynchronous copies. On a machine without a GPU the device is the CPU: device
buffers are host arenas too, held to the device budget, and NVMe reads go straight into them.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional

import torch

from io_engine import FileStore, HostArena, IOEngine
from io_engine.buffers import round_up

from offload_trainer.config import Tier
from offload_trainer.runtime.device.accelerator import Accelerator
from offload_trainer.runtime.groups.freed_heap import give_back_freed_heap


ARENA_ALIGN_BYTES = 4096
"""Alignment of every buffer carved from a tier's arena (O_DIRECT needs 4096 at most here)."""


def arena_bytes(sizes: "list[int]") -> int:
    """The arena that holds buffers of these byte sizes, each aligned as allocate() aligns it."""
    return sum(round_up(max(n, 1), ARENA_ALIGN_BYTES) for n in sizes)



DISCARD_MIN_BYTES = 1 << 20
"""MemoryTiers.discard keeps tensors smaller than this (see there)."""

class BudgetExceededError(RuntimeError):
    """Internal invariant broken: an allocation would exceed a tier's budget (a planner bug)."""


class TierAccount:
    """Bytes resident in one tier, its budget (None: unlimited) and the peak seen."""

    def __init__(self, tier: Tier, budget_bytes: Optional[int]) -> None:
        self.tier = tier
        self.budget_bytes = budget_bytes
        self.resident_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()

    def room_bytes(self) -> Optional[int]:
        """Bytes still under the budget (None: no budget)."""
        with self._lock:
            return None if self.budget_bytes is None else self.budget_bytes - self.resident_bytes

    def take(self, nbytes: int, what: str) -> None:
        with self._lock:
            if self.budget_bytes is not None and self.resident_bytes + nbytes > self.budget_bytes:
                raise BudgetExceededError(
                    f"{what}: {nbytes} bytes more would put the {self.tier.value} tier at "
                    f"{self.resident_bytes + nbytes} bytes, over its budget of {self.budget_bytes}"
                )
            self.resident_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.resident_bytes)

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.resident_bytes -= nbytes
            assert self.resident_bytes >= 0, "tier account went negative"


class MemoryTiers:
    """Allocation of engine memory on the device and host tiers, and the NVMe store."""

    def __init__(
        self,
        accelerator: Accelerator,
        device_budget_bytes: Optional[int],
        host_budget_bytes: Optional[int],
        io: IOEngine,
        nvme_dir: Optional[str],
        release_idle_memory: bool = False,
    ) -> None:
        self.release_idle_memory = release_idle_memory
        """Whether discard() gives idle memory back to the OS (tiers.release_idle_memory)."""
        self.accelerator = accelerator
        """The copy path every byte between the host and device tiers goes through."""
        self.device = accelerator.torch_device
        self.accounts = {
            Tier.DEVICE: TierAccount(Tier.DEVICE, device_budget_bytes),
            Tier.HOST: TierAccount(Tier.HOST, host_budget_bytes),
            Tier.NVME: TierAccount(Tier.NVME, None),
        }
        self.io = io
        self.store: Optional[FileStore] = FileStore(io, nvme_dir) if nvme_dir is not None else None
        self._arenas: Dict[Tier, HostArena] = {}
        self._loose_arenas: List[HostArena] = []
        self._cursor: Dict[Tier, int] = {}

    @property
    def device_is_host(self) -> bool:
        """True on a machine without a GPU: the device tier is host memory under its own budget."""
        return self.accelerator.is_host

    def reserve(self, tier: Tier, nbytes: int) -> None:
        """Make one arena of `nbytes` for `tier`'s host memory; allocate() then carves from it.

        A few large arenas instead of one per buffer: huge-page backed (see io_engine.buffers),
        pinned once under CUDA, and no rounding of each small buffer up to a whole huge page.
        """
        if nbytes > 0 and self._is_arena_memory(tier):
            self._arenas[tier] = HostArena(nbytes, pin=self._pinned(tier))
            self._cursor[tier] = 0

    def _pinned(self, tier: Tier) -> bool:
        """Host memory is pinned when the device is a GPU (copies to it run asynchronously from it).
        Not for the CPU or the simulated accelerator, on a machine with a GPU too: no CUDA copy ever
        reads it, and pinned memory can be neither discarded ([Note: Discarding idle memory] in
        io_engine/buffers.py) nor registered without initialising CUDA."""
        return tier is Tier.HOST and self.device.type == "cuda"

    def _is_arena_memory(self, tier: Tier) -> bool:
        """Host memory, and the device tier of an accelerator whose memory is host memory (the CPU,
        the simulated accelerator: there in an arena of its own, apart from the host tier's)."""
        return tier is Tier.HOST or (tier is Tier.DEVICE and self.device.type == "cpu")

    def allocate(
        self, tier: Tier, numel: int, dtype: torch.dtype, what: str, own_arena: bool = False
    ) -> torch.Tensor:
        """A new 1-D tensor on a memory tier, counted against that tier's budget for good.

        Host memory starts at a multiple of ARENA_ALIGN_BYTES, so it is ready for O_DIRECT. `own_arena`:
        not from the tier's reserved arena (a buffer the plan did not foresee)."""
        if tier is Tier.NVME:
            raise ValueError("NVMe space is allocated with allocate_extents(), not allocate()")
        nbytes = numel * dtype.itemsize
        self.accounts[tier].take(nbytes, what)
        if not self._is_arena_memory(tier):
            return torch.empty(numel, dtype=dtype, device=self.device)
        arena = None if own_arena else self._arenas.get(tier)
        if arena is None:  # nothing reserved: an arena of its own, unpinned on close() like the others
            loose = HostArena(max(nbytes, 1), pin=self._pinned(tier))
            self._loose_arenas.append(loose)
            return loose.slice(0, nbytes).view(dtype)
        start = self._cursor[tier]
        if start + nbytes > arena.nbytes:
            raise BudgetExceededError(f"{what}: the {tier.value} arena of {arena.nbytes} bytes is used up (a planning bug)")
        self._cursor[tier] = start + round_up(max(nbytes, 1), ARENA_ALIGN_BYTES)
        return arena.slice(start, nbytes).view(dtype)

    def count(self, tier: Tier, nbytes: int, what: str) -> None:
        """Count `nbytes` against `tier`'s budget for good, for memory that is not carved from its arena:
        a gradient home lent from torch's allocator one step at a time ([Note: Gradient homes lent
        from the heap] in runtime/gradients.py), which the budget counts as if it were always there."""
        self.accounts[tier].take(nbytes, what)

    def free(self, tier: Tier, tensor: torch.Tensor) -> None:
        """Give back a buffer that allocate(tier, ..., own_arena=True) made: its bytes to the tier's
        budget and, in host memory, its arena (unpinned; the memory goes once nothing refers to it).
        The caller guarantees that no copy or IO still uses it. For buffers replaced by larger ones
        (boundary_store.py's staging): without it each replaced buffer stays counted and mapped."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._is_arena_memory(tier):
            ptr = tensor.data_ptr()
            index = next((i for i, a in enumerate(self._loose_arenas) if a.tensor.data_ptr() == ptr), None)
            if index is None:
                raise ValueError(f"free: the {nbytes}-byte {tier.value} buffer was not made by allocate(own_arena=True)")
            self._loose_arenas.pop(index).close()
        self.accounts[tier].give(nbytes)

    def discard(self, tensor: torch.Tensor) -> bool:
        """Give the memory of `tensor` (carved from a host arena by allocate()) back to the OS until it
        is written again; it reads as zeros meanwhile. For memory that holds nothing live for a while
        (a gradient home between its update and the next backward, idle staging buffers): the peak
        resident set then counts it only while it is used. The caller guarantees nothing reads or
        writes it meanwhile. Its budget is still counted (the memory comes back on the next write).
        False, changing nothing, where the memory is not a private, unpinned arena's (a GPU's,
        pinned host memory under CUDA): [Note: Discarding idle memory] in io_engine/buffers.py.
        False too for a tensor under DISCARD_MIN_BYTES: its pages are a small part of any peak,
        and faulting them in again costs the same per byte as a large one's (measured on the
        131-group decoder, host homes of 260 KB: +0.16 ms of gradient handling per group and step);
        and always False unless `release_idle_memory` (tiers.release_idle_memory) is set."""
        nbytes = tensor.numel() * tensor.element_size()
        if not self.release_idle_memory or nbytes < DISCARD_MIN_BYTES:
            return False
        ptr = tensor.data_ptr()
        for arena in [*self._arenas.values(), *self._loose_arenas]:
            base = arena.tensor.data_ptr()
            if tensor.device.type == "cpu" and base <= ptr and ptr + nbytes <= base + arena.nbytes:
                return arena.discard(ptr - base, nbytes)
        return False

    def release_freed_heap(self) -> bool:
        """With `release_idle_memory` and the CPU as the compute device, give the heap memory freed
        since the last call (a backward's activations) back to the OS: [Note: Freed heap memory in
        backward] in groups/freed_heap.py. Returns whether it was asked for (the caller times it).
        Under CUDA the activations are the GPU's: nothing is done."""
        if not self.release_idle_memory or not self.accelerator.is_host:
            return False
        give_back_freed_heap()
        return True

    def allocate_extents(self, sizes: "dict[str, int]", labels: "Optional[dict[str, str]]" = None) -> None:
        """NVMe extents by key; `labels` say what each holds, for the message of a failed checksum."""
        if self.store is None:
            raise ValueError("NVMe placement needs tiers.nvme_dir: set it to a directory on a fast local disk")
        self.store.allocate(sizes, labels=labels)
        self.accounts[Tier.NVME].take(sum(sizes.values()), "NVMe extents")

    def close(self) -> None:
        """Unpin the arenas (each was registered once) and remove the swap files."""
        for arena in [*self._arenas.values(), *self._loose_arenas]:
            arena.close()
        if self.store is not None:
            self.store.close()
            self.store = None
