"""StreamRaces: a happens-before check of every access to memory a copy touches, for CudaAccelerator
on the CPU.

    races = StreamRaces.install(monkeypatch)          # torch.cuda faked; every aten op logged
    with races.watching():
        ...train with CudaAccelerator (its torch_device the CPU)...
    assert not races.found, races.report()

The simulated accelerator shows a use of a copy's destination before the copy landed (NaN, stale
values); it cannot show a copy that runs too early, before compute it should follow (a slot
overwritten while a kernel may still read it, a gradient copied off before the kernel that wrote
it), because its compute is done when it returns. This checks the order a GPU would keep instead:
torch.cuda's streams and events are test_cuda_host_waits.py's fakes (every op of a stream takes
its next position; an event carries the positions its stream has reached or waited for; a host
wait marks them finished). Every aten op (a TorchDispatchMode, on the training thread and the
update thread) is an op of the current stream, or host work where it touches host memory (the
host tier's arenas); every non_blocking copy_ is an op of its copy stream; an NVMe read or write
(io_engine's submission) is host work on its buffer when issued (a buffer written by a copy off the
device is written to NVMe only after a host wait for that copy; one a copy to the device reads is
read into only after it: the disk's side runs on IO threads the streams know nothing of). Each
access to memory that another stream wrote (or read, for a write) must follow that op: through its
own stream's waits, or because the host had waited for it before issuing this one. Pairs with no copy on either
side are not checked (the fakes cannot tell a host tensor from a device one outside the arenas).

Memory a new tensor takes forgets what was done to it before (the CPU allocator reuses addresses
the CUDA caching allocator would keep per stream). What the caching allocator does instead is
checked where memory is freed: a tensor made by an op on one stream (its allocation stream) and
used by another stream (a copy of a gradient off the device, compute reading a boundary copied
into memory the copy stream allocated) may be freed only once those uses are done (a host wait),
ordered before the allocation stream's next work, or marked with `record_stream`: the allocator
hands freed memory to the next allocation on its allocation stream at once, so a use still queued
on another stream would meet the next tensor's bytes ("freed on ..." in the report). A load cancelled in flight (evict_all before a
step or a checkpoint load) still reads its host home, which the host may then overwrite: harmless,
its slot is lent again only after the copy and its data is never used, so its reads are forgotten.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import offload_trainer as ot
import offload_trainer.runtime.optimizer_pipeline as optimizer_pipeline
from offload_trainer.config import Tier
from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.groups.tiers import MemoryTiers
from tests.offload_trainer.runtime.device.test_cuda_host_waits import DependencyCuda, FakeEvent
from tests.offload_trainer.runtime.device.test_cuda_streams import install_fake_streams

PACKAGE = str(Path(ot.__file__).parent)
PAGE_BYTES = 4096
KEEP_PER_PAGE = 48
"""Accesses remembered per page of memory (the latest): enough for a step of the tests' models."""
COPY_STREAMS = ("h2d", "d2h", "comm")
_in_copy = threading.local()




def watch_the_update_thread(monkeypatch: pytest.MonkeyPatch, ops: Any) -> None:
    """The optimizer's update thread runs under `ops` (a dispatch mode) too: a mode is per thread."""
    real_loop = optimizer_pipeline.OptimizerPipeline._worker_loop

    def loop(*args: Any) -> None:
        with ops:
            real_loop(*args)

    monkeypatch.setattr(optimizer_pipeline.OptimizerPipeline, "_worker_loop", staticmethod(loop))


def _span(t: Any) -> Optional[Tuple[int, int]]:
    """The byte range a CPU tensor covers (from its first element to one past its last)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
        return None
    lo = t.data_ptr()
    last = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * t.element_size()


def _arg_spans(func: Any, args: Any, kwargs: Dict[str, Any]) -> Iterator[Tuple[Tuple[int, int], bool]]:
    """Each CPU tensor argument of the aten op `func` as (its byte span, whether the op writes it), by
    the op's schema (an argument whose alias info says it is written: out=, an in-place self)."""
    schema = func._schema
    values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
    for arg, value in zip(schema.arguments, values):
        written = arg.alias_info is not None and arg.alias_info.is_write
        for t in tree_flatten(value)[0]:
            span = _span(t)
            if span is not None:
                yield span, written


def _site() -> str:
    """The engine's frames that made an access, innermost first, outside the copy path."""
    names: List[str] = []
    frame = sys._getframe(1)
    while frame is not None and len(names) < 3:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE) and "/device/" not in path:
            names.append(f"{Path(path).name}:{frame.f_code.co_name}")
        frame = frame.f_back  # type: ignore[assignment]
    return " < ".join(names)


class _Ops(TorchDispatchMode):
    """Every aten op, as an op of the current stream or as host work (StreamRaces.op)."""

    def __init__(self, races: "StreamRaces") -> None:
        super().__init__()
        self.races = races

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or getattr(_in_copy, "active", False) or func._overloadpacket is torch.ops.aten.set_:
            return out
        reads: List[Tuple[int, int]] = []
        writes: List[Tuple[int, int]] = []
        for span, written in _arg_spans(func, args, kwargs):
            (writes if written else reads).append(span)
        inputs = reads + writes
        new = [
            s for s in map(_span, tree_flatten(out)[0])
            if s is not None and not any(a < s[1] and s[0] < b for a, b in inputs)
        ]
        self.races.op(reads, writes, new)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        fresh = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and _span(t) in new]
        self.races.allocator_uses(tensors, fresh)
        return out


class StreamRaces:
    """The accesses seen so far and the pairs of them that no wait orders (module docstring)."""

    def __init__(self, cuda: DependencyCuda) -> None:
        self.cuda = cuda
        self._lock = threading.RLock()
        self._pages: Dict[int, List[Tuple[int, int, str, int, bool, str]]] = defaultdict(list)
        """Per page: the latest accesses (lo, hi, stream or "host", position, is a write, site)."""
        self._host: List[Tuple[int, int]] = []
        """The host tier's arenas: an op that touches them is host work."""
        self.found: Counter = Counter()
        """(earlier access, later access, earlier site, later site) -> times seen."""
        self._ops = _Ops(self)
        self._allocated: Dict[int, Tuple[str, List[Tuple[str, int, str]], set]] = {}
        """Per storage (by id, while it lives) made by an op on a stream: that stream's name, the uses
        by other streams (stream, position, site) and the streams record_stream named."""

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch) -> "StreamRaces":
        cuda = DependencyCuda()
        FakeEvent.cuda = cuda
        install_fake_streams(monkeypatch, cuda, FakeEvent)
        cuda._names = iter(COPY_STREAMS * 100)  # type: ignore[attr-defined]  # several engines
        monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
        races = cls(cuda)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: races.record_stream(self, stream))
        import io_engine.buffers
        import io_engine.engine

        monkeypatch.setattr(io_engine.buffers, "cuda_pinning_available", lambda: False)
        real_copy = torch.Tensor.copy_

        def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            if not non_blocking:
                return real_copy(self, src)
            stream = cuda.current_stream()  # a copy of the accelerator's, on its copy stream
            stream.op()
            for span, write in ((_span(src), False), (_span(self), True)):
                if span is not None:
                    races.access(span, stream, write)
            device, host = (src, self) if stream.name == "d2h" else (self, src)
            races.allocator_uses([device], [], host=[host])
            _in_copy.active = True
            try:
                return real_copy(self, src)
            finally:
                _in_copy.active = False

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        real_reserve, real_allocate = MemoryTiers.reserve, MemoryTiers.allocate

        def reserve(self: MemoryTiers, tier: Tier, nbytes: int) -> None:
            real_reserve(self, tier, nbytes)
            if tier is Tier.HOST and tier in self._arenas:
                races._host.append(_span(self._arenas[tier].tensor))  # type: ignore[arg-type]

        def allocate(self: MemoryTiers, tier: Tier, *args: Any, **kwargs: Any) -> torch.Tensor:
            tensor = real_allocate(self, tier, *args, **kwargs)
            span = _span(tensor)
            if tier is Tier.HOST and span is not None:
                races._host.append(span)
            return tensor

        monkeypatch.setattr(MemoryTiers, "reserve", reserve)
        monkeypatch.setattr(MemoryTiers, "allocate", allocate)
        real_cancel = ShardGroup.cancel_load

        def cancel_load(self: ShardGroup) -> Any:
            home = self.param_home.tensor
            if home is not None:
                races.forget_reads(_span(home), "h2d")  # type: ignore[arg-type]
            return real_cancel(self)

        monkeypatch.setattr(ShardGroup, "cancel_load", cancel_load)
        real_submit = io_engine.engine.IOEngine._submit

        def submit(self: Any, file: Any, parts: Any, is_read: bool, background: bool = False) -> Any:
            # An NVMe transfer is host work issued now: its buffer must be free of copies in flight.
            # (Its own later accesses, on an IO thread, are ordered by the IO handle, not by streams.)
            for part in parts:
                view, address = io_engine.engine.byte_view(part.buf, writable=False)
                size = len(view) if part.size is None else part.size
                races.access((address, address + size), None, is_read)
            return real_submit(self, file, parts, is_read, background)

        monkeypatch.setattr(io_engine.engine.IOEngine, "_submit", submit)
        watch_the_update_thread(monkeypatch, races._ops)
        return races

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        with self._ops:
            yield

    def _is_host(self, span: Tuple[int, int]) -> bool:
        return any(a < span[1] and span[0] < b for a, b in self._host)

    def op(self, reads: List[Tuple[int, int]], writes: List[Tuple[int, int]], new: List[Tuple[int, int]]) -> None:
        host = any(self._is_host(s) for s in reads + writes)
        stream = None if host else self.cuda.current_stream()
        if stream is not None:
            stream.op()
        with self._lock:
            for span in new:  # fresh memory: what was done to the address before is another tensor's
                for page in range(span[0] // PAGE_BYTES, (span[1] - 1) // PAGE_BYTES + 1):
                    self._pages[page] = [r for r in self._pages[page] if not (r[0] < span[1] and span[0] < r[1])]
        for span in reads:
            self.access(span, stream, False)
        for span in writes + new:
            self.access(span, stream, True)

    def allocator_uses(
        self, tensors: List[torch.Tensor], fresh: List[torch.Tensor], host: Sequence[torch.Tensor] = ()
    ) -> None:
        """The current stream made `fresh` and used `tensors` (the caching allocator's view: module
        docstring); `host`: the host side of a copy, host memory (pinned under CUDA, where the host
        allocator keeps it for the copies that used it), not the device allocator's."""
        stream = self.cuda.current_stream()
        with self._lock:
            for t in host:
                self._allocated.pop(id(t.untyped_storage()), None)
            for t in fresh:
                if self._is_host(_span(t)):  # type: ignore[arg-type]
                    continue
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._allocated:
                    self._allocated[key] = (stream.name, [], set())
                    weakref.finalize(storage, self._freed, key, _site())
            for t in tensors:
                if t.device.type != "cpu" or t.numel() == 0:
                    continue
                entry = self._allocated.get(id(t.untyped_storage()))
                if entry is not None and entry[0] != stream.name:
                    entry[1].append((stream.name, stream.reached[stream.name], _site()))

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        with self._lock:
            entry = self._allocated.get(id(tensor.untyped_storage()))
            if entry is not None:
                entry[2].add(stream.name)

    def _freed(self, key: int, made_at: str) -> None:
        """A storage made on a stream is freed: its uses by other streams must be over or ordered."""
        with self._lock:
            entry = self._allocated.pop(key, None)
            if entry is None:
                return
            alloc, uses, recorded = entry
            owner = next((s for s in reversed(self.cuda._streams) if s.name == alloc), None)
            finished = dict(self.cuda.finished)
            for name, position, site in uses:
                if name in recorded or finished.get(name, 0) >= position:
                    continue
                if owner is not None and owner.reached.get(name, 0) >= position:
                    continue
                self.found[(f"use on {name}", f"freed (made on {alloc})", site, made_at)] += 1

    def forget_memory(self) -> None:
        """Every engine made so far is closed: the memory it had (its host arenas too) may be another's next."""
        with self._lock:
            self._host = []
            self._pages.clear()

    def forget_reads(self, span: Tuple[int, int], stream: str) -> None:
        with self._lock:
            for page in range(span[0] // PAGE_BYTES, (span[1] - 1) // PAGE_BYTES + 1):
                self._pages[page] = [
                    r for r in self._pages[page] if not (r[2] == stream and not r[4] and r[0] < span[1] and span[0] < r[1])
                ]

    def access(self, span: Tuple[int, int], stream: Any, write: bool) -> None:
        """An access by `stream` (a fake stream, after its op(); None: the host) to `span`."""
        lo, hi = span
        if hi <= lo:
            return
        with self._lock:
            name = "host" if stream is None else stream.name
            reached = {} if stream is None else dict(stream.reached)
            finished = dict(self.cuda.finished)
            site = _site()
            for page in range(lo // PAGE_BYTES, (hi - 1) // PAGE_BYTES + 1):
                for a, b, other, position, wrote, other_site in self._pages[page]:
                    if not (a < hi and lo < b) or not (write or wrote) or other in ("host", name):
                        continue
                    if other not in COPY_STREAMS and name not in COPY_STREAMS:
                        continue
                    if reached.get(other, 0) >= position or finished.get(other, 0) >= position:
                        continue
                    what = (f"{'write' if wrote else 'read'} on {other}", f"{'write' if write else 'read'} on {name}")
                    self.found[(*what, other_site, site)] += 1
            record = (lo, hi, name, 0 if stream is None else stream.reached[name], write, site)
            for page in range(lo // PAGE_BYTES, (hi - 1) // PAGE_BYTES + 1):
                records = self._pages[page]
                records.append(record)
                del records[:-KEEP_PER_PAGE]

    def report(self) -> str:
        return "\n".join(
            f"{n} x {first} ({first_site}) then unordered {then} ({then_site})"
            for (first, then, first_site, then_site), n in self.found.most_common(10)
        )
