"""CPU seconds of this process by kind of thread, read from /proc/self/task: where a step's cycles go.

    with ThreadCpu() as cpu:
        step()
    cpu.seconds   # {"training": 2.9, "torch pool": 2.1, "io": 0.6, "optimizer": 0.3, ...}

On a machine with few cores the engine's own threads (IO workers moving and checksumming bytes, the
optimizer's update pass, copy workers) take cycles from the forward and backward that run beside
them, so a step cannot be shorter than the process's CPU seconds divided by the cores it may use,
however well the waits overlap. bench_offload reports this per step, for the engine and for plain
PyTorch, so that a step ratio above 1 can be told apart: time spent waiting (the engine's exposed
counters) or cycles spent elsewhere (this).

Kinds: Python threads by their name (the engine names its own: "io_engine-N", "optimizer-updates",
"copy-..."; the main thread is "training"), and "torch pool" for every thread Python does not know
(PyTorch's intra-op pool, where most of the forward and backward computes on the CPU). Threads
that ended between the two readings are not counted (the engine's live for its whole life).
/proc counts in clock ticks (10 ms here), so the thread that enters and leaves (the training
thread, as bench_offload uses it) is read with time.thread_time instead: a tiny plain step took
less than a tick there and read 0.
Linux only; elsewhere `available` is False and nothing is counted.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Dict, Optional

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_TASKS = "/proc/self/task"


def _kind(name: str, is_main: bool) -> str:
    if is_main:
        return "training"
    if name.startswith("io_engine-"):
        return "io"
    if name == "optimizer-updates":
        return "optimizer"
    if name.startswith("copy-"):
        return "copies"
    return "other python"


def _thread_seconds() -> Dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by thread id."""
    out: Dict[int, float] = {}
    for entry in os.listdir(_TASKS):
        try:
            with open(f"{_TASKS}/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        # Fields after the command name (which may hold spaces), itself in parentheses.
        fields = stat[stat.rindex(b")") + 2 :].split()
        out[int(entry)] = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
    return out


class ThreadCpu:
    """The CPU seconds each kind of thread used between __enter__ and __exit__ (`seconds`)."""

    available = os.path.isdir(_TASKS)

    def __init__(self) -> None:
        self._before: Optional[Dict[int, float]] = None
        self._own: Optional[tuple] = None
        """(native id, time.thread_time()) of the thread that entered."""
        self.seconds: Dict[str, float] = {}

    def __enter__(self) -> "ThreadCpu":
        self._before = _thread_seconds() if self.available else {}
        self._own = (threading.get_native_id(), time.thread_time())
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.available or self._before is None:
            return
        after = _thread_seconds()
        assert self._own is not None
        own, own_before = self._own
        if own == threading.get_native_id() and own in after:  # the entering thread, to the nanosecond
            after[own], self._before[own] = time.thread_time(), own_before
        main = threading.main_thread().native_id
        kinds = {t.native_id: _kind(t.name, t.native_id == main) for t in threading.enumerate()}
        seconds: Dict[str, float] = {}
        for tid, now in after.items():
            kind = kinds.get(tid, "torch pool")
            seconds[kind] = seconds.get(kind, 0.0) + now - self._before.get(tid, 0.0)
        self.seconds = seconds

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


__all__ = ["ThreadCpu"]
