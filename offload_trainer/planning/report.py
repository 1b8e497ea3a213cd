"""The plan as a person reads it (a table) and as a script reads it (a dict for JSON).

Sections: the fit check (no timing), the ZeRO stage 1/2/3 bytes per rank with activations, the
chosen placement and bytes per tier against the budgets, bytes moved per step on each link,
predicted time per phase (forward and backward per micro-batch, the optimizer per step), the
bottleneck, the planner's reasons, and the config's own placement beside the planned one. A plan
made without measuring (timed=False: offload-plan --no-measure) shows what needs no rates alone:
bytes, never seconds. Byte counts are printed by config.byte_size.format_bytes, in the largest
binary unit each reaches.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from offload_trainer.config import OffloadConfig, Placement, Tier
from offload_trainer.config.byte_size import format_bytes
from offload_trainer.planning.cost_model import PhaseCost
from offload_trainer.planning.machine import MachineRates
from offload_trainer.planning.planner import KIND_NAMES, Candidate, Machine, PlacementChoice, over_budget
from offload_trainer.planning.zero_memory import ZeroBytes, training_bytes_per_element, zero_bytes_per_rank


def zero_table(numel: int, world_size: int, config: OffloadConfig) -> Dict[int, ZeroBytes]:
    """Per-rank bytes of each state kind for ZeRO stages 0-3 with this config's precision and optimizer."""
    per_element = training_bytes_per_element(
        config.precision.compute_dtype.torch_dtype, config.optimizer.kind, config.optimizer.momentum
    )
    return {stage: zero_bytes_per_rank(numel, world_size, stage, *per_element) for stage in range(4)}


def rates_line(rates: MachineRates) -> str:
    nvme = (
        "no nvme_dir"
        if rates.nvme_read_bytes_per_s is None
        else f"NVMe read {rates.nvme_read_bytes_per_s / 1e9:.2f} GB/s, write {rates.nvme_write_bytes_per_s / 1e9:.2f} GB/s"
        + ("" if rates.nvme_direct_io else " (buffered)")
    )
    return (
        f"{nvme}; host<->device copy {rates.host_to_device_bytes_per_s / 1e9:.1f} GB/s; "
        f"AdamW update {rates.adamw_elements_per_s / 1e9:.2f} G elements/s"
    )


def _budget(value: Optional[int], free: bool = False) -> str:
    if value is None:
        return "none"
    return format_bytes(value) + (" free" if free else "")


def fit_line(fit: PlacementChoice) -> str:
    """The answer that needs no timing: it fits, on how many placements, against which budgets."""
    m = fit.machine
    nvme = "no nvme_dir" if m.nvme_free_bytes is None else f"NVMe {_budget(m.nvme_free_bytes, True)}"
    if m.nvme_memory_file_system is not None:
        nvme += f" on {m.nvme_memory_file_system}, counted as host memory"
    return (
        f"fit check (nothing measured): fits; {fit.num_fitting} of {fit.num_candidates} placements on the "
        f"planner's grid fit the budgets (device {m.budget_words(Tier.DEVICE)}, host "
        f"{m.budget_words(Tier.HOST)}, {nvme})"
    )


def placement_words(params: Placement, grads: Placement, optimizer: Placement) -> str:
    """'params nvme, grads host, optimizer host 25%+nvme 75%'."""

    def one(placement: Placement) -> str:
        return "+".join(
            t.value if placement.fraction(t) >= 1 else f"{t.value} {placement.fraction(t):.0%}" for t in placement.tiers()
        )

    return f"params {one(params)}, grads {one(grads)}, optimizer {one(optimizer)}"


def _placement_text(c: Candidate) -> str:
    return f"{placement_words(c.params, c.grads, c.optimizer)}, lookahead {c.lookahead_groups}"


def same_placement(a: Candidate, b: Candidate) -> bool:
    return (a.params, a.grads, a.optimizer, a.lookahead_groups) == (b.params, b.grads, b.optimizer, b.lookahead_groups)


def compare_lines(yours: Optional[Candidate], choice: PlacementChoice, timed: bool) -> List[str]:
    """The config's own placement beside the planned one: whether it fits, what it needs and, when
    timed, its predicted step."""
    lines = ["your config's placement against the plan"]
    if yours is None:
        return lines + ["  yours has no path in this version for this device (see memory_plan)"]
    c, m = choice.chosen, choice.machine
    lines.append(f"  {'':<8}{'device':>12}{'host':>12}{'nvme':>12}" + (f"{'step s':>10}" if timed else "") + "  placement")
    for label, cand in (("yours", yours), ("planned", c)):
        lines.append(
            f"  {label:<8}" + "".join(f"{format_bytes(cand.need_bytes[t]):>12}" for t in Tier)
            + (f"{cand.cost.step_s:>10.3f}" if timed else "") + f"  {_placement_text(cand)}"
        )
    over = over_budget(yours, m)
    if over:
        lines.append("  yours does not fit: " + ", ".join(
            f"{t.value} needs {format_bytes(yours.need_bytes[t])}, {format_bytes(n)} over its budget" for t, n in over.items()
        ))
    return lines


def render(
    choice: PlacementChoice,
    title: str,
    numel: int,
    world_size: int,
    config: OffloadConfig,
    checkpointed_activation_bytes: Optional[int],
    timed: bool = True,
) -> str:
    """The plan as a table; timed=False (nothing measured): bytes alone, no seconds, rates or reasons."""
    c = choice.chosen
    m = choice.machine
    machine = f"  machine: {rates_line(m.rates)}" if timed else "  machine: not measured (--no-measure): bytes only, no times"
    lines: List[str] = [title, machine, ""]
    lines.append(f"ZeRO bytes per rank ({world_size} rank{'s' if world_size > 1 else ''}, as the ZeRO paper defines the stages)")
    lines.append(f"  {'stage':<28}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}")
    names = {0: "0 (data parallel)", 1: "1 (optimizer states)", 2: "2 (+ gradients)", 3: "3 (+ parameters)"}
    for stage, z in zero_table(numel, world_size, config).items():
        lines.append(
            f"  {names[stage]:<28}{format_bytes(z.params_bytes):>12}{format_bytes(z.grads_bytes):>12}"
            f"{format_bytes(z.optimizer_bytes):>12}{format_bytes(z.total_bytes):>12}"
        )
    acts = f"  activations per micro-batch: {format_bytes(choice.activation_bytes)}"
    if checkpointed_activation_bytes is not None:
        acts += f" ({format_bytes(checkpointed_activation_bytes)} with activation checkpointing)"
    lines += [acts, ""]

    lines.append(
        f"placement (lookahead {c.lookahead_groups} groups)" if timed else
        f"a placement that fits (lookahead {c.lookahead_groups} groups; with nothing measured it is not ranked by speed)"
    )
    lines.append(f"  {'':<12}{'device':>9}{'host':>9}{'nvme':>9}")
    for kind, placement in zip(KIND_NAMES, (c.params, c.grads, c.optimizer)):
        lines.append(f"  {kind:<12}" + "".join(f"{placement.fraction(t):>9.0%}" for t in Tier))
    budgets = {Tier.DEVICE: m.device_budget_bytes, Tier.HOST: m.host_budget_bytes, Tier.NVME: m.nvme_free_bytes}
    lines.append(f"  {'tier':<12}{'needs':>12}{'budget':>18}")
    for tier in Tier:
        budget = _budget(budgets[tier], free=tier is Tier.NVME)
        lines.append(f"  {tier.value:<12}{format_bytes(c.need_bytes[tier]):>12}{budget:>18}")
    lines.append("")

    phases = c.cost.phases()
    lines.append(f"bytes moved per step ({c.cost.num_micro_batches} micro-batch(es); forward and backward per micro-batch)")
    lines.append(f"  {'link':<20}" + "".join(f"{name:>12}" for name in phases))
    for label, attr in (("NVMe read", "nvme_read_bytes"), ("NVMe write", "nvme_write_bytes"), ("host -> device", "copy_bytes")):
        lines.append(f"  {label:<20}" + "".join(f"{format_bytes(getattr(p, attr)):>12}" for p in phases.values()))
    lines.append("")
    if not timed:
        return "\n".join(lines[:-1])
    n = c.cost.num_micro_batches
    lines.append(f"predicted seconds (forward and backward: per micro-batch, {n} per step; optimizer: per step)")
    lines.append(f"  {'phase':<12}{'per':<13}{'compute':>10}{'io':>10}{'time':>10}  bound")
    for name, p in phases.items():
        per = "step" if name == "optimizer" else "micro-batch"
        lines.append(f"  {name:<12}{per:<13}{p.compute_s:>10.3f}{p.io_s:>10.3f}{p.time_s:>10.3f}  {p.bound}")
    lines.append(f"  {'step':<12}{'step':<13}{'':>10}{'':>10}{c.cost.step_s:>10.3f}  ({n} x (forward + backward) + optimizer)")
    lines.append("")
    lines.append("why")
    lines += [f"  - {reason}" for reason in choice.reasons]
    lines.append(f"  ({choice.num_fitting} of {choice.num_candidates} placements on the grid fit the budgets)")
    return "\n".join(lines)


def _phase_dict(p: PhaseCost, name: str) -> dict:
    return {
        "per": "step" if name == "optimizer" else "micro-batch",
        "compute_s": p.compute_s, "io_s": p.io_s, "time_s": p.time_s, "bound": p.bound,
        "blocking_copy_s": p.blocking_copy_s,
        "nvme_read_bytes": p.nvme_read_bytes, "nvme_write_bytes": p.nvme_write_bytes, "copy_bytes": p.copy_bytes,
    }


def _candidate_dict(c: Candidate, machine: Machine, timed: bool) -> dict:
    out = {
        "placement": {
            kind: {t.value: placement.fraction(t) for t in Tier}
            for kind, placement in zip(KIND_NAMES, (c.params, c.grads, c.optimizer))
        },
        "lookahead_groups": c.lookahead_groups,
        "need_bytes": {t.value: n for t, n in c.need_bytes.items()},
        "fits": not over_budget(c, machine),
    }
    if timed:
        out["predicted_step_s"] = c.cost.step_s
    return out


def as_dict(
    choice: PlacementChoice, numel: int, world_size: int, config: OffloadConfig, checkpointed_activation_bytes: Optional[int],
    timed: bool = True, yours: Optional[Candidate] = None,
) -> dict:
    """The plan for a script. Per-phase seconds are per micro-batch for forward and backward, per step
    for the optimizer ("per" says which); timed=False leaves out every time, the rates and the reasons."""
    c = choice.chosen
    out = {
        "measured": timed,
        "num_params": numel,
        "world_size": world_size,
        "zero_bytes_per_rank": {
            str(stage): {"params": z.params_bytes, "grads": z.grads_bytes, "optimizer": z.optimizer_bytes, "total": z.total_bytes}
            for stage, z in zero_table(numel, world_size, config).items()
        },
        "activation_bytes": choice.activation_bytes,
        "checkpointed_activation_bytes": checkpointed_activation_bytes,
        "placement": {
            kind: {t.value: placement.fraction(t) for t in Tier}
            for kind, placement in zip(KIND_NAMES, (c.params, c.grads, c.optimizer))
        },
        "lookahead_groups": c.lookahead_groups,
        "need_bytes": {t.value: n for t, n in c.need_bytes.items()},
        "budgets": {
            "device": choice.machine.device_budget_bytes,
            "host": choice.machine.host_budget_bytes,
            "nvme_free": choice.machine.nvme_free_bytes,
        },
        "phases": {name: _phase_dict(p, name) for name, p in c.cost.phases().items()},
        "predicted_step_s": c.cost.step_s,
        "bottleneck": c.cost.bottleneck,
        "reasons": list(choice.reasons),
        "rates": choice.machine.rates.to_dict(),
    }
    if yours is not None:
        out["yours"] = _candidate_dict(yours, choice.machine, timed)
    if not timed:
        for key in ("predicted_step_s", "bottleneck", "reasons", "rates"):
            del out[key]
        out["phases"] = {
            name: {k: v for k, v in d.items() if k.endswith("_bytes") or k == "per"} for name, d in out["phases"].items()
        }
    return out
