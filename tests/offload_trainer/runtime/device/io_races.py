"""IORaces: every access that overlaps an NVMe transfer still in flight, on the CPU engines.

    races = IORaces.install(monkeypatch)              # io_engine's submissions watched
    with races.watching():
        ...train on the CPU or the simulated accelerator...
    assert not races.found, races.report()

stream_races.py orders copies against compute and host work; an NVMe transfer is host work there,
checked once, when it is issued: what happens to its memory while an IO thread moves it is ordered
by its handle, which that check does not follow, and neither does it see the swap files' bytes. This
checks both while a request is in flight (its handle not done): a request on bytes of a swap file
that another request in flight writes (or reads, for a write: FileStore's "a read or write of the
same bytes must not start before this one is done"), and an access to host memory an NVMe request
in flight reads (a write to it) or writes (any access): a request's own, an aten op of the training
or the update thread, a copy of the copy path when the copy worker makes it. An access that follows
its request through a wait is never in flight; one that skips the wait is, when the request is
slow enough: so the tests make every NVMe read and write late (late_nvme of
test_late_copy_scenarios.py).

A parameter load cancelled in flight (evict_all before a step or a load of new weights, a wrong
prediction) may still read its NVMe home when the update pass or the load writes it: its bytes are
never used (its slot or staging buffer is lent again only once it is over, and the extent's checksum
generations keep such a read from judging or recording the chunk), so its reads of the file are
forgotten, as stream_races.py forgets its copies' reads. Its memory is still checked.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import io_engine.engine
import offload_trainer as ot
import offload_trainer.runtime.device.copy_worker as copy_worker
from offload_trainer.runtime.groups.shard_group import ShardGroup
from tests.offload_trainer.runtime.device.stream_races import _arg_spans, _span, watch_the_update_thread

PACKAGE = str(Path(ot.__file__).parent)
_loading = threading.local()
"""The group whose ShardGroup.start_load runs on this thread (its requests are that load's)."""


def _site() -> str:
    """The engine's frames that made an access, innermost first."""
    names: List[str] = []
    frame = sys._getframe(1)
    while frame is not None and len(names) < 3:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE):
            names.append(f"{Path(path).name}:{frame.f_code.co_name}")
        frame = frame.f_back  # type: ignore[assignment]
    return " < ".join(names) or "?"


def _overlap(a: Tuple[int, int], b: Tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class _Request:
    """One io_engine request: its handle, direction, file spans, memory spans and where it was issued."""

    def __init__(
        self, handle: Any, is_read: bool, path: str, files: List[Tuple[int, int]], memory: List[Tuple[int, int]],
        site: str, load: Optional[ShardGroup],
    ) -> None:
        self.handle = handle
        self.load = load
        """The group whose parameter load issued it (None: another request)."""
        self.cancelled = False
        """Its load was cancelled: its reads of the file are forgotten (module docstring)."""
        self.is_read = is_read
        self.path = path
        self.files = files
        self.memory = memory
        self.site = site


class _Ops(TorchDispatchMode):
    def __init__(self, races: "IORaces") -> None:
        super().__init__()
        self.races = races

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.is_view:
            return func(*args, **kwargs)
        for span, written in _arg_spans(func, args, kwargs):
            self.races.memory_access(span, written, f"aten {func._overloadpacket.__name__}")
        return func(*args, **kwargs)


class IORaces:
    """The NVMe requests in flight, and the accesses found overlapping them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: List[_Request] = []
        self.found: Counter = Counter()
        """(what the request in flight does, what overlapped it, its site, the access's site) -> times."""
        self._ops = _Ops(self)

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch) -> "IORaces":
        races = cls()
        real_submit = io_engine.engine.IOEngine._submit

        def submit(self: Any, file: Any, parts: Any, is_read: bool, background: bool = False) -> Any:
            files, memory = [], []
            for part in parts:
                view, address = io_engine.engine.byte_view(part.buf, writable=False)
                size = len(view) if part.size is None else part.size
                files.append((part.offset, part.offset + size))
                memory.append((address, address + size))
            site = _site()
            races._check_request(str(file.path), is_read, files, memory, site)
            handle = real_submit(self, file, parts, is_read, background)
            with races._lock:
                races._inflight.append(
                    _Request(handle, is_read, str(file.path), files, memory, site, getattr(_loading, "group", None))
                )
            return handle

        monkeypatch.setattr(io_engine.engine.IOEngine, "_submit", submit)
        real_start_load, real_cancel_load = ShardGroup.start_load, ShardGroup.cancel_load

        def start_load(self: ShardGroup, *args: Any, **kwargs: Any) -> None:
            _loading.group = self
            try:
                real_start_load(self, *args, **kwargs)
            finally:
                _loading.group = None

        def cancel_load(self: ShardGroup) -> Any:
            with races._lock:
                for r in races._inflight:
                    r.cancelled = r.cancelled or r.load is self
            return real_cancel_load(self)

        monkeypatch.setattr(ShardGroup, "start_load", start_load)
        monkeypatch.setattr(ShardGroup, "cancel_load", cancel_load)
        real_copy_host = copy_worker.copy_host

        def copy_host(dst: torch.Tensor, src: torch.Tensor) -> None:
            for span, write in ((_span(src), False), (_span(dst), True)):
                if span is not None:
                    races.memory_access(span, write, "copy")
            real_copy_host(dst, src)

        monkeypatch.setattr(copy_worker, "copy_host", copy_host)
        watch_the_update_thread(monkeypatch, races._ops)
        return races

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        with self._ops:
            yield

    def _live(self) -> List[_Request]:
        with self._lock:
            self._inflight = [r for r in self._inflight if not r.handle.done()]
            return list(self._inflight)

    def _check_request(self, path: str, is_read: bool, files: List[Tuple[int, int]], memory: List[Tuple[int, int]], site: str) -> None:
        for r in self._live():
            what = "read" if r.is_read else "write"
            cancelled_read = r.cancelled and r.is_read
            if r.path == path and not cancelled_read and (not is_read or not r.is_read) and any(
                _overlap(a, b) for a in files for b in r.files
            ):
                self.found[(f"nvme {what} of the file", f"nvme {'read' if is_read else 'write'} of its bytes", r.site, site)] += 1
            # A read writes its memory; a write reads it.
            if (is_read or r.is_read) and any(_overlap(a, b) for a in memory for b in r.memory):
                self.found[(f"nvme {what} of memory", f"nvme {'read' if is_read else 'write'} of it", r.site, site)] += 1

    def memory_access(self, span: Tuple[int, int], write: bool, how: str) -> None:
        for r in self._live():
            if (write or r.is_read) and any(_overlap(span, m) for m in r.memory):
                what = "read" if r.is_read else "write"
                self.found[(f"nvme {what} of memory", f"{how} {'write' if write else 'read'}", r.site, _site())] += 1

    def report(self) -> str:
        return "\n".join(
            f"{n} x {first} ({first_site}) then, still in flight, {then} ({then_site})"
            for (first, then, first_site, then_site), n in self.found.most_common(12)
        )
