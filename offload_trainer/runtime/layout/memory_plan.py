"""MemoryPlan: where every byte of one rank's training state lives, checked against the budgets.

Pure: from the partition, the config and the rank, it decides the home tier of each state kind
of each group (by byte fractions, in group order), how many device slots and host staging
buffers there are and their sizes (per group, or a few size classes, never all the largest
group's), and the size of every memory buffer per tier (so each tier is one arena). A
plan that cannot fit is refused with the numbers and what to change (PlanError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Set, Tuple

import torch

from offload_trainer.config import OffloadConfig, Placement, Tier
from offload_trainer.errors import PlanError
from offload_trainer.runtime.layout.partition import PartitionPlan
from offload_trainer.runtime.layout.staging_sizes import class_numels, ring_numels, staging_classes
from offload_trainer.runtime.layout.update_chunks import block_numel_of, staged_numels as chunk_numels, update_cuts


def assign_tiers(nbytes: List[int], placement: Placement) -> List[Tier]:
    """A home tier per group so that each tier gets about its fraction of the bytes, in group order.

    The first groups go to the fastest tier: they are the first the next forward needs, so their
    updates finish first and the forward can start while later groups are updated.
    """
    total = sum(nbytes)
    tiers = placement.tiers()  # only tiers with a nonzero fraction, fastest first
    bounds = []
    acc = 0.0
    for tier in tiers:
        acc += placement.fraction(tier)
        bounds.append((acc * total, tier))
    # The last tier takes everything past the others' share, however the fractions round.
    bounds[-1] = (float("inf"), tiers[-1])
    out = []
    cursor = 0
    for n in nbytes:
        middle = cursor + n / 2
        out.append(next(tier for bound, tier in bounds if middle <= bound))
        cursor += n
    return out


def _gib(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.3f} GiB)"


def max_concurrent_groups(module_uses: Dict[str, Tuple[int, ...]], slot_group_ids: Set[int]) -> int:
    """Most slot-needing groups resident at once: a hooked module's, with its hooked ancestors'."""
    best = 1
    for name in module_uses:
        needed: Set[int] = set()
        parts = name.split(".") if name else []
        # The module itself, every ancestor ("a", "a.b", ...) and the root "" that is hooked.
        for prefix in [""] + [".".join(parts[:k]) for k in range(1, len(parts) + 1)]:
            needed.update(g for g in module_uses.get(prefix, ()) if g in slot_group_ids)
        best = max(best, len(needed))
    return best


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's placement and buffer counts. Per-group tuples are in partition group order."""

    param_tiers: Tuple[Tier, ...]
    grad_tiers: Tuple[Tier, ...]
    optimizer_tiers: Tuple[Tier, ...]
    local_trainable_numel: Tuple[int, ...]
    """Per group: trainable elements in this rank's shard (the size of its grad and optimizer homes)."""
    optimizer_states: Tuple[str, ...]
    """fp32 optimizer states per group ("master" included under bf16/fp16)."""
    param_dtype: torch.dtype
    num_device_slots: int
    device_slot_numels: Tuple[int, ...]
    """Elements (compute dtype) of each device slot, largest first: slots are sized per group, by the
    `num_device_slots` largest groups that need one, not all by the largest (any that many groups fit
    at once, each in a slot of its own)."""
    staging_numels: Tuple[int, ...]
    """fp32 elements of each host staging buffer, largest first: a few size classes, each sized by its
    largest group, a request served by its own class (layout/staging_sizes.py)."""
    bucket_numel: int
    """fp32 elements of each of the two gradient buckets (several ranks only, else 0)."""
    scratch_numel: int
    """fp32 elements of the reduce-scatter output (several ranks only, else 0)."""
    param_staging_numels: Tuple[int, ...]
    """Elements (compute dtype) of each host buffer NVMe parameter reads land in on their way to the
    device, largest first: one per load in flight, the largest groups' sizes (none when the device
    is host memory)."""
    arena_bytes: Dict[Tier, List[int]]
    """Every memory buffer's bytes, by tier."""
    min_bytes: Dict[Tier, int]
    """The least each tier must hold for this placement: its homes, plus the fewest device slots
    and staging buffers the engine can run with (the planner checks these against budgets)."""
    update_cuts: Tuple[Tuple[int, ...], ...] = ()
    """Per group: the boundaries (0, ..., n) of the chunks its update moves through host staging
    one at a time (layout/update_chunks.py; [Note: Chunked updates] in runtime/optimizer.py);
    (0, n) for a group updated whole, () for one with no trainable elements here."""
    grad_homes_lent: bool = False
    """Whether the memory gradient homes (device or host tier) are lent from torch's allocator for a
    step at a time instead of carved from their tier's arena: on the CPU with one rank, where the
    process heap also holds the activations ([Note: Gradient homes lent from the heap] in
    runtime/gradients.py). Their bytes count against the budgets all the same (`min_bytes`), but not
    in `arena_bytes`."""

    @property
    def uses_slots(self) -> bool:
        return self.num_device_slots > 0

    @property
    def num_staging(self) -> int:
        return len(self.staging_numels)

    @property
    def num_param_staging(self) -> int:
        return len(self.param_staging_numels)

    @property
    def device_slot_numel(self) -> int:
        """Elements of the largest device slot (0 without slots)."""
        return max(self.device_slot_numels, default=0)


def plan_memory(
    partition: PartitionPlan,
    config: OffloadConfig,
    rank: int,
    compute_dtype: torch.dtype,
    device_is_host: bool,
) -> MemoryPlan:
    """Decide and check the placement of one rank's state; raises PlanError if it cannot fit."""
    groups = partition.groups
    multi = partition.world_size > 1
    master = ("master",) if compute_dtype != torch.float32 else ()
    opt_states = config.optimizer.state_names + master
    pbytes = compute_dtype.itemsize
    local = [g.trainable_shard_numel(rank) for g in groups]
    param_tiers = assign_tiers([g.shard_numel * pbytes for g in groups], config.tiers.params)
    grad_tiers = assign_tiers([n * 4 for n in local], config.tiers.grads)
    opt_tiers = assign_tiers([n * 4 * len(opt_states) for n in local], config.tiers.optimizer)

    homes: Dict[Tier, List[int]] = {Tier.DEVICE: [], Tier.HOST: [], Tier.NVME: []}
    for g, n, pt, gt, ot in zip(groups, local, param_tiers, grad_tiers, opt_tiers):
        homes[pt].append(g.shard_numel * pbytes)
        if n:
            homes[gt].append(n * 4)
            homes[ot] += [n * 4] * len(opt_states)
    home_bytes = {tier: sum(sizes) for tier, sizes in homes.items()}

    # Device memory besides homes: slots for full parameters of groups in use (every group on
    # several ranks, which all-gather into them), and on several ranks the gradient buckets and
    # one shard of reduce-scatter output.
    slot_groups = [g for g, pt in zip(groups, param_tiers) if multi or pt is not Tier.DEVICE]
    # Slots sized per group: the k largest slot groups' sizes, so that any k groups fit at once.
    slot_sizes = sorted((g.flat_numel * pbytes for g in slot_groups), reverse=True)
    bucket_numel = max((g.flat_numel for g in groups if g.has_trainable), default=0) if multi else 0
    scratch_numel = max((g.shard_numel for g in groups), default=0) if bucket_numel else 0
    grad_scratch_bytes = (2 * bucket_numel + scratch_numel) * 4
    min_slots = max_concurrent_groups(partition.module_uses, {g.index for g in slot_groups}) if slot_groups else 0
    num_slots = min(len(slot_groups), min_slots + max(config.prefetch.lookahead_groups, 0) + 1)
    budget = config.tiers.device_budget_bytes
    fixed = home_bytes[Tier.DEVICE] + grad_scratch_bytes
    if budget is not None:
        while num_slots > 0 and fixed + sum(slot_sizes[:num_slots]) > budget:
            num_slots -= 1
    min_slot_bytes = sum(slot_sizes[:min_slots])
    min_device = fixed + min_slot_bytes
    if budget is not None and (fixed + sum(slot_sizes[:num_slots]) > budget or num_slots < min_slots):
        need = min_device
        raise PlanError(
            f"the plan does not fit tiers.device_budget_bytes={budget}: state homed on the device takes "
            f"{_gib(home_bytes[Tier.DEVICE])}, gradient buckets {_gib(grad_scratch_bytes)}, and {min_slots} "
            f"device slot(s) of {_gib(min_slot_bytes)} in all (the largest {min_slots} group(s)' parameters, "
            f"the largest {_gib(slot_sizes[0])}) are needed at once, {_gib(need)} in all; raise the device "
            "budget to at least that, place less state on the device, or make groups smaller "
            "(grouping.module_classes / grouping.max_group_bytes)"
        )

    # Host staging: the optimizer streams every state kind it cannot use in place through it (NVMe
    # homes; on an accelerator whose memory is not host memory, also device homes of a group it
    # updates on the host), gradients bound for any home but the device tier pass through it, and
    # so do the initial parameters of a home behind NVMe or the copy path. Buffers come in a few
    # size classes (layout/staging_sizes.py): three groups in flight (read k+1, update k, write
    # k-1), two at the least, each with one buffer per staged kind.
    # A group whose update stages a shard of more than optimizer.update_chunk_bytes per kind is
    # updated in chunks: its update's buffers are chunk-sized (each chunk one entry, as a group
    # is; the last runs to the parameter shard's end), and only gradients that pass through
    # staging (gradients.py collects a group's whole shard) still want one of the group's size.
    nvme_kinds_max = 0
    staged_numels: List[int] = []
    cuts_per_group: List[Tuple[int, ...]] = []
    chunk_numel = max(1, config.optimizer.update_chunk_bytes // 4)
    block_numel = block_numel_of(config.io.block_bytes, min(pbytes, 4))
    for g, n, pt, gt, ot in zip(groups, local, param_tiers, grad_tiers, opt_tiers):
        kinds_staged = 0
        cuts: Tuple[int, ...] = (0, n) if n else ()
        grads_staged = False
        if n:
            kinds = [pt, gt] + [ot] * len(opt_states)
            staged = (Tier.NVME,) if device_is_host or all(t is Tier.DEVICE for t in kinds) else (Tier.NVME, Tier.DEVICE)
            grads_staged = gt is Tier.HOST and not device_is_host
            kinds_staged = sum(t in staged for t in kinds) + grads_staged
            nvme_kinds_max = max(nvme_kinds_max, kinds_staged)
            if sum(t in staged for t in kinds):
                pieces = [(p.shard_offset, p.numel) for p in g.shard_pieces(rank)]
                cuts = update_cuts(pieces, n, chunk_numel, block_numel)
        cuts_per_group.append(cuts)
        if len(cuts) > 2:
            staged_numels += chunk_numels(cuts, g.shard_numel)
            if grads_staged or gt is Tier.NVME:
                staged_numels.append(g.shard_numel)
        elif kinds_staged or pt is Tier.NVME or (pt is Tier.DEVICE and not device_is_host):
            staged_numels.append(g.shard_numel)
    needs_staging = nvme_kinds_max > 0 or Tier.NVME in param_tiers or (
        not device_is_host and Tier.DEVICE in param_tiers
    )
    per_group = max(nvme_kinds_max, 1)
    wanted = staging_classes(staged_numels, per_group, 3) if needs_staging else []
    fewest = staging_classes(staged_numels, per_group, 2) if needs_staging else []
    staging_total = sum(n * k for n, k in wanted) * 4
    min_staging_bytes = sum(n * k for n, k in fewest) * 4
    host_budget = config.tiers.host_budget_bytes
    min_host = home_bytes[Tier.HOST] + min_staging_bytes
    if host_budget is not None and home_bytes[Tier.HOST] + staging_total > host_budget:
        wanted, staging_total = fewest, min_staging_bytes
        if min_host > host_budget:
            staging = (
                f", and {sum(k for _, k in fewest)} staging buffer(s) of {_gib(min_staging_bytes)} in all (the "
                f"largest {_gib(4 * fewest[0][0])}) are needed for NVMe traffic, {_gib(min_host)} in all"
                if fewest
                else ""  # nothing passes through staging: the homes alone do not fit
            )
            raise PlanError(
                f"the plan does not fit tiers.host_budget_bytes={host_budget}: state homed on the host takes "
                f"{_gib(home_bytes[Tier.HOST])}{staging}; raise the host budget to at least that, "
                "or move more state to NVMe"
            )
    staging_numels = class_numels(wanted)

    # Parameter staging (an accelerator whose memory is not host memory): NVMe reads of parameters
    # land in host buffers, then the copy path takes them to the device: one per load in flight,
    # sized by the largest groups (any that many fit at once).
    nvme_param_numels = [] if device_is_host else [g.shard_numel for g, pt in zip(groups, param_tiers) if pt is Tier.NVME]
    param_staging_numels: Tuple[int, ...] = ()
    if nvme_param_numels:
        num_param_staging = max(config.prefetch.lookahead_groups, 0) + 1
        largest_bytes = max(nvme_param_numels) * pbytes
        if host_budget is not None:
            left = host_budget - home_bytes[Tier.HOST] - staging_total
            while num_param_staging > 0 and sum(ring_numels(nvme_param_numels, num_param_staging)) * pbytes > left:
                num_param_staging -= 1
            if num_param_staging < 1:
                need = min_host + largest_bytes
                raise PlanError(
                    f"the plan does not fit tiers.host_budget_bytes={host_budget}: parameters homed on NVMe reach "
                    f"the device through a host buffer of {_gib(largest_bytes)}, beside "
                    f"{_gib(min_host)} of host homes and staging, "
                    f"{_gib(need)} in all; raise the host budget to at least that, or home parameters on the host"
                )
        param_staging_numels = ring_numels(nvme_param_numels, num_param_staging)
        min_host += largest_bytes

    # On the CPU with one rank the gradient homes the compute adds into in place are lent from the
    # heap per step ([Note: Gradient homes lent from the heap]): counted above, in no arena.
    lend_grad_homes = device_is_host and not multi
    arenas = {tier: list(sizes) for tier, sizes in homes.items()}
    if lend_grad_homes:
        for n, gt in zip(local, grad_tiers):
            if n and gt is not Tier.NVME:
                arenas[gt].remove(n * 4)
    arenas[Tier.DEVICE] += slot_sizes[:num_slots] + [bucket_numel * 4] * (2 if bucket_numel else 0)
    arenas[Tier.DEVICE] += [scratch_numel * 4] if scratch_numel else []
    arenas[Tier.HOST] += [n * 4 for n in staging_numels] + [n * pbytes for n in param_staging_numels]
    return MemoryPlan(
        tuple(param_tiers),
        tuple(grad_tiers),
        tuple(opt_tiers),
        tuple(local),
        opt_states,
        compute_dtype,
        num_slots,
        tuple(n // pbytes for n in slot_sizes[:num_slots]),
        staging_numels,
        bucket_numel,
        scratch_numel,
        param_staging_numels,
        arenas,
        {Tier.DEVICE: min_device, Tier.HOST: min_host, Tier.NVME: home_bytes[Tier.NVME]},
        tuple(cuts_per_group),
        lend_grad_homes,
    )

