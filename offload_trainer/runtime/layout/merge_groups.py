"""Merge runs of consecutive small groups into one, after partition: a minimum group size.

    plan = merge_small_groups(plan_partition(model, grouping), grouping.min_group_bytes, grouping.max_group_bytes)

A model cut into many small blocks (a 128-layer thin decoder: 200 KB a block) pays the engine's
per-group costs (hooks, scheduling, one transfer per group, one optimizer call per group) once per
block, and a 200 KB read from NVMe is latency-bound. Merged, consecutive groups move as one flat
buffer: one slot, one read or copy, one gradient write, one optimizer pass.

Pure, like partition.py: groups are merged in plan order (the order their modules were claimed:
blocks first, then the modules outside every block) while the merged group holds fewer than
`min_group_bytes` of parameters, and never past `max_group_bytes` when that is set; only groups of
the same dtype merge. A merged group lays its parameters out as partition.py does (trainable ones
first, then frozen ones, each in its old order) and is padded for the world's ranks; every hooked
module that needed one of the old groups needs the merged one. The update of each parameter is
unchanged (the optimizer works per parameter), so training stays bitwise the same.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from offload_trainer.runtime.layout.partition import SHARD_ALIGN_NUMEL, GroupPlan, PartitionPlan, lay_out


def merge_small_groups(
    plan: PartitionPlan,
    min_group_bytes: Optional[int],
    max_group_bytes: Optional[int] = None,
    align_numel: int = SHARD_ALIGN_NUMEL,
) -> PartitionPlan:
    """`plan` with consecutive groups merged up to `min_group_bytes` each (the plan itself when None)."""
    if min_group_bytes is None or len(plan.groups) < 2:
        return plan
    runs: List[List[GroupPlan]] = []
    run_bytes = 0
    for group in plan.groups:
        nbytes = group.real_numel * group.element_bytes
        if runs and run_bytes < min_group_bytes and runs[-1][0].dtype == group.dtype and (
            max_group_bytes is None or run_bytes + nbytes <= max_group_bytes
        ):
            runs[-1].append(group)
            run_bytes += nbytes
        else:
            runs.append([group])
            run_bytes = nbytes
    if len(runs) == len(plan.groups):
        return plan
    new_index: Dict[int, int] = {}
    groups = []
    for gi, run in enumerate(runs):
        for old in run:
            new_index[old.index] = gi
        groups.append(run[0] if len(run) == 1 and run[0].index == gi else _merged(gi, run, plan.world_size, align_numel))
    def renumbered(uses: Dict[str, Tuple[int, ...]]) -> Dict[str, Tuple[int, ...]]:
        out: Dict[str, Tuple[int, ...]] = {}
        for module_name, needed in uses.items():
            merged: List[int] = []
            for old in needed:
                if new_index[old] not in merged:
                    merged.append(new_index[old])
            out[module_name] = tuple(merged)
        return out

    return PartitionPlan(tuple(groups), renumbered(plan.module_uses), plan.world_size, renumbered(plan.entry_uses))


def _merged(index: int, run: List[GroupPlan], world_size: int, align_numel: int) -> GroupPlan:
    params = [p for g in run for p in g.params]
    ordered = [p for p in params if p.requires_grad] + [p for p in params if not p.requires_grad]
    layouts, trainable, cursor = lay_out(ordered, run[0].dtype)
    shard = -(-max(cursor, 1) // (world_size * align_numel)) * align_numel
    module_names = tuple(m for g in run for m in g.module_names)
    name = run[0].name if len(run) == 1 else f"{run[0].name}..{run[-1].name}"
    return GroupPlan(index, name, module_names, run[0].dtype, tuple(layouts), trainable, shard * world_size, shard)


__all__ = ["merge_small_groups"]
