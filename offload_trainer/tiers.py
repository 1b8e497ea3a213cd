"""The three tiers, each with byte accounting: device memory, host memory, NVMe files.

A `TierAccount` counts the bytes resident in one tier against its budget and remembers the
peak; every allocation of engine state goes through one, so a budget is a checked invariant,
not a hope. `Home` is where one state kind of one group lives for good (its home tier); memory
homes are tensors, NVMe homes are FileStore extents read and written through io_engine.

Host memory comes from io_engine arenas (page-aligned, pinned under CUDA), so it is ready for
direct IO and asynchronous copies. On a machine without a GPU the device is the CPU: device
buffers are host arenas too, held to the device budget, and NVMe reads go straight into them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch

from io_engine import FileStore, HostArena, IOEngine, IOHandle

from .config import Tier


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

    def fits(self, nbytes: int) -> bool:
        with self._lock:
            return self.budget_bytes is None or self.resident_bytes + nbytes <= self.budget_bytes

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
        device: torch.device,
        device_budget_bytes: Optional[int],
        host_budget_bytes: Optional[int],
        io: IOEngine,
        nvme_dir: Optional[str],
    ) -> None:
        self.device = device
        self.accounts = {
            Tier.DEVICE: TierAccount(Tier.DEVICE, device_budget_bytes),
            Tier.HOST: TierAccount(Tier.HOST, host_budget_bytes),
            Tier.NVME: TierAccount(Tier.NVME, None),
        }
        self.io = io
        self.store: Optional[FileStore] = FileStore(io, nvme_dir) if nvme_dir is not None else None

    @property
    def device_is_host(self) -> bool:
        """True on a machine without a GPU: the device tier is host memory under its own budget."""
        return self.device.type == "cpu"

    def allocate(self, tier: Tier, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A new 1-D tensor on a memory tier, counted against that tier's budget until freed."""
        if tier is Tier.NVME:
            raise ValueError("NVMe space is allocated with allocate_extents(), not allocate()")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.accounts[tier].take(nbytes, what)
        if tier is Tier.DEVICE and not self.device_is_host:
            return torch.empty(numel, dtype=dtype, device=self.device)
        return HostArena(max(nbytes, 1)).slice(0, nbytes).view(dtype)

    def free(self, tier: Tier, tensor: torch.Tensor) -> None:
        self.accounts[tier].give(tensor.numel() * tensor.element_size())

    def allocate_extents(self, sizes: "dict[str, int]") -> None:
        if self.store is None:
            raise ValueError("NVMe placement needs tiers.nvme_dir: set it to a directory on a fast local disk")
        self.store.allocate(sizes)
        self.accounts[Tier.NVME].take(sum(sizes.values()), "NVMe extents")

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


@dataclass
class Home:
    """Where one state kind of one group lives between uses: a memory tensor or an NVMe extent."""

    tier: Tier
    numel: int
    dtype: torch.dtype
    tensor: Optional[torch.Tensor] = None
    """The data, for the DEVICE and HOST tiers."""
    key: Optional[str] = None
    """The FileStore extent, for the NVME tier."""

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def start_read(self, tiers: MemoryTiers, into: torch.Tensor) -> Optional[IOHandle]:
        """Start filling `into` from this home; returns the IO handle for NVMe (None: already done)."""
        if self.tier is Tier.NVME:
            assert tiers.store is not None and self.key is not None
            return tiers.store.pread(self.key, into.view(torch.uint8))
        assert self.tensor is not None
        into.copy_(self.tensor)
        return None

    def start_write(self, tiers: MemoryTiers, source: torch.Tensor) -> Optional[IOHandle]:
        """Start storing `source` into this home; returns the IO handle for NVMe (None: already done)."""
        if self.tier is Tier.NVME:
            assert tiers.store is not None and self.key is not None
            return tiers.store.pwrite(self.key, source.view(torch.uint8))
        assert self.tensor is not None
        if source.data_ptr() != self.tensor.data_ptr():
            self.tensor.copy_(source)
        return None
