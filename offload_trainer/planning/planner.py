"""Placement planner: the fraction of each state kind on each tier, and the prefetch lookahead.

Given a model's partition, the training setup and the machine (budgets, free NVMe space, measured
rates, the model's compute time), it tries every placement on a grid (eighths of each state
kind's bytes between host and NVMe; quarters on the device where the device can usefully hold
them), asks memory_plan what each needs per tier, keeps those that fit, and ranks them by the
cost model's predicted step time. Ties go to the placement with fewer bytes on NVMe, then to the
shallowest lookahead. The lookahead is the smallest one whose prediction is as good as the
deepest, plus one group of slack for the jitter the model does not see.

A setup where nothing fits is refused (PlanError) with the numbers and, for each kind of change
that could make it fit, the smallest such change: more host memory, more free NVMe space, a
larger device budget, activation checkpointing, or more ranks to share the state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from io_engine.file_store import memory_file_system, swap_room_bytes

from offload_trainer.config import OffloadConfig, Placement, PlacementMode, Tier
from offload_trainer.config.byte_size import exact_bytes, format_bytes
from offload_trainer.planning.cost_model import ComputeTimes, StepCost, effective_lookahead, predict_step
from offload_trainer.planning.host_memory import (
    gpu_memory_for_planning,
    host_memory_for_planning,
    local_ranks,
    memory_available_bytes,
    unset_budget_words,
)
from offload_trainer.planning.machine import MachineRates
from offload_trainer.errors import PlanError
from offload_trainer.runtime.layout.memory_plan import MemoryPlan, plan_memory
from offload_trainer.runtime.layout.partition import PartitionPlan

LOOKAHEADS = (0, 1, 2, 3, 4, 6, 8)
"""Lookahead depths the planner considers."""
NVME_STEPS = 8
DEVICE_STEPS = 4
NVME_MARGIN = 0.98
"""Share of the free NVMe space a plan may fill (file system metadata, other writers)."""
TIE_S = 1e-3
"""Predicted steps within this many seconds of the fastest are a tie: the model is not that precise."""


@dataclass(frozen=True)
class Machine:
    """What the planner may use on this machine, for one rank."""

    device_budget_bytes: Optional[int]
    host_budget_bytes: Optional[int]
    nvme_dir: Optional[str]
    nvme_free_bytes: Optional[int]
    """Free bytes under nvme_dir, the swap files of dead runs there counted free (the engine's store
    reclaims them before it makes its own: io_engine's swap_room_bytes); None: no nvme_dir."""
    device_is_host: bool
    rates: MachineRates
    host_budget_from_memory: bool = False
    """host_budget_bytes is the machine's memory, tiers.host_budget_bytes being unset ([Note: An unset
    host budget is the machine's memory] in host_memory.py)."""
    device_budget_from_memory: bool = False
    """device_budget_bytes is the GPU's free memory, tiers.device_budget_bytes being unset."""
    host_memory_available_bytes: Optional[int] = None
    """The host memory this rank may take now (memory_available_bytes, shared by the ranks on this node),
    against which a host budget that is set is not checked, only noted (PlacementChoice.memory_note)."""
    nvme_memory_file_system: Optional[str] = None
    """"tmpfs" or "ramfs" where nvme_dir's file system keeps its files in host memory (io_engine's
    memory_file_system), else None: its swap files are then host memory too (host_need)."""

    @classmethod
    def from_config(cls, config: OffloadConfig, device: torch.device, rates: MachineRates) -> Machine:
        nvme_dir = config.tiers.nvme_dir
        host = config.tiers.host_budget_bytes
        gpu = config.tiers.device_budget_bytes
        gpu_from_memory = gpu is None and device.type == "cuda"
        return cls(
            gpu if not gpu_from_memory else gpu_memory_for_planning(device),
            host if host is not None else host_memory_for_planning(),
            nvme_dir,
            swap_room_bytes(nvme_dir) if nvme_dir is not None else None,
            device.type == "cpu",
            rates,
            host_budget_from_memory=host is None,
            device_budget_from_memory=gpu_from_memory,
            host_memory_available_bytes=memory_available_bytes() // local_ranks(),
            nvme_memory_file_system=memory_file_system(nvme_dir) if nvme_dir is not None else None,
        )

    def budget_words(self, tier: Tier) -> str:
        """The device or host budget as a report names it ('none', '16 GiB', or the memory an unset one
        planned with)."""
        if tier is Tier.DEVICE:
            budget, from_memory = self.device_budget_bytes, self.device_budget_from_memory
        else:
            budget, from_memory = self.host_budget_bytes, self.host_budget_from_memory
        if budget is None:
            return "none"
        return unset_budget_words(tier, budget) if from_memory else format_bytes(budget)

    def resident_host_bytes(self, need: Dict[Tier, int]) -> int:
        """What of `need` lies in this machine's memory: the host tier's; on a CPU without a device budget
        the device tier's (the device is host memory there); with nvme_dir on tmpfs or ramfs the NVMe
        tier's (its swap files are memory: a plan of 14 GiB of host homes and 2.6 GiB of swap files
        under /dev/shm took 16.9 GiB of RAM against its 15.7 GiB budget, the machine's memory)."""
        on_device = self.device_is_host and self.device_budget_bytes is None
        return (
            need[Tier.HOST]
            + (need[Tier.DEVICE] if on_device else 0)
            + (need[Tier.NVME] if self.nvme_memory_file_system is not None else 0)
        )

    def host_need(self, need: Dict[Tier, int]) -> int:
        """What of `need` counts against the host budget: the host tier's; planned with the machine's
        memory (tiers.host_budget_bytes unset), all that lies in memory (resident_host_bytes)."""
        return self.resident_host_bytes(need) if self.host_budget_from_memory else need[Tier.HOST]


@dataclass(frozen=True)
class Candidate:
    """One placement on the grid, what it needs per tier, and its predicted cost."""

    params: Placement
    grads: Placement
    optimizer: Placement
    lookahead_groups: int
    memory: MemoryPlan
    need_bytes: Dict[Tier, int]
    """Bytes each tier must hold, the device's including activations."""
    cost: StepCost


@dataclass(frozen=True)
class PlacementChoice:
    """The planner's answer: settings for OffloadConfig, and what it expects of them."""

    chosen: Candidate
    activation_bytes: int
    machine: Machine
    compute: ComputeTimes
    num_candidates: int
    """Grid points considered; num_fitting of them fit the budgets."""
    num_fitting: int
    reasons: Tuple[str, ...]
    """Why this placement, in sentences."""

    @property
    def memory_note(self) -> Optional[str]:
        """A sentence when the plan keeps more in host memory than this machine has available now, or None.

        A host budget that is set is the user's ([Note: An unset host budget is the machine's memory]):
        it may be for another machine, or for memory freed before the run, so the plan is not refused;
        but planned on this machine without a word, the run it configures was killed for memory while the
        engine faulted its host arena in."""
        m = self.machine
        available = m.host_memory_available_bytes
        if m.host_budget_from_memory or m.host_budget_bytes is None or available is None:
            return None
        need = self.chosen.need_bytes
        host = m.resident_host_bytes(need)
        if host <= available:
            return None
        included = []
        if m.device_is_host and m.device_budget_bytes is None and need[Tier.DEVICE]:
            included.append("the device's slots and activations (on a CPU they are host memory)")
        if m.nvme_memory_file_system is not None and need[Tier.NVME]:
            included.append(f"the swap files ({m.nvme_dir} is on {m.nvme_memory_file_system}: memory)")
        also = f" ({' and '.join(included)} included)" if included else ""
        return (
            f"tiers.host_budget_bytes={format_bytes(m.host_budget_bytes)} let the plan keep {format_bytes(host)} in host "
            f"memory{also}, more than the {format_bytes(available)} this machine has available now: a run here would "
            "be killed for memory; lower tiers.host_budget_bytes (or leave it unset to plan with this machine's "
            "memory), unless the plan is for another machine"
        )

    def apply(self, config: OffloadConfig) -> OffloadConfig:
        """`config` with the chosen placement and lookahead in place of its own."""
        c = self.chosen
        tiers = dataclasses.replace(config.tiers, params=c.params, grads=c.grads, optimizer=c.optimizer)
        prefetch = dataclasses.replace(config.prefetch, lookahead_groups=c.lookahead_groups)
        return dataclasses.replace(config, tiers=tiers, prefetch=prefetch, placement=PlacementMode.MANUAL)

    def engine_config(self, config: OffloadConfig) -> OffloadConfig:
        """apply(config), with the device budget lowered by the activations the plan counted.

        The engine tracks only its own buffers: given the whole budget it would fill the
        activations' share with prefetch slots."""
        applied = self.apply(config)
        budget = applied.tiers.device_budget_bytes
        if budget is None and self.machine.device_budget_from_memory:
            budget = self.machine.device_budget_bytes  # the GPU's memory the plan counted (host_memory.py)
        if budget is None:
            return applied
        tiers = dataclasses.replace(applied.tiers, device_budget_bytes=max(budget - self.activation_bytes, 1))
        return dataclasses.replace(applied, tiers=tiers)


def _placements(steps_device: Sequence[int], allow_nvme: bool) -> Iterator[Placement]:
    for d in steps_device:
        dev = d / DEVICE_STEPS
        for n in range(NVME_STEPS + 1) if allow_nvme else (0,):
            nv = n / NVME_STEPS
            if dev + nv <= 1.0 + 1e-9:
                yield Placement(device=dev, host=max(0.0, 1.0 - dev - nv), nvme=nv)


def candidate_placements(
    device_is_host: bool, has_nvme: bool, device_budgeted: bool = True
) -> Iterator[Tuple[Placement, Placement, Placement]]:
    """The grid: (params, grads, optimizer) placements the engine has a path for.

    On a CPU the device tier only saves the copy of parameters into device slots, so only
    parameters go there, and only under a device budget: without one, state homed there would
    be host memory that no budget counts. On an accelerator every kind may be anywhere; the grid
    gives the three kinds the same device share (a group whose state is all on the device is
    updated there, any other on the host) and each its own NVMe share.
    """
    if device_is_host:
        for p in _placements(range(DEVICE_STEPS + 1) if device_budgeted else (0,), has_nvme):
            for g in _placements((0,), has_nvme):
                for o in _placements((0,), has_nvme):
                    yield p, g, o
        return
    for d in range(DEVICE_STEPS + 1):
        for p in _placements((d,), has_nvme):
            for g in _placements((d,), has_nvme):
                for o in _placements((d,), has_nvme):
                    yield p, g, o


def _trial(config: OffloadConfig, params: Placement, grads: Placement, optimizer: Placement, lookahead: int,
           device_budget: Optional[int]) -> OffloadConfig:
    """`config` with one grid point's placement, no host budget, and `device_budget` (slots take what it leaves)."""
    tiers = dataclasses.replace(
        config.tiers, params=params, grads=grads, optimizer=optimizer, device_budget_bytes=device_budget,
        host_budget_bytes=None,
        # The plan never touches the directory; a placeholder lets a trial put bytes on NVMe
        # before the user has named one (the refusal then says to).
        nvme_dir=config.tiers.nvme_dir or "nvme_dir",
    )
    return dataclasses.replace(
        config, tiers=tiers, prefetch=dataclasses.replace(config.prefetch, lookahead_groups=lookahead),
        placement=PlacementMode.MANUAL,
    )


def evaluate(
    partition: PartitionPlan,
    config: OffloadConfig,
    machine: Machine,
    compute: ComputeTimes,
    activation_bytes: int,
    placement: Tuple[Placement, Placement, Placement],
    lookahead: int,
    rank: int = 0,
) -> Optional[Candidate]:
    """One grid point: what it needs per tier and its predicted cost; None if the engine has no path for it."""
    dtype = config.precision.compute_dtype.torch_dtype
    try:
        plan = plan_memory(partition, _trial(config, *placement, lookahead, None), rank, dtype, machine.device_is_host)
    except PlanError:
        return None  # a placement this version refuses on this device (see memory_plan)
    need = dict(plan.min_bytes)
    need[Tier.DEVICE] += activation_bytes
    if machine.device_budget_bytes is not None and need[Tier.DEVICE] <= machine.device_budget_bytes:
        # Slots are what lookahead costs: take as many as the budget leaves, as the engine will.
        left = machine.device_budget_bytes - activation_bytes
        plan = plan_memory(partition, _trial(config, *placement, lookahead, left), rank, dtype, machine.device_is_host)
    cost = predict_step(partition, plan, machine.rates, compute, lookahead, config.grad_accum_steps)
    return Candidate(*placement, lookahead, plan, need, cost)


def over_budget(candidate: Candidate, machine: Machine) -> Dict[Tier, int]:
    """Bytes by which each tier's need exceeds what the machine gives it (tiers that fit are absent)."""
    need = candidate.need_bytes
    over: Dict[Tier, int] = {}
    if machine.device_budget_bytes is not None and need[Tier.DEVICE] > machine.device_budget_bytes:
        over[Tier.DEVICE] = need[Tier.DEVICE] - machine.device_budget_bytes
    host = machine.host_need(need)
    if machine.host_budget_bytes is not None and host > machine.host_budget_bytes:
        over[Tier.HOST] = host - machine.host_budget_bytes
    if need[Tier.NVME]:
        room = 0 if machine.nvme_free_bytes is None else int(machine.nvme_free_bytes * NVME_MARGIN)
        if need[Tier.NVME] > room:
            over[Tier.NVME] = need[Tier.NVME] - room
    return over


def _lean_placements(has_nvme: bool) -> List[Tuple[Placement, Placement, Placement]]:
    """A few placements that between them need least of each tier: parameters whole on the device, the
    host or NVMe, the rest whole on the host or NVMe (what the refusal tries when it asks whether
    more ranks would fit; the full grid per rank count would take minutes on a large model)."""
    tiers = [Tier.DEVICE, Tier.HOST] + ([Tier.NVME] if has_nvme else [])
    rest = [Tier.HOST] + ([Tier.NVME] if has_nvme else [])
    return [(Placement.parse(p), Placement.parse(r), Placement.parse(r)) for p in tiers for r in rest]


def _grid(
    partition: PartitionPlan, config: OffloadConfig, machine: Machine, compute: ComputeTimes, activation_bytes: int,
    lookahead: int,
) -> List[Candidate]:
    # NVMe placements are tried without an nvme_dir too, so that a refusal can say one would help.
    out = []
    for placement in candidate_placements(
        machine.device_is_host, has_nvme=True, device_budgeted=machine.device_budget_bytes is not None
    ):
        c = evaluate(partition, config, machine, compute, activation_bytes, placement, lookahead)
        if c is not None:
            out.append(c)
    return out


def _tie_break_key(c: Candidate) -> Tuple[int, int, float]:
    """Among predictions that tie (within TIE_S of the fastest): fewer bytes on NVMe, then on the device."""
    return (c.need_bytes[Tier.NVME], c.need_bytes[Tier.DEVICE], c.cost.step_s)


def plan_placement(
    partition: PartitionPlan,
    config: OffloadConfig,
    machine: Machine,
    compute: ComputeTimes,
    activation_bytes: int,
    checkpointed_activation_bytes: Optional[int] = None,
    repartition: Optional[Callable[[int], PartitionPlan]] = None,
) -> PlacementChoice:
    """The fastest placement and lookahead that fit `machine`; PlanError with the smallest fixes if none does.

    `checkpointed_activation_bytes`: the activations with activation checkpointing on, when it is
    off (for the refusal's suggestions). `repartition(world_size)`: the partition on that many
    ranks, so a refusal can say how many ranks' share would fit.
    """
    deepest = LOOKAHEADS[-1]
    candidates = _grid(partition, config, machine, compute, activation_bytes, deepest)
    fitting = [c for c in candidates if not over_budget(c, machine)]
    if not fitting:
        raise PlanError(_refusal(partition, config, machine, compute, activation_bytes, candidates,
                                 checkpointed_activation_bytes, repartition))
    # A window around the fastest, not rounding: rounding would split two predictions a few
    # microseconds apart when a millisecond boundary falls between them (an NVMe read that hides
    # behind compute against a copy that does not can differ by that little).
    fastest_s = min(c.cost.step_s for c in fitting)
    best = min((c for c in fitting if c.cost.step_s <= fastest_s + TIE_S), key=_tie_break_key)
    placement = (best.params, best.grads, best.optimizer)
    chosen = best
    for lookahead in LOOKAHEADS:
        c = evaluate(partition, config, machine, compute, activation_bytes, placement, lookahead)
        if c is not None and not over_budget(c, machine) and c.cost.step_s <= best.cost.step_s * 1.005:
            slack = LOOKAHEADS[min(LOOKAHEADS.index(lookahead) + 1, len(LOOKAHEADS) - 1)] if lookahead else 0
            with_slack = evaluate(partition, config, machine, compute, activation_bytes, placement, slack)
            chosen = with_slack if with_slack is not None and not over_budget(with_slack, machine) else c
            break
    reasons = _reasons(partition, config, machine, compute, activation_bytes, chosen)
    return PlacementChoice(chosen, activation_bytes, machine, compute, len(candidates), len(fitting), tuple(reasons))


KIND_NAMES = ("params", "grads", "optimizer")


def _placement_of(kind: str, tier: Tier) -> Tuple[Placement, Placement, Placement]:
    host = Placement.parse(Tier.HOST)
    return tuple(Placement.parse(tier) if k == kind else host for k in KIND_NAMES)  # type: ignore[return-value]


def nvme_cost_per_gib(
    partition: PartitionPlan, config: OffloadConfig, machine: Machine, compute: ComputeTimes, activation_bytes: int
) -> Dict[str, float]:
    """Predicted seconds a step gains per GiB of each state kind homed on NVMe instead of the host."""
    base = evaluate(partition, config, machine, compute, activation_bytes, _placement_of("", Tier.HOST), LOOKAHEADS[-1])
    out: Dict[str, float] = {}
    for kind in KIND_NAMES:
        c = evaluate(partition, config, machine, compute, activation_bytes, _placement_of(kind, Tier.NVME), LOOKAHEADS[-1])
        if base is None or c is None or not c.need_bytes[Tier.NVME]:
            continue
        out[kind] = (c.cost.step_s - base.cost.step_s) / (c.need_bytes[Tier.NVME] / 2**30)
    return out


KIND_WORDS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states"}
_WHY_NVME = {
    # Compared with the host: a read from NVMe runs on io_engine's workers, so lookahead hides it,
    # while a copy from host memory is made on the training thread and adds to compute (see
    # cost_model's [Note: Which fetches overlap compute]); hence this cost can be small or below 0.
    "params": "read in forward and again in backward, behind compute when lookahead allows (a copy "
    "from host memory, in their place, is made on the training thread and hides behind nothing), "
    "then read and written by the update",
    "grads": "written in backward, behind compute, and read once by the update",
    "optimizer": "read and written by the update, which nothing hides",
}


def _reasons(
    partition: PartitionPlan, config: OffloadConfig, machine: Machine, compute: ComputeTimes, activation_bytes: int,
    chosen: Candidate,
) -> List[str]:
    plan = chosen.memory
    need = chosen.need_bytes
    out = []
    nvme = need[Tier.NVME]
    if not nvme:
        out.append("everything fits in memory, so nothing goes to NVMe (the fastest placement)")
    else:
        budget = machine.host_budget_bytes
        host = machine.host_need(need)
        if budget is None or host + nvme <= budget:
            # The host could hold it all: NVMe was chosen because its reads hide behind compute
            # and copies from host memory do not (see _WHY_NVME).
            out.append(
                f"{format_bytes(nvme)} of state goes to NVMe although the host budget "
                f"({machine.budget_words(Tier.HOST)}) could hold it: that placement predicts a faster step"
            )
        else:
            also = ", and on this CPU the activations and slots" if host != need[Tier.HOST] else ""
            out.append(
                f"the host budget ({machine.budget_words(Tier.HOST)}) holds {format_bytes(host)} "
                f"(homes and staging buffers{also}), so {format_bytes(nvme)} of state goes to NVMe"
            )
        costs = nvme_cost_per_gib(partition, config, machine, compute, activation_bytes)
        if costs:
            order = sorted(costs, key=costs.__getitem__)
            out.append(
                "predicted cost of NVMe per GiB: "
                + ", ".join(f"{KIND_WORDS[k]} {costs[k]:.3f} s ({_WHY_NVME[k]})" for k in order)
                + f"; so {KIND_WORDS[order[0]]} go to NVMe first"
            )
    if plan.uses_slots:
        out.append(
            f"{plan.num_device_slots} device slots, sized per group "
            f"({format_bytes(sum(plan.device_slot_numels) * plan.param_dtype.itemsize)} in all, the largest "
            f"{format_bytes(plan.device_slot_numel * plan.param_dtype.itemsize)}), "
            f"hold the groups in use and those fetched ahead"
            + ("" if machine.device_budget_bytes is None else
               f", within the device budget of {format_bytes(machine.device_budget_bytes)} with "
               f"{format_bytes(activation_bytes)} kept for activations")
        )
    fwd = chosen.cost.forward
    if chosen.lookahead_groups == 0:
        out.append(
            "lookahead 0: no deeper lookahead predicts a faster step"
            + (f" (the device budget leaves room for {plan.num_device_slots} slot(s))"
               if plan.uses_slots and machine.device_budget_bytes is not None else "")
        )
    else:
        real = effective_lookahead(plan, chosen.lookahead_groups)
        out.append(
            f"lookahead {chosen.lookahead_groups}: the smallest depth whose predicted step is as fast as any, "
            f"plus one of slack (forward IO {fwd.io_s:.3f} s against {fwd.compute_s:.3f} s of compute"
            + (f"; {fwd.blocking_copy_s:.3f} s of that IO are copies from memory on the training thread, "
               "which add to compute whatever the lookahead" if fwd.blocking_copy_s else "")
            + ")"
            + (f"; the device slots allow {real} ahead" if real < chosen.lookahead_groups else "")
        )
    out.append(f"bottleneck: {chosen.cost.bottleneck}")
    return out


def _refusal(
    partition: PartitionPlan,
    config: OffloadConfig,
    machine: Machine,
    compute: ComputeTimes,
    activation_bytes: int,
    candidates: Sequence[Candidate],
    checkpointed_activation_bytes: Optional[int],
    repartition: Optional[Callable[[int], PartitionPlan]],
) -> str:
    """Why nothing fits, with the smallest change of each kind that would make something fit."""
    if not candidates:
        return "no placement on the planner's grid has a path in this version for this device (see memory_plan)"

    def least(tier: Tier) -> Optional[int]:
        """The least `tier` must hold among the placements whose other tiers fit."""
        fits = [c for c in candidates if set(over_budget(c, machine)) <= {tier}]
        needs = [machine.host_need(c.need_bytes) if tier is Tier.HOST else c.need_bytes[tier] for c in fits]
        return min(needs) if needs else None

    smallest = {tier: min(c.need_bytes[tier] for c in candidates) for tier in Tier}
    smallest[Tier.HOST] = min(machine.host_need(c.need_bytes) for c in candidates)
    nvme_room = None if machine.nvme_free_bytes is None else int(machine.nvme_free_bytes * NVME_MARGIN)
    lines = [
        "no placement fits this machine: the least any placement needs is device "
        f"{format_bytes(smallest[Tier.DEVICE])} "
        f"(budget {machine.budget_words(Tier.DEVICE)}, {format_bytes(activation_bytes)} of it activations), "
        f"host {format_bytes(smallest[Tier.HOST])} (budget {machine.budget_words(Tier.HOST)}), and NVMe "
        f"{format_bytes(least(Tier.NVME) or smallest[Tier.NVME])} when the other tiers are full "
        f"({'no tiers.nvme_dir' if nvme_room is None else format_bytes(nvme_room) + ' usable'})."
    ]
    fixes = []
    if machine.nvme_memory_file_system is not None:
        on_disk = dataclasses.replace(machine, nvme_memory_file_system=None)
        if any(not over_budget(c, on_disk) for c in candidates):
            fixes.append(
                f"set tiers.nvme_dir to a directory on a disk ({machine.nvme_dir} is on "
                f"{machine.nvme_memory_file_system}, whose swap files take host memory)"
            )
    host = least(Tier.HOST)
    if host is not None and machine.host_budget_from_memory:
        fixes.append(
            f"more host memory: {format_bytes(host)} for the plan (tiers.host_budget_bytes, unset, plans with "
            f"{format_bytes(machine.host_budget_bytes or 0)}; set it to {exact_bytes(host)} only if the machine has that "
            "much to spare)"
        )
    elif host is not None:
        fixes.append(f"raise tiers.host_budget_bytes to {exact_bytes(host)}")
    nv = least(Tier.NVME)
    if nv is not None:
        if machine.nvme_dir is None:
            fixes.append(f"set tiers.nvme_dir to a directory with at least {format_bytes(nv / NVME_MARGIN)} free")
        else:
            fixes.append(
                f"free {format_bytes(nv / NVME_MARGIN - (machine.nvme_free_bytes or 0))} more under {machine.nvme_dir} "
                f"(it needs {format_bytes(nv / NVME_MARGIN)} free)"
            )
    dev = least(Tier.DEVICE)
    if dev is not None and machine.device_budget_from_memory:
        fixes.append(f"a GPU with {format_bytes(dev)} free for the plan (more than this one's)")
    elif dev is not None:
        fixes.append(f"raise tiers.device_budget_bytes to {exact_bytes(dev)}")
    if checkpointed_activation_bytes is not None and checkpointed_activation_bytes < activation_bytes:
        saved = activation_bytes - checkpointed_activation_bytes
        if any(not over_budget(dataclasses.replace(c, need_bytes={**c.need_bytes, Tier.DEVICE: c.need_bytes[Tier.DEVICE] - saved}), machine)
               for c in candidates):
            fixes.append(
                f"turn on activation checkpointing (model.activation_checkpointing = true): activations "
                f"{format_bytes(activation_bytes)} -> {format_bytes(checkpointed_activation_bytes)}"
            )
    if repartition is not None:
        world = partition.world_size * 2
        while world <= 4096:
            # The leanest placements only: if none of them fits a rank's share, no grid point does.
            split_partition = repartition(world)
            split = [
                evaluate(split_partition, config, machine, compute, activation_bytes, placement, 0)
                for placement in _lean_placements(machine.nvme_free_bytes is not None)
            ]
            if any(c is not None and not over_budget(c, machine) for c in split):
                fixes.append(
                    f"shard the state over {world} ranks (one per machine like this one): each rank's share fits"
                )
                break
            world *= 2
    if not fixes:
        fixes.append("make groups smaller (grouping.max_group_bytes) or use a machine with more memory")
    return " ".join(lines) + " Any one of these would make it fit: " + "; ".join(fixes) + "."
