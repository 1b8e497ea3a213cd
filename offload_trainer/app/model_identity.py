"""The settings that change what the model computes without changing its parameters' names or shapes,
kept in each checkpoint, so that a resume with another value is refused.

    extra["model_identity"] = model_identity(cfg)                                   # at each save
    check_same_model(extra.get("model_identity"), model_identity(cfg), checkpoint)  # at resume: ValueError

A checkpoint of another model is refused by the engine from its parameters (names, shapes): another
preset, another lora.rank or lora.target_modules. lora.alpha is in none of them: an adapter's update is
scaled by alpha / rank in the forward, so a resume with another alpha went on without a word from
weights trained under another scale, the model's output changed at once (the loss jumped) and the
export merged the adapters at the new scale. Checkpoints written before this was kept resume unchecked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from offload_trainer.app.run_config import RunConfig


def model_identity(cfg: RunConfig) -> Dict[str, Any]:
    """The settings (JSON-safe, as a config file names them) the saved weights mean something only under."""
    return {"lora.alpha": cfg.lora.alpha} if cfg.lora.enabled else {}


def check_same_model(saved: Optional[Mapping[str, Any]], now: Mapping[str, Any], checkpoint: Path) -> None:
    """ValueError, one line naming the setting, its saved value and the flag that resumes, if a setting of
    `model_identity` differs from the one `checkpoint` was saved with. `saved` None: an older checkpoint."""
    if not isinstance(saved, Mapping):
        return
    changed = [k for k in saved if k in now and saved[k] != now[k]]
    if changed:
        was = ", ".join(f"{k}={saved[k]!r} then, {now[k]!r} now" for k in changed)
        again = " ".join(f"--{k} {saved[k]}" for k in changed)
        raise ValueError(
            f"{checkpoint} was saved with other model settings ({was}): its weights were trained under them, "
            f"so the model would compute something else from the first step on; resume with {again}, or start a "
            "new run (another train.out_dir, or --train.overwrite true)"
        )
