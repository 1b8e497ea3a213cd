"""offload-trainer: ZeRO-3 training with every state kind paged across device, host and NVMe.

    import offload_trainer as ot
    engine = ot.initialize(model, ot.OffloadConfig(tiers={"params": "nvme", "nvme_dir": "/nvme"}))

The package's layers (docs/design.md has the map): config/ (what the engine is told), runtime/
(the engine), planning/ (where state should live, and how fast a step will be), app/
(offload-train and offload-plan), models/ (the built-in decoder). This file is the public face.

Its names are imported on first use (PEP 562): importing the package itself imports neither torch
nor the engine, so that the command lines (app/launch.py) answer SIGTERM and Ctrl-C from their first
instant instead of dying silently, or with a traceback, during the seconds torch takes to import.
"""

from __future__ import annotations

from offload_trainer.python_version import require_supported_python

require_supported_python()  # first: on an older Python one line, not a traceback from deep in an import

import importlib  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from typing import TYPE_CHECKING, Any, Dict, List  # noqa: E402

if TYPE_CHECKING:
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
        GradientReadError,
        NonFiniteError,
        PartialStateError,
        PlanError,
        RanksOutOfStepError,
        UnresidentReadError,
    )
    from offload_trainer.initialize import initialize
    from offload_trainer.runtime.engine import Engine
    from offload_trainer.version import __version__

_HOMES: Dict[str, str] = {
    **{name: "offload_trainer.config" for name in (
        "ComputeDtype", "GroupingConfig", "LRSchedule", "OffloadConfig", "OptimizerConfig", "OptimizerKind",
        "Placement", "PlacementMode", "PrecisionConfig", "PrefetchConfig", "Tier", "TierConfig",
    )},
    **{name: "offload_trainer.errors" for name in (
        "BackwardOutsideEngineError", "CheckpointError", "GradientReadError", "NonFiniteError", "PartialStateError",
        "PlanError", "RanksOutOfStepError", "UnresidentReadError",
    )},
    "initialize": "offload_trainer.initialize",
    "Engine": "offload_trainer.runtime.engine",
    "__version__": "offload_trainer.version",
}
"""Each public name and the module that defines it."""

__all__ = sorted(_HOMES, key=lambda name: (name.startswith("_") or name.islower(), name))


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'offload_trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_HOMES))


class _PublicFace(types.ModuleType):
    """This package, whose public names are never hidden by its submodules: importing the submodule
    offload_trainer.initialize sets the package's attribute `initialize` to that module, which hid
    the function of the same name (`ot.initialize(...)`: "'module' object is not callable")."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _PublicFace
