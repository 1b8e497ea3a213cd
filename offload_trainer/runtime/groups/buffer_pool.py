"""BufferPool: buffers on one tier, allocated once and lent out for transient copies.

A pool's buffers may differ in size (device slots are sized per group: the plan gives the pool
the sizes of the groups that can be resident at once, largest first, rather than that many copies
of the largest group); take(numel) lends the smallest free buffer that holds `numel` elements.
A pool with `exact_class` (host staging, whose buffers are held across several requests) lends
only from the size class a request belongs to, the smallest buffer size that holds it: a small
request never takes a larger class's buffer, so a large group's request waits only for its own
class, whose count the plan made large enough (layout/staging_sizes.py).

Three pools use it: device slots (a device slot holds one group's full parameters while the group is
in use), host staging buffers (NVMe reads and writes of gradients and optimizer states pass through
them) and, on several ranks, gradient buckets. A buffer of a guarded pool is lent only when nothing
outside the pool still points into its memory: `torch._C._storage_Use_Count` tells, so a tensor
that autograd kept from a group's last use (a recomputed activation under checkpointing, say) can
never see its memory reused for another group.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from offload_trainer.config import Tier
from offload_trainer.runtime.device.pending import Pending, over
from offload_trainer.runtime.groups.tiers import MemoryTiers

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_references(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold t's storage; 0 where torch cannot tell."""
    if _use_count is None:
        return 0
    return int(_use_count(t.untyped_storage()._cdata))


class BufferPool:
    """Buffers of `dtype` on `tier` (one per entry of `buffer_numels`, or `num_buffers` of
    `buffer_numel` elements), counted against its budget."""

    def __init__(
        self,
        tiers: MemoryTiers,
        tier: Tier,
        num_buffers: int,
        buffer_numel: "int | Sequence[int]",
        dtype: torch.dtype,
        what: str,
        guard_references: bool,
        host_waits: Optional[Callable[[Pending], None]] = None,
        exact_class: bool = False,
    ) -> None:
        """`guard_references`: lend a buffer only once nothing outside the pool points into it.
        Needed where autograd can see the memory (device slots); host staging never leaves the engine.
        `host_waits`: how take() waits for a buffer's earlier users (see give()), for host buffers whose
        next writer is the host; None: the next user waits for them itself, on its stream under CUDA
        (device slots: reuse_after() gives them to the copy that fills the slot; gradient buckets: to
        the compute that writes them), so taking one never blocks the host on the device ([Note: Host
        waits in a step] in runtime/device/accelerator.py).
        `exact_class`: take(numel) lends only buffers of the smallest size that holds `numel`."""
        self.tier = tier
        self._tiers = tiers
        self.exact_class = exact_class
        self.what = what
        self._dtype = dtype
        self.guard_references = guard_references
        numels = [buffer_numel] * num_buffers if isinstance(buffer_numel, int) else list(buffer_numel)
        assert len(numels) == num_buffers, f"{what}: {num_buffers} buffers, {len(numels)} sizes"
        self._numels: List[int] = numels
        """Per buffer: its size in elements."""
        self._buffers: List[torch.Tensor] = [
            tiers.allocate(tier, n, dtype, f"{what} {i}") for i, n in enumerate(numels)
        ]
        self._free: List[int] = list(range(num_buffers - 1, -1, -1))
        self._ptr_index = {t.data_ptr(): i for i, t in enumerate(self._buffers)}
        self._baseline = [storage_references(t) for t in self._buffers]
        self._host_waits = host_waits
        self._after: List[List[Pending]] = [[] for _ in self._buffers]
        self._views: List[Dict[int, List[torch.Tensor]]] = [{} for _ in self._buffers]
        """Per buffer: views kept for its life (cached_views), by their user's key."""
        """Per buffer: the work that read or wrote it when it was last given back."""
        self._classes: Dict[int, Optional[int]] = {}
        """Request size -> its size class (the smallest buffer size that holds it; None: none does),
        found once per size: take() runs for every group's staging buffer and device slot."""
        self.agree: Optional[Callable[[bool], bool]] = None
        """On several ranks: makes every rank take a buffer or none, so residency (and with it the
        all-gathers each acquisition issues) stays identical across ranks. The reference guard
        is a local fact (what autograd still holds), and one rank lending a slot where another
        evicts a group would pair different groups' all-gathers."""

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)

    @property
    def buffer_numel(self) -> int:
        """Elements of the largest buffer."""
        return max(self._numels, default=0)

    def capacity(self, buffer: torch.Tensor) -> int:
        """Elements of the pool's buffer that `buffer` (or a view starting at its first byte) is."""
        return self._numels[self._ptr_index[buffer.data_ptr()]]

    @property
    def element_bytes(self) -> int:
        return self._dtype.itemsize

    def add(self, tiers: MemoryTiers, numel: Optional[int] = None) -> Optional[torch.Tensor]:
        """One more buffer of `numel` elements (default: the largest's), taken at once (outside the
        tier's arena, counted against its budget), or None where the budget has no room; on several
        ranks, all add one or none (see `agree`)."""
        numel = self.buffer_numel if numel is None else numel
        nbytes = numel * self.element_bytes
        room = tiers.accounts[self.tier].room_bytes()
        fits = room is None or room >= nbytes
        if self.agree is not None:
            fits = self.agree(fits)
        if not fits:
            return None
        buffer = tiers.allocate(self.tier, numel, self._dtype, f"{self.what} {len(self._buffers)}", own_arena=True)
        self._ptr_index[buffer.data_ptr()] = len(self._buffers)
        self._numels.append(numel)
        self._buffers.append(buffer)
        self._baseline.append(storage_references(buffer))
        self._after.append([])
        self._classes.clear()
        self._views.append({})
        return buffer

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _size_class(self, numel: int) -> Optional[int]:
        """The smallest buffer size that holds `numel` elements, None where none does."""
        try:
            return self._classes[numel]
        except KeyError:
            size = self._classes[numel] = min((n for n in self._numels if n >= numel), default=None)
            return size

    def class_numel(self, numel: int) -> int:
        """The size of the buffers take(numel) may lend: its class's (exact_class), else `numel`."""
        if not self.exact_class:
            return numel
        size = self._size_class(numel)
        return numel if size is None else size

    def num_free_of_class(self, numel: int) -> int:
        """How many free buffers take(numel) could lend (those of its class, exact_class)."""
        size = self.class_numel(numel)
        numels = self._numels
        count = 0
        for i in self._free:  # a loop, not a generator: called for every staged group
            if numels[i] == size:
                count += 1
        return count

    def take(self, numel: int = 0) -> Optional[torch.Tensor]:
        """A free buffer of at least `numel` elements that nothing else references, or None. Among
        those the smallest; among equals, one whose earlier users are done if there is one (no
        wait), else the one given back most recently."""
        found = None
        found_key = None
        size_class = self._size_class(numel) if self.exact_class else None
        numels = self._numels
        for pos in range(len(self._free) - 1, -1, -1):
            i = self._free[pos]
            if numels[i] < numel or (size_class is not None and numels[i] != size_class):
                continue
            if not self.guard_references or storage_references(self._buffers[i]) <= self._baseline[i]:
                # Smaller first, then done; later positions (given back last) are seen first.
                busy = False
                for pending in self._after[i]:  # all(...) without a generator: this runs per free buffer
                    if not pending.done():
                        busy = True
                        break
                key = (numels[i], busy)
                if found_key is None or key < found_key:
                    found, found_key = pos, key
        if self.agree is not None and not self.agree(found is not None):
            return None
        if found is None:
            return None
        i = self._free[found]
        if self._host_waits is not None:
            # Waited for while still free: a wait interrupted (Ctrl-C) leaves the buffer in the pool
            # with what it waits for. Taken off first, it was lost for good: one buffer fewer for
            # every later step, until "all host staging buffers are busy".
            for pending in self._after[i]:
                self._host_waits(pending)
            self._after[i] = []
        del self._free[found]
        return self._buffers[i]

    def cached_views(self, buffer: torch.Tensor, key: int, make: Callable[[], List[torch.Tensor]]) -> List[torch.Tensor]:
        """Views of `buffer` (or of a view starting at its first byte) made by `make()` once per
        (buffer, key) and kept for the pool's life: a group's views of a device slot (its copy, its
        shard, each parameter) or a group's regions of a staging buffer, so that using them again
        costs no tensor creation. The references they hold are counted into
        the buffer's baseline, so the guard still tells when anything else points into it."""
        i = self._ptr_index[buffer.data_ptr()]
        views = self._views[i].get(key)
        if views is None:
            before = storage_references(buffer)
            views = make()
            self._baseline[i] += storage_references(buffer) - before
            self._views[i][key] = views
        return views

    def reuse_after(self, buffer: torch.Tensor) -> List[Pending]:
        """The work the next writer of a buffer just taken must wait for (see give()); then forgotten."""
        i = self._ptr_index[buffer.data_ptr()]
        after, self._after[i] = self._after[i], []
        return after

    def try_take_as(self, numel: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A free buffer's first `numel` elements viewed as `dtype`, or None if none that holds them is free."""
        nbytes = numel * dtype.itemsize
        buffer = self.take(-(-nbytes // self.element_bytes))
        if buffer is None:
            return None
        assert nbytes <= buffer.numel() * buffer.element_size(), f"{self.what} too small"
        return buffer.view(torch.uint8)[:nbytes].view(dtype)

    def take_as(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A free buffer's first `numel` elements viewed as `dtype` (must fit); raises if none is free."""
        buffer = self.try_take_as(numel, dtype)
        if buffer is None:
            raise RuntimeError(
                f"no {self.what} of {numel * dtype.itemsize} bytes is free among the {self.num_buffers} of its pool"
            )
        return buffer

    def discard_free(self) -> int:
        """Give the memory of every free buffer whose earlier users are done back to the OS until it
        is next written (MemoryTiers.discard; nothing where the memory cannot be discarded), for a
        stretch in which the pool's buffers sit idle. Only by the thread that owns the pool then.
        Returns the bytes discarded. Its contents are lost: for buffers that hold nothing between
        uses (host staging), never for device slots, which keep a group's copy."""
        discarded = 0
        for i in self._free:
            if all(p.done() for p in self._after[i]) and self._tiers.discard(self._buffers[i]):
                discarded += self._numels[i] * self.element_bytes
        return discarded

    def give(self, buffer: torch.Tensor, after: Sequence[Pending] = ()) -> None:
        """Return a buffer (or a view starting at its first byte) to the pool. `after`: the work still
        reading or writing it (a copy in flight, the compute that used it); the buffer is written
        again only once that is done ([Note: Ordering of copies] in runtime/device/accelerator.py)."""
        i = self._ptr_index[buffer.data_ptr()]
        assert i not in self._free, f"{self.what} returned twice"
        # Its next user waits for these to be over, never for their success ([Note: A failed transfer is
        # its own user's error] in device/pending.py).
        self._after[i] = [over(p) for p in after if not p.done()]
        self._free.append(i)
