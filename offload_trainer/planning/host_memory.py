"""The memory a plan may use where a budget is unset: this rank's share of what is free.

    available = memory_available_bytes()         # bytes: psutil's available, within the cgroup's limit
    budget = host_memory_for_planning()          # bytes; HOST_SHARE of the memory available, per local rank
    budget = gpu_memory_for_planning(device)     # bytes; DEVICE_SHARE of the GPU's free memory

[Note: An unset host budget is the machine's memory]
The engine enforces no host budget when none is set, and the planner used to take "none" as
"unlimited": with an NVMe directory given, `placement = "auto"` (and offload-plan) chose homes in
host memory for a 7B model on a 24 GiB machine (100 GiB of them, the fastest placement on paper),
and the run was killed by the kernel while it built the engine. A plan is for this machine, so an
unset host budget plans with what it has: HOST_SHARE of the memory available now (psutil's
`available`: free memory plus what the kernel can reclaim; in a container no more than its memory
cgroup leaves, cgroup_memory.py), shared by the ranks on this node
(torchrun's LOCAL_WORLD_SIZE). On a CPU without a device budget the device tier (activations and
slots) is host memory too, so there both tiers count against it (planner.over_budget). A budget
that is set is the user's to choose: it is used as it is, above the machine's memory or not (it
may be for another machine); a plan that keeps more in host memory than is available now says so
(PlacementChoice.memory_note: a warning from offload-plan and placement = "auto").
A GPU likewise: an unset tiers.device_budget_bytes plans with DEVICE_SHARE of the GPU's free
memory (each rank has a GPU of its own), and the engine then gets that budget, less the
activations, as it gets a budget that is set (PlacementChoice.engine_config), so that its slots are
those the plan counted. Before, a model larger than the GPU was planned all on the device.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import psutil

from offload_trainer.config import Tier
from offload_trainer.planning.cgroup_memory import cgroup_memory_room_bytes
from offload_trainer.config.byte_size import format_bytes

if TYPE_CHECKING:
    import torch

HOST_SHARE = 0.8
"""Share of the memory available that a plan may fill when tiers.host_budget_bytes is unset: the
rest is the process itself (torch, Python, the model's code) and the page cache the disk needs."""

DEVICE_SHARE = 0.9
"""Share of a GPU's free memory that a plan may fill when tiers.device_budget_bytes is unset: the
rest is the CUDA context's and the caching allocator's fragmentation."""


def local_ranks() -> int:
    """The ranks on this node (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun or where it is not a count)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def memory_available_bytes() -> int:
    """Bytes of host memory this process can still take: psutil's `available` (free plus reclaimable),
    and no more than its memory cgroup's limit leaves (a container's: cgroup_memory.py)."""
    available = int(psutil.virtual_memory().available)
    room = cgroup_memory_room_bytes()
    return available if room is None else min(available, room)


def host_memory_for_planning() -> int:
    """Bytes of host memory one rank's plan may use when no host budget is set."""
    return int(HOST_SHARE * memory_available_bytes()) // local_ranks()


def gpu_memory_for_planning(device: "torch.device") -> int:
    """Bytes of a GPU's memory a plan may use when no device budget is set."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return int(DEVICE_SHARE * free)


def unset_budget_words(tier: Tier, budget: int) -> str:
    """How a report names the budget an unset tiers.host_budget_bytes or tiers.device_budget_bytes
    (`tier`) planned with."""
    if tier is Tier.DEVICE:
        share = f"{DEVICE_SHARE:.0%} of the GPU's free memory"
    else:
        ranks = local_ranks()
        share = f"{HOST_SHARE:.0%} of the memory available" + (f", shared by {ranks} ranks" if ranks > 1 else "")
    return f"{format_bytes(budget)}: {share}, tiers.{tier.value}_budget_bytes unset"
