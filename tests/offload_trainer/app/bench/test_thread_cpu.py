"""ThreadCpu: CPU seconds by kind of thread, from /proc/self/task (Linux)."""

from __future__ import annotations

import threading
import time

import pytest

from offload_trainer.app.bench import thread_cpu
from offload_trainer.app.bench.thread_cpu import ThreadCpu

pytestmark = pytest.mark.skipif(not ThreadCpu.available, reason="needs /proc/self/task (Linux)")


def test_cpu_is_counted_by_the_kind_of_thread_that_used_it() -> None:
    """A thread named as the engine names its IO workers spins until it has used a few clock ticks
    of CPU; that CPU counts as "io", the main thread's as "training", nothing is negative, and a
    thread that ended before the second reading is not counted. Only CPU counts are compared."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(i * i for i in range(1000))

    worker = threading.Thread(target=spin, name="io_engine-7", daemon=True)
    main = threading.main_thread().native_id
    enough = 3 / thread_cpu._TICKS
    with ThreadCpu() as cpu:
        start = thread_cpu._thread_seconds()
        worker.start()
        while True:  # until each thread has used a few clock ticks (the main thread computes too)
            now = thread_cpu._thread_seconds()
            if now.get(worker.native_id or -1, 0.0) >= enough and now[main] - start[main] >= enough:
                break
            sum(i * i for i in range(1000))
    stop.set()
    worker.join()
    assert cpu.seconds.get("io", 0.0) > 0
    assert cpu.seconds["training"] > 0
    assert all(seconds >= 0 for seconds in cpu.seconds.values())
    assert cpu.total_s == pytest.approx(sum(cpu.seconds.values()))

    with ThreadCpu() as later:
        short = threading.Thread(target=lambda: time.sleep(0.01), name="io_engine-8")
        short.start()
        short.join()
    assert "io" not in later.seconds


def test_the_entering_threads_cpu_is_counted_below_a_clock_tick() -> None:
    """/proc counts in clock ticks (10 ms): a tiny plain step read 0 s of training-thread CPU in
    bench_offload (its test failed on that once). The thread that enters and leaves is read with
    time.thread_time: work far shorter than a tick counts, and no more than the thread used."""
    for _ in range(5):
        before = time.thread_time()
        with ThreadCpu() as cpu:
            sum(i * i for i in range(200))
        used = time.thread_time() - before
        assert 0 < cpu.seconds["training"] <= used
