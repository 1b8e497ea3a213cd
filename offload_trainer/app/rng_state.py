"""The random generators a run draws from, saved with each checkpoint so that a resumed run draws what
an uninterrupted one would (dropout of a Hugging Face model, LoRA's dropout).

    extra.update(rng_state(engine.device))                 # when saving
    load_rng_state(extra, engine.device, checkpoint)       # when resuming; CheckpointError if unusable

The CPU generator always ("torch_rng"); the generator of the engine's CUDA device as well when it runs
on one ("cuda_rng"): dropout on a CUDA tensor draws from the device's generator, never the CPU's, so a
checkpoint holding the CPU's alone resumed with the device's generator back at its seed, and drew other
dropout masks than the uninterrupted run. Under several ranks rank 0's states are saved: every rank
seeds alike and draws alike (its rows have the same shapes), so every rank's states are rank 0's.
A checkpoint saved on the CPU and resumed on a GPU (or the other way round) keeps the CPU's state only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch

from offload_trainer.errors import CheckpointError


def rng_state(device: torch.device) -> Dict[str, Any]:
    """The generators' states, JSON-safe, for a checkpoint's `extra`."""
    state: Dict[str, Any] = {"torch_rng": torch.get_rng_state().tolist()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device).tolist()
    return state


def load_rng_state(extra: Dict[str, Any], device: torch.device, checkpoint: Path) -> None:
    """Restore what rng_state() saved into `extra`; CheckpointError naming `checkpoint` if it is unusable."""
    try:
        cpu = torch.tensor(extra["torch_rng"], dtype=torch.uint8)
        cuda = torch.tensor(extra["cuda_rng"], dtype=torch.uint8) if "cuda_rng" in extra else None
    except KeyError as exc:
        raise CheckpointError(
            f"{checkpoint} was not saved by offload-train or is corrupted: it keeps no {exc.args[0]!r} entry; "
            "resume from another checkpoint"
        ) from None
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(f"{checkpoint} is corrupted: its RNG state is unusable ({exc})") from None
    try:
        torch.set_rng_state(cpu)
        if cuda is not None and device.type == "cuda":
            torch.cuda.set_rng_state(cuda, device)
    except RuntimeError as exc:
        raise CheckpointError(f"{checkpoint} is corrupted: its RNG state is unusable ({exc})") from None
