"""Home: where one state kind of one group lives between uses, on its home tier.

A memory home (device or host tier) is a tensor carved from that tier's arena; an NVMe home is an
extent of a FileStore swap file, read and written through io_engine. Reads and writes take an
element offset, so a caller can move part of a home (one parameter of a group's shard, say).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from io_engine import IOHandle

from offload_trainer.config import Tier
from offload_trainer.runtime.groups.tiers import MemoryTiers


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

    def start_read(self, tiers: MemoryTiers, into: torch.Tensor, offset: int = 0) -> Optional[IOHandle]:
        """Start filling `into` from elements [offset, offset + into.numel()) of this home; returns
        the IO handle for NVMe (None: already done)."""
        if self.tier is Tier.NVME:
            assert tiers.store is not None and self.key is not None
            return tiers.store.pread(self.key, into.view(torch.uint8), offset * into.element_size())
        assert self.tensor is not None
        into.copy_(self.tensor[offset : offset + into.numel()])
        return None

    def start_write(self, tiers: MemoryTiers, source: torch.Tensor, offset: int = 0) -> Optional[IOHandle]:
        """Start storing `source` at element `offset` of this home; returns the IO handle for NVMe
        (None: already done). `source` must not change until the handle is done."""
        if self.tier is Tier.NVME:
            assert tiers.store is not None and self.key is not None
            return tiers.store.pwrite(self.key, source.view(torch.uint8), offset * source.element_size())
        assert self.tensor is not None
        target = self.tensor[offset : offset + source.numel()]
        if source.data_ptr() != target.data_ptr():
            target.copy_(source)
        return None

    def read(self, tiers: MemoryTiers, into: torch.Tensor, offset: int = 0) -> None:
        """Blocking start_read."""
        handle = self.start_read(tiers, into, offset)
        if handle is not None:
            handle.wait()

    def write(self, tiers: MemoryTiers, source: torch.Tensor, offset: int = 0) -> None:
        """Blocking start_write."""
        handle = self.start_write(tiers, source, offset)
        if handle is not None:
            handle.wait()
