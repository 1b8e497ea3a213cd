"""train.keep_last: after each save, delete the checkpoints older than the newest few.

    prune_checkpoints(out_dir, keep_last=3)   # rank 0, after `latest` names the new checkpoint

The checkpoint `latest` names is never deleted, whatever its step (after a resume from an older
checkpoint it need not be the newest by step). Deletion goes oldest first, each checkpoint renamed
to a `*.tmp-*` name before it is removed (run_dir.remove_entries), so a kill mid-way leaves either
the whole checkpoint or a temporary that the next run removes, never a checkpoint that looks
complete and is not.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

from offload_trainer.app.run_dir import checkpoints, latest_checkpoint, remove_entries


def checkpoints_to_delete(names: List[str], keep_last: int, latest: str | None) -> List[str]:
    """Of `names` (oldest step first), those that keep_last removes: all but the newest `keep_last`
    and the one `latest` names. keep_last = 0 keeps every checkpoint."""
    if keep_last <= 0:
        return []
    kept = set(names[-keep_last:])
    return [name for name in names if name not in kept and name != latest]


def prune_checkpoints(out_dir: Path, keep_last: int) -> List[str]:
    """Delete what checkpoints_to_delete names in `out_dir`; returns the names deleted."""
    doomed = checkpoints_to_delete(checkpoints(out_dir), keep_last, latest_checkpoint(out_dir))
    for name in doomed:  # one at a time, oldest first
        remove_entries(out_dir, [name])
    return doomed
