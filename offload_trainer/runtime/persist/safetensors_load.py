"""Load weights from safetensors files straight into the engine's shards, one tensor at a time.

    engine.load_safetensors(sorted(Path("/models/llama").glob("*.safetensors")))

Every name must be a parameter of the model with its shape, and every parameter must be given (a
tied parameter under any one of its names); all of that is checked from the files' headers before
anything is written. Tensors are read one at a time (memory-mapped), so host memory holds one
tensor, never the model.
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

from torch import nn

from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.groups.tiers import MemoryTiers


def load_safetensors(
    model: nn.Module, groups: Sequence[ShardGroup], tiers: MemoryTiers, paths: "Sequence[str | os.PathLike[str]]"
) -> None:
    """Write the tensors of safetensors files (e.g. a model's shards) into the groups' homes; no
    device copy may exist. ValueError naming every misfit (unknown name, wrong shape, missing)."""
    from safetensors import safe_open

    by_name = dict(model.named_parameters(remove_duplicate=False))
    where = {id(p): (group, i) for group in groups for i, p in enumerate(group.params)}
    found: Dict[int, Tuple[str, str]] = {}
    problems: List[str] = []
    for path in map(str, paths):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                p = by_name.get(key)
                if p is None:
                    problems.append(f"{path}: {key!r} is not a parameter of the model")
                    continue
                group, i = where[id(p)]
                shape = tuple(f.get_slice(key).get_shape())
                if shape != group.plan.params[i].shape:
                    problems.append(f"{path}: {key!r} has shape {list(shape)}, the model's is {list(group.plan.params[i].shape)}")
                found[id(p)] = (path, key)
    missing = [n for n, p in model.named_parameters() if id(p) not in found]
    if missing:
        problems.append(f"missing from the files: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if problems:
        raise ValueError("these weights do not fit the model: " + "; ".join(problems[:8]))
    for pid, (path, key) in found.items():
        with safe_open(path, framework="pt") as f:
            group, i = where[pid]
            group.write_param(tiers, i, f.get_tensor(key).to(group.plan.dtype))
