"""Checks run_checks.py makes before anything is built, as they depend on the machine."""

from __future__ import annotations

import os

import pytest

from offload_trainer.app import run_checks


def test_num_threads_is_checked_against_the_cpus_this_process_may_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `taskset -c 0` (or a scheduler's cpuset) on a 2-CPU machine, train.num_threads=2 passed the
    check against os.cpu_count() and ran two torch threads on one CPU."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    with pytest.raises(ValueError, match=r"^train.num_threads=2 is more than the 1 CPUs this process may run on"):
        run_checks.check_num_threads(2)
    run_checks.check_num_threads(1)
    run_checks.check_num_threads(None)
