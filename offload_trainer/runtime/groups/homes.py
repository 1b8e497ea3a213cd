"""Home: where one state kind of one group lives between uses, on its home tier.

A memory home (device or host tier) is a tensor carved from that tier's arena; an NVMe home is an
extent of a FileStore swap file, read and written through io_engine. The blocking read() and
write() serve start-up, checkpoints and export: they take an element offset, so a caller can move
part of a home (one parameter of a group's shard, say), and a device home on a GPU (or the
simulated accelerator) is reached through the copy path. The hot path moves homes itself (the
prefetch scheduler, the gradient accumulator, the optimizer); start_reads/start_writes move several
NVMe homes (one group's optimizer states, say) as one io_engine request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from io_engine import IOHandle

from offload_trainer.config import Tier
from offload_trainer.runtime.device.pending import Pending
from offload_trainer.runtime.groups.tiers import MemoryTiers


@dataclass
class Home:
    """Where one state kind of one group lives between uses: a memory tensor or an NVMe extent."""

    tier: Tier
    numel: int
    dtype: torch.dtype
    tensor: Optional[torch.Tensor] = None
    """The data, for the DEVICE and HOST tiers (None for a lent home)."""
    key: Optional[str] = None
    """The FileStore extent, for the NVME tier."""
    lent: bool = False
    """A gradient home lent from torch's allocator a step at a time: no `tensor`, but `pieces`
    ([Note: Gradient homes lent from the heap] in runtime/gradients.py)."""
    pieces: Optional[List[Optional[torch.Tensor]]] = None
    """A lent home's memory, per parameter of its group in its shape (None: no gradient yet this
    step), from the step's first gradient until the update has read them; None between."""
    writes: List[Pending] = field(default_factory=list)
    """Asynchronous writes into a device home still in flight (the optimizer's write-backs): every
    reader waits for them first."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def crosses(self, tiers: MemoryTiers) -> bool:
        """Whether the host reaches this home only through the copy path: a device home on an
        accelerator whose device memory is not host memory."""
        return self.tier is Tier.DEVICE and not tiers.accelerator.is_host

    def start_read(self, tiers: MemoryTiers, into: torch.Tensor, offset: int = 0) -> Optional[IOHandle]:
        """Start filling `into` from elements [offset, offset + into.numel()) of this home: the IO
        handle of an NVMe read, or None for a memory home (read at once, as read() does)."""
        if self.tier is not Tier.NVME:
            self.read(tiers, into, offset)
            return None
        assert tiers.store is not None and self.key is not None
        return tiers.store.pread(self.key, into.view(torch.uint8), offset * into.element_size())

    def start_write(self, tiers: MemoryTiers, source: torch.Tensor, offset: int = 0) -> Optional[IOHandle]:
        """Start storing `source` at element `offset` of this home: the IO handle of an NVMe write
        (`source` must not change until it is done), or None for a memory home (written at once)."""
        if self.tier is not Tier.NVME:
            self.write(tiers, source, offset)
            return None
        assert tiers.store is not None and self.key is not None
        return tiers.store.pwrite(self.key, source.view(torch.uint8), offset * source.element_size())

    def settle(self, tiers: MemoryTiers) -> None:
        """The host waits for the writes in flight into this home."""
        for pending in self.writes:
            tiers.accelerator.host_waits(pending, "home write")
        self.writes = []

    def read(self, tiers: MemoryTiers, into: torch.Tensor, offset: int = 0) -> None:
        """Fill host memory `into` from this home, blocking (not for the hot path)."""
        if self.tier is Tier.NVME:
            handle = self.start_read(tiers, into, offset)
            assert handle is not None
            handle.wait()
            return
        assert self.tensor is not None
        self.settle(tiers)
        source = self.tensor[offset : offset + into.numel()]
        if self.crosses(tiers):
            tiers.accelerator.host_waits(tiers.accelerator.d2h(into, source), "home read")
        else:
            into.copy_(source)

    def write(self, tiers: MemoryTiers, source: torch.Tensor, offset: int = 0) -> None:
        """Store host memory `source` at element `offset` of this home, blocking (not for the hot path)."""
        if self.tier is Tier.NVME:
            handle = self.start_write(tiers, source, offset)
            assert handle is not None
            handle.wait()
            return
        assert self.tensor is not None
        self.settle(tiers)
        target = self.tensor[offset : offset + source.numel()]
        accel = tiers.accelerator
        if self.crosses(tiers):
            # After the compute issued so far: under CUDA its kernels may still read this home (a
            # forward whose output nobody read yet, before a load of new weights).
            accel.host_waits(accel.h2d(target, source, [accel.compute_done()]), "home write")
            return
        # The host writes it: under CUDA a copy of this home into a device slot may not have run yet
        # (a forward's load, which its kernels waited for on their stream, not the host), so the host
        # first waits for the compute issued so far, and with it for the copies that compute waited
        # for. A load cancelled in flight may still read it: its slot is lent again only after that
        # copy, and what it copied is never used.
        accel.host_waits(accel.compute_done(), "home write")
        if source.data_ptr() != target.data_ptr():
            target.copy_(source)


def start_reads(tiers: MemoryTiers, moves: Sequence[Tuple[Home, torch.Tensor, int]]) -> List[IOHandle]:
    """Start filling each buffer from its NVMe home, at the home's element offset given with it
    (home, buffer, offset), as one io_engine request per swap file the homes are in: one, for homes
    allocated together, as the engine allocates them all. Each chunk is checked as start_read
    checks it: only whole checksum chunks are, so a caller that wants every byte checked moves
    ranges of whole IO blocks (IOConfig.block_bytes) or ending at the home's end."""
    return [tiers.store.pread_many(parts) for parts in _parts_by_file(tiers, moves)]  # type: ignore[union-attr]


def start_writes(
    tiers: MemoryTiers, moves: Sequence[Tuple[Home, torch.Tensor, int]], background: bool = False
) -> List[IOHandle]:
    """Start storing each buffer at its element offset of its NVMe home, one request per swap file
    (see start_reads). No buffer may change until its handle is done. `background`: behind every
    other request (io_engine's [Note: Background requests])."""
    store = tiers.store
    assert store is not None
    return [store.pwrite_many(parts, background=background) for parts in _parts_by_file(tiers, moves)]


def _parts_by_file(
    tiers: MemoryTiers, moves: Sequence[Tuple[Home, torch.Tensor, int]]
) -> List[List[Tuple[str, torch.Tensor, int]]]:
    store = tiers.store
    assert store is not None
    by_file: Dict[str, List[Tuple[str, torch.Tensor, int]]] = {}
    for home, buf, offset in moves:
        assert home.tier is Tier.NVME and home.key is not None and buf.dtype == home.dtype
        by_file.setdefault(store.extent(home.key).path, []).append((home.key, buf, offset * home.dtype.itemsize))
    return list(by_file.values())
