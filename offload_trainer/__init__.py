"""offload-trainer: ZeRO-3 training with every state kind paged across device, host and NVMe.

    import offload_trainer as ot
    engine = ot.initialize(model, ot.OffloadConfig(tiers={"params": "nvme", "nvme_dir": "/nvme"}))

The package's layers (docs/design.md has the map): config/ (what the engine is told), runtime/
(the engine), planning/ (where state should live, and how fast a step will be), app/
(offload-train and offload-plan), models/ (the built-in decoder). This file is the public face.
"""

from offload_trainer.config import (
    ComputeDtype,
    GroupingConfig,
    LRSchedule,
    OffloadConfig,
    OptimizerConfig,
    OptimizerKind,
    Placement,
    PlacementMode,
    PrecisionConfig,
    PrefetchConfig,
    Tier,
    TierConfig,
)
from offload_trainer.errors import (
    BackwardOutsideEngineError,
    CheckpointError,
    NonFiniteError,
    PlanError,
    UnresidentReadError,
)
from offload_trainer.initialize import initialize
from offload_trainer.runtime.engine import Engine
from offload_trainer.version import __version__

__all__ = [
    "BackwardOutsideEngineError",
    "CheckpointError",
    "ComputeDtype",
    "Engine",
    "GroupingConfig",
    "LRSchedule",
    "NonFiniteError",
    "OffloadConfig",
    "OptimizerConfig",
    "OptimizerKind",
    "Placement",
    "PlacementMode",
    "PlanError",
    "PrecisionConfig",
    "PrefetchConfig",
    "Tier",
    "TierConfig",
    "UnresidentReadError",
    "__version__",
    "initialize",
]
