"""torch's intra-op threads for a run: train.num_threads, else torch's default held to the CPUs usable.

    use_run_threads(cfg.train.num_threads)    # offload-train at its start; offload-plan before it measures

torch's default counts the cores of the affinity, not a container's CPU quota: 32 threads on 2 CPUs'
worth of time are throttled together every period (io_engine/usable_cpus.py). offload-train and
offload-plan read the same config, and offload-plan predicts offload-train's step from compute times
it measures: measured under other threads than the run's (torch's 64 throttled threads, or 16 where
train.num_threads = 4), they predicted another machine, and offload-train measured again (the
caches' keys hold the thread count). Both call this first.
"""

from __future__ import annotations

from typing import Optional

import torch

from io_engine.usable_cpus import usable_cpus


def use_run_threads(num_threads: Optional[int]) -> int:
    """Set torch's intra-op threads for a run whose train.num_threads is `num_threads` (checked against
    the usable CPUs by run_checks.check_num_threads): that number, or where None torch's default
    lowered to the usable CPUs if above them. Returns the threads now in use."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    elif torch.get_num_threads() > usable_cpus():
        torch.set_num_threads(usable_cpus())
    return torch.get_num_threads()


__all__ = ["use_run_threads"]
