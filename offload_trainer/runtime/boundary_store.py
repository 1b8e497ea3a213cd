"""BoundaryStore: every block's input for every micro-batch of one layer-major step, across the tiers.

The layer-major schedule (layer_major.py) runs block k for all micro-batches before block k+1, so
it keeps each block's input of every micro-batch (its boundaries) from the forward until that
block's backward recomputes it: num_blocks x micro-batches tensors, the activations that do not
exist at all in micro-batch-major training.

Placement, per block (all its micro-batches in one tier), chosen when the step's first boundary
sizes are known: the blocks backward needs first (the last ones) on the device as far as the
device budget has room, the next in host memory as far as the host budget has room, the rest on
NVMe (tiers.nvme_dir); a PlanError with the numbers when they fit nowhere. The bytes are counted
against each tier's budget until close() (NVMe: the extent, allocated once and reused by later
steps, replaced by a larger one when a step needs more: BoundarySpill).

[Note: Boundary copies]
Every byte crosses between the device and host memory on the copy path (the accelerator's d2h and
h2d, ordered by their Pendings), and between host memory and NVMe through io_engine:
- host: put() starts the copy off the device into a pinned buffer of the boundary's own and
  returns (it runs behind the forward); take() starts the copy back into a new device tensor
  after that copy (Accelerator.h2d_new's `after`: a stream wait under CUDA, never the host; [Note:
  Copies into new device memory]), and has the compute wait for it.
- NVMe: through a ring of two host staging buffers (BoundarySpill, counted against the host
  budget for good, as the engine's other buffers are). put()
  starts the copy off the device into one and then writes the boundary before it, whose copy had
  one block of one micro-batch of compute to finish; a buffer is reused once its write is done.
  take() reads the boundary after it, in backward's order, ahead into the other buffer, so the
  read of the next runs while the current one is copied and computed; a buffer is read into again
  once its copy to the device is done. The first take waits for every write.
On the CPU (device memory is host memory) there is no copy path: host boundaries are kept as they
are, NVMe ones are written from and read into device tensors directly.

[Note: Boundaries keep their memory order]
A boundary comes back with the strides it was put with: in plain PyTorch the block's input is the
very tensor the block before returned, and a hidden state that is not row-major (a ViT's
`proj(x).flatten(2).transpose(1, 2)`, kept by the residual additions) makes reductions over it (a
norm's mean) sum in its memory order. A boundary whose memory is dense is stored as the row-major
view of its memory (its dimensions permuted, no copy) and permuted back at take(); before, the copy
paths stored it row-major, and the recomputation in backward computed other last bits than the
forward had. One with gaps or overlaps is stored row-major.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from io_engine import IOHandle
from io_engine.buffers import round_up

from offload_trainer.config import Tier
from offload_trainer.errors import PlanError
from offload_trainer.runtime.device.pending import Pending
from offload_trainer.runtime.groups.tiers import ARENA_ALIGN_BYTES, MemoryTiers

NUM_STAGING = 2
"""Host staging buffers of the NVMe path: one being filled or drained on the copy path while the
other's NVMe write or read runs."""


class BoundarySpill:
    """What boundaries on NVMe need across steps, made once and grown when a step needs more (the
    smaller given back first): the NVMe extent they are written to, and (on an accelerator) the
    host staging buffers they pass through, counted against the host budget like the engine's
    other buffers."""

    def __init__(self, tiers: MemoryTiers) -> None:
        self.tiers = tiers
        self.key: Optional[str] = None
        self.extent_bytes = 0
        self._num_extents = 0
        self.staging: List[torch.Tensor] = []

    def ensure_extent(self, nbytes: int) -> str:
        """The key of an extent of at least `nbytes` bytes.

        Growing frees the smaller extent first (its bytes are back on the disk and out of the NVMe
        account before the larger one is reserved), so the spill never holds more than one extent.
        Called by a new step's BoundaryStore, once the previous step's store is closed: close()
        waited for every transfer of the old extent."""
        if self.key is None or nbytes > self.extent_bytes:
            if self.key is not None:
                self._free_extent()
            key = f"layer-major boundaries {self._num_extents}"
            self.tiers.allocate_extents({key: nbytes}, {key: "layer-major boundary activations"})
            self._num_extents += 1
            self.key, self.extent_bytes = key, nbytes
        return self.key

    def _free_extent(self) -> None:
        assert self.key is not None and self.tiers.store is not None
        self.tiers.store.free(self.key)
        self.tiers.accounts[Tier.NVME].give(self.extent_bytes)  # what allocate_extents took
        self.key, self.extent_bytes = None, 0

    def staging_bytes_to_add(self, nbytes: int) -> int:
        """Host bytes ensure_staging(nbytes) would add to what the spill holds (the buffers it
        replaces are given back first)."""
        have = self.staging[0].numel() if self.staging else 0
        return 0 if have >= nbytes else NUM_STAGING * (round_up(nbytes, ARENA_ALIGN_BYTES) - have)

    def ensure_staging(self, nbytes: int) -> List[torch.Tensor]:
        """NUM_STAGING host buffers of at least `nbytes` bytes each (page-aligned, pinned under CUDA).

        Growing gives the smaller buffers back first (their budget and their memory), so the spill
        holds the largest a step needed, never the sum. Called, like ensure_extent, by a new step's
        BoundaryStore once the previous step's is closed: no copy or IO uses the old buffers."""
        if self.staging_bytes_to_add(nbytes):
            for buffer in self.staging:
                self.tiers.free(Tier.HOST, buffer)
            self.staging = []
            size = round_up(nbytes, ARENA_ALIGN_BYTES)
            self.staging = [
                self.tiers.allocate(Tier.HOST, size, torch.uint8, "layer-major boundary staging", own_arena=True)
                for _ in range(NUM_STAGING)
            ]
        return self.staging


@dataclass
class _Staged:
    """One host staging buffer of the NVMe path and what last used it."""

    buffer: torch.Tensor
    copy: Optional[Pending] = None
    """The copy on the copy path that last read or wrote the buffer."""
    io: Optional[IOHandle] = None
    """The NVMe write or read that last used the buffer."""
    slot: Optional[Tuple[int, int]] = None
    """The boundary (block, micro-batch) the buffer holds or is filling (None: free)."""
    freed: int = 0
    """When it was last freed (a count): reads go into the buffer free the longest."""


def _memory_order(h: torch.Tensor) -> Optional[List[int]]:
    """The permutation of `h`'s dimensions, outermost in memory first, that makes it a row-major view of
    its dense memory; None where `h` is row-major already, or has gaps or overlaps."""
    if h.is_contiguous():
        return None
    order = sorted(range(h.dim()), key=lambda d: (-h.stride(d), d))
    return order if h.permute(order).is_contiguous() else None


class BoundaryStore:
    """The boundaries of one step: put in forward, taken (once each) in backward, then close()."""

    def __init__(
        self,
        tiers: MemoryTiers,
        sizes_bytes: Sequence[int],
        take_order: Sequence[int],
        spill: BoundarySpill,
    ) -> None:
        """`sizes_bytes[m]`: the bytes of micro-batch m's boundary (the same for every block);
        `take_order`: the blocks in the order backward takes them, each then for every micro-batch
        in order (the device keeps the first ones)."""
        self.tiers = tiers
        self.accel = tiers.accelerator
        self.spill = spill
        self.sizes_bytes = list(sizes_bytes)
        self.block_bytes = sum(self.sizes_bytes)
        self.take_order = list(take_order)
        self.tier_of: Dict[int, Tier] = {}
        """Each block's boundaries' tier."""
        self.nbytes: Dict[Tier, int] = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.NVME: 0}
        """Bytes of boundaries in each tier (NVMe: alignment included)."""
        self._place()
        self._taken_from: List[Tier] = []
        for tier in (Tier.DEVICE, Tier.HOST):
            if self.nbytes[tier]:
                tiers.accounts[tier].take(self.nbytes[tier], "layer-major boundary activations")
                self._taken_from.append(tier)
        self._held: Dict[Tuple[int, int], Tuple[torch.Tensor, Optional[Pending]]] = {}
        """Device and host boundaries: the tensor, and the copy off the device still filling it."""
        self._offsets: Dict[Tuple[int, int], int] = {}
        """NVMe boundaries: byte offset in the extent."""
        self._perms: Dict[Tuple[int, int], List[int]] = {}
        """Boundaries stored permuted: the permutation back to the tensor put ([Note: Boundaries keep their
        memory order])."""
        self._meta: Dict[Tuple[int, int], Tuple[torch.Size, torch.dtype]] = {}
        """NVMe boundaries: shape and dtype."""
        self._num_freed = 0
        self._writes_finished = False
        self._staging: List[_Staged] = []
        self._writing: List[Tuple[IOHandle, torch.Tensor]] = []
        """NVMe writes in flight straight from device tensors (the CPU): their sources are kept alive."""
        self._reading: Dict[Tuple[int, int], Tuple[IOHandle, torch.Tensor]] = {}
        """NVMe reads ahead (the CPU) into new device tensors."""
        self._to_write: Optional[_Staged] = None
        """The staging buffer whose copy off the device runs and whose write is not issued yet."""
        self._order = [(k, m) for k in self.take_order for m in range(len(self.sizes_bytes))]
        self._next_take = 0
        self._key: Optional[str] = None
        if self.nbytes[Tier.NVME]:
            self._layout_nvme()
            self._key = spill.ensure_extent(self.nbytes[Tier.NVME])
            if not self.accel.is_host:
                self._staging = [_Staged(b) for b in spill.ensure_staging(max(self.sizes_bytes))]
        self._closed = False

    # -- placement ---------------------------------------------------------------------------------

    def _place(self) -> None:
        accounts = self.tiers.accounts
        num = len(self.take_order)
        device_room, host_room = accounts[Tier.DEVICE].room_bytes(), accounts[Tier.HOST].room_bytes()
        on_device = num if device_room is None else min(num, max(0, device_room) // max(1, self.block_bytes))
        rest = num - on_device
        staging_bytes = 0 if self.accel.is_host else self.spill.staging_bytes_to_add(max(self.sizes_bytes))
        if host_room is None or rest * self.block_bytes <= host_room:
            on_host = rest
        else:
            on_host = max(0, host_room - staging_bytes) // max(1, self.block_bytes)
            if self.tiers.store is None or host_room < staging_bytes:
                raise PlanError(
                    f"the layer-major schedule keeps every block's input for every micro-batch: {num} blocks x "
                    f"{self.block_bytes} bytes per block (all micro-batches) = {num * self.block_bytes} bytes, but the "
                    f"device tier has {device_room} bytes free and the host tier {host_room}"
                    + (
                        " and no NVMe directory (tiers.nvme_dir) for the rest: set tiers.nvme_dir, raise "
                        f"tiers.host_budget_bytes by at least {rest * self.block_bytes - max(0, host_room)}"
                        if self.tiers.store is None
                        else f", less than the {staging_bytes} bytes of host staging the rest needs on its way to "
                        f"NVMe: raise tiers.host_budget_bytes by at least {staging_bytes - max(0, host_room)}"
                    )
                    + ", use fewer or smaller micro-batches, or train micro-batch-major "
                    '(train.micro_batch_order = "micro_batch_major")'
                )
        for i, k in enumerate(self.take_order):
            tier = Tier.DEVICE if i < on_device else Tier.HOST if i < on_device + on_host else Tier.NVME
            self.tier_of[k] = tier
            self.nbytes[tier] += self.block_bytes

    def _layout_nvme(self) -> None:
        offset = 0
        for k in self.take_order:
            if self.tier_of[k] is Tier.NVME:
                for m, size in enumerate(self.sizes_bytes):
                    self._offsets[k, m] = offset
                    offset += round_up(max(size, 1), ARENA_ALIGN_BYTES)
        self.nbytes[Tier.NVME] = offset

    # -- put and take ------------------------------------------------------------------------------

    def put(self, block: int, micro_batch: int, h: torch.Tensor) -> None:
        """Keep `h` (detached) as block `block`'s input of micro-batch `micro_batch`."""
        h = h.detach()
        order = _memory_order(h)
        if order is not None:
            h = h.permute(order)  # row-major: the copy paths below copy its memory as it is
            self._perms[block, micro_batch] = [order.index(d) for d in range(len(order))]
        tier = self.tier_of[block]
        if tier is Tier.NVME:
            self._put_nvme((block, micro_batch), h)
        elif tier is Tier.DEVICE or self.accel.is_host:
            self._held[block, micro_batch] = (h, None)
        else:
            host = torch.empty(h.shape, dtype=h.dtype, pin_memory=h.device.type == "cuda")
            self._held[block, micro_batch] = (host, self.accel.d2h(host.view(-1), h.reshape(-1)))

    def take(self, block: int, micro_batch: int) -> torch.Tensor:
        """The stored input, on the device, as a new leaf; the store forgets it."""
        slot = (block, micro_batch)
        if self._next_take < len(self._order) and self._order[self._next_take] == slot:
            self._next_take += 1
        if self.tier_of[block] is Tier.NVME:
            back = self._take_nvme(slot)
        else:
            h, copy = self._held.pop(slot)
            if copy is None:
                back = h.detach()
            else:
                # Back once its copy off the device is done: a stream wait under CUDA, where a host
                # wait tied the take to the GPU's progress through the forward that made it.
                back, copy = self.accel.h2d_new(h.view(-1), h.shape, [copy])
                self.accel.compute_waits(copy, "boundary copy to the device")
        self._read_ahead()
        back_order = self._perms.pop(slot, None)
        return back if back_order is None else back.permute(back_order)

    # -- the NVMe path -----------------------------------------------------------------------------

    def _put_nvme(self, slot: Tuple[int, int], h: torch.Tensor) -> None:
        assert self._key is not None and self.tiers.store is not None
        self._meta[slot] = (h.shape, h.dtype)
        if self.accel.is_host:
            source = h.contiguous().view(-1).view(torch.uint8)
            done = [(w, src) for w, src in self._writing if w.done()]
            for w, _ in done:
                w.wait()  # raises the write's error, if any
            self._writing = [(w, src) for w, src in self._writing if not w.done()]
            self._writing.append((self.tiers.store.pwrite(self._key, source, self._offsets[slot]), source))
            return
        stage = next(s for s in self._staging if s is not self._to_write)
        self._settle_write(stage)  # its last write is done, and so was the copy that filled it
        nbytes = h.numel() * h.element_size()
        stage.copy = self.accel.d2h(stage.buffer[:nbytes].view(h.dtype), h.reshape(-1))
        stage.slot = slot
        previous, self._to_write = self._to_write, stage
        if previous is not None:
            self._issue_write(previous)

    def _issue_write(self, stage: _Staged) -> None:
        assert stage.copy is not None and stage.slot is not None and self.tiers.store is not None
        self.accel.host_waits(stage.copy, "boundary copy off the device")
        shape, dtype = self._meta[stage.slot]
        nbytes = shape.numel() * dtype.itemsize
        stage.io = self.tiers.store.pwrite(self._key, stage.buffer[:nbytes], self._offsets[stage.slot])

    def _settle_write(self, stage: _Staged) -> None:
        """The host waits for the buffer's last NVMe transfer; the buffer is free."""
        if stage.io is not None:
            stage.io.wait()
            stage.io = None
        stage.slot = None
        self._num_freed += 1
        stage.freed = self._num_freed

    def _finish_writes(self) -> None:
        """Issue the last write and wait for all of them (once: before the first NVMe read). Marked
        finished only once they are: a wait interrupted here (Ctrl-C) leaves them to close(), which
        a step's end calls. Marked first, close() waited for none, and the next step wrote the same
        extent while they were still in flight."""
        if self._writes_finished:
            return
        if self._to_write is not None:
            self._issue_write(self._to_write)
            self._to_write = None
        for stage in self._staging:
            self._settle_write(stage)
        for handle, _ in self._writing:
            handle.wait()
        self._writing = []
        self._writes_finished = True

    def _start_read(self, slot: Tuple[int, int]) -> None:
        """Start reading NVMe boundary `slot` into a staging buffer (the CPU: a new device tensor)."""
        assert self.tiers.store is not None and self._key is not None
        shape, dtype = self._meta[slot]
        if self.accel.is_host:
            into = torch.empty(shape, dtype=dtype, device=self.accel.torch_device)
            self._reading[slot] = (self.tiers.store.pread(self._key, into.view(-1).view(torch.uint8), self._offsets[slot]), into)
            return
        stage = min((s for s in self._staging if s.slot is None), key=lambda s: s.freed)
        if stage.copy is not None:  # the buffer's copy to the device is done before it is read into
            self.accel.host_waits(stage.copy, "boundary copy to the device")
        nbytes = shape.numel() * dtype.itemsize
        stage.io = self.tiers.store.pread(self._key, stage.buffer[:nbytes], self._offsets[slot])
        stage.slot = slot

    def _take_nvme(self, slot: Tuple[int, int]) -> torch.Tensor:
        self._finish_writes()
        shape, dtype = self._meta[slot]
        if self.accel.is_host:
            if slot not in self._reading:
                self._start_read(slot)
            handle, into = self._reading.pop(slot)
            handle.wait()
            return into
        stage = next((s for s in self._staging if s.slot == slot), None)
        if stage is None:
            self._start_read(slot)
            stage = next(s for s in self._staging if s.slot == slot)
        assert stage.io is not None
        stage.io.wait()
        stage.io = None
        nbytes = shape.numel() * dtype.itemsize
        back, stage.copy = self.accel.h2d_new(stage.buffer[:nbytes].view(dtype), shape)
        stage.slot = None
        self._num_freed += 1
        stage.freed = self._num_freed
        self.accel.compute_waits(stage.copy, "boundary copy to the device")
        return back

    def _read_ahead(self) -> None:
        """Start reading the boundary backward takes next, if it is on NVMe and a buffer is free."""
        if self._next_take >= len(self._order):
            return
        nxt = self._order[self._next_take]
        if self.tier_of[nxt[0]] is not Tier.NVME or nxt in self._reading:
            return
        self._finish_writes()
        if not self.accel.is_host and (
            any(s.slot == nxt for s in self._staging) or all(s.slot is not None for s in self._staging)
        ):
            return
        self._start_read(nxt)

    def close(self) -> None:
        """Wait for what is in flight, forget every boundary, and give the bytes back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for _, copy in self._held.values():
            if copy is not None:
                self.accel.host_waits(copy, "boundary copy off the device")
        self._held = {}
        self._perms = {}
        self._finish_writes()
        for handle, _ in self._reading.values():
            handle.wait()
        self._reading = {}
        for stage in self._staging:
            if stage.io is not None:
                stage.io.wait()
            if stage.copy is not None:
                self.accel.host_waits(stage.copy, "boundary copy")
        for tier in self._taken_from:
            self.tiers.accounts[tier].give(self.nbytes[tier])
        self._taken_from = []


__all__ = ["BoundarySpill", "BoundaryStore"]
