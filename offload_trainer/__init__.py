"""offload-trainer: ZeRO-3 training with every state kind paged across device, host and NVMe.

    import offload_trainer as ot
    engine = ot.initialize(model, ot.OffloadConfig(tiers={"params": "nvme", "nvme_dir": "/nvme"}))
"""

from .config import (
    ComputeDtype,
    GroupingConfig,
    LRSchedule,
    OffloadConfig,
    OptimizerConfig,
    OptimizerKind,
    Placement,
    PrecisionConfig,
    PrefetchConfig,
    Tier,
    TierConfig,
)
from .checkpoint import CheckpointError
from .engine import Engine, initialize
from .memory_plan import PlanError

__all__ = [
    "CheckpointError",
    "ComputeDtype",
    "Engine",
    "GroupingConfig",
    "LRSchedule",
    "OffloadConfig",
    "OptimizerConfig",
    "OptimizerKind",
    "Placement",
    "PlanError",
    "PrecisionConfig",
    "PrefetchConfig",
    "Tier",
    "TierConfig",
    "initialize",
]
