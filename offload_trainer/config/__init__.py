"""The engine's configuration: a typed loader (loader.py), byte sizes (byte_size.py), placements
(placement.py), the engine's sections (sections.py) and OffloadConfig (offload.py), which holds them.

Nothing here imports the runtime, the planner or the app: they all read it.
"""

from offload_trainer.config.byte_size import format_bytes, parse_bytes
from offload_trainer.config.loader import ConfigFile, merge_sections
from offload_trainer.config.offload import OffloadConfig
from offload_trainer.config.placement import Placement, PlacementMode, Tier
from offload_trainer.config.sections import (
    ComputeDtype,
    GroupingConfig,
    LRSchedule,
    OptimizerConfig,
    OptimizerKind,
    PrecisionConfig,
    PrefetchConfig,
    TierConfig,
)

__all__ = [
    "ComputeDtype",
    "ConfigFile",
    "GroupingConfig",
    "LRSchedule",
    "OffloadConfig",
    "OptimizerConfig",
    "OptimizerKind",
    "Placement",
    "PlacementMode",
    "PrecisionConfig",
    "PrefetchConfig",
    "Tier",
    "TierConfig",
    "format_bytes",
    "merge_sections",
    "parse_bytes",
]
