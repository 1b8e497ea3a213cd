"""Phase: which part of a training step is running. Owned by the PrefetchScheduler (scheduler.py),
which the engine tells when a forward or a backward begins and ends."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Which part of a training step is running."""

    IDLE = "idle"
    """Between calls: no forward or backward is running."""
    FORWARD = "forward"
    """A forward of the wrapped model is running."""
    BACKWARD = "backward"
    """engine.backward() is running (recomputation under checkpointing happens in it too)."""
