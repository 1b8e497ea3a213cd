"""Tracer: a Chrome/Perfetto trace of one training step, so a person can see the overlap.

    engine.trace_next_step("trace.json")   # the next step is recorded, written when it ends
    # open trace.json in https://ui.perfetto.dev or chrome://tracing

Each kind of work is its own track: compute (forward and backward per group), parameter IO
(NVMe reads into the device copy, from issue to completion), parameter copies (from a memory
home into the device copy), gradient writes, optimizer IO (reads and writes per group and
state), optimizer updates, and communication (on several ranks: each all-gather and
reduce-scatter from issue to completion, and the small agreement collectives). Inactive (the
default), every call returns at once.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from io_engine import IOHandle
from io_engine.atomic_file import check_file_target, write_atomic

from offload_trainer.runtime.device.pending import IOPending, Pending

TRACKS = (
    "compute", "param io", "param copies", "gradient copies", "gradient writes", "optimizer io", "optimizer", "communication"
)


class Tracer:
    """Collects spans of one step while armed; thread-safe (IO completions arrive on workers)."""

    def __init__(self) -> None:
        self._path: Optional[Path] = None
        self.active = False
        """Whether armed (recording until finish()): an attribute, not a property, as the hot paths
        (every gradient, acquisition and update) ask it before building a span."""
        self._events: List[Dict[str, object]] = []
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        self._pending: List[Tuple[str, str, float, Pending, List[float]]] = []


    def arm(self, path: "str | os.PathLike[str]") -> None:
        """Record from now until finish() (the end of the next optimizer step). A directory at `path`, or
        a file where one of its directories goes, is refused now: finish() met it after the step."""
        check_file_target(path)
        self._path = Path(path)
        self.active = True
        self._events = []
        self._pending = []
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter()

    def span(self, track: str, name: str, start_s: float, end_s: float) -> None:
        if self._path is None:
            return
        start_s = max(start_s, self._origin)  # work begun before arm() (an update pass behind the forward)
        event = {
            "name": name,
            "ph": "X",
            "ts": (start_s - self._origin) * 1e6,
            "dur": max(end_s - start_s, 0.0) * 1e6,
            "pid": 0,
            "tid": TRACKS.index(track),
        }
        with self._lock:
            self._events.append(event)

    def io(
        self, track: str, name: str, work: Union[IOHandle, Pending, None], start_s: Optional[float] = None
    ) -> None:
        """A span from `start_s` (default now) to the completion of `work` (an IO request or a copy;
        now if None)."""
        if self._path is None:
            return
        start = self.now() if start_s is None else start_s
        if work is None:
            self.span(track, name, start, self.now())
            return
        pending = IOPending(work) if isinstance(work, IOHandle) else work
        # The end time is taken when the work completes (on a worker); finish() settles any whose
        # callback has not run yet (or that cannot call back), so no span is lost at the end.
        end: List[float] = []
        with self._lock:
            self._pending.append((track, name, start, pending, end))
        pending.add_done_callback(lambda: end.append(self.now()))

    def finish(self) -> Optional[Path]:
        """Write the trace (if armed) and disarm; returns its path."""
        if self._path is None:
            return None
        with self._lock:
            pending, self._pending = self._pending, []
        for track, name, start, work, end in pending:
            if not end:
                try:
                    work.wait()
                except Exception:  # noqa: BLE001 - the failure is reported where the work is waited for
                    pass
            self.span(track, name, start, end[0] if end else self.now())
        path, self._path = self._path, None
        self.active = False
        with self._lock:
            events = list(self._events)
        meta = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": track}}
            for i, track in enumerate(TRACKS)
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))
        return path
