"""The plan as a person reads it (a table) and as a script reads it (a dict for JSON).

Sections: the ZeRO stage 1/2/3 bytes per rank with activations, the chosen placement and bytes
per tier against the budgets, bytes moved per step on each link, predicted time per phase, the
bottleneck, and the planner's reasons. Byte counts are printed by config.byte_size.format_bytes,
in the largest binary unit each reaches.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from offload_trainer.config import OffloadConfig, Tier
from offload_trainer.config.byte_size import format_bytes
from offload_trainer.planning.cost_model import PhaseCost
from offload_trainer.planning.machine import MachineRates
from offload_trainer.planning.planner import KIND_NAMES, PlacementChoice
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


def render(
    choice: PlacementChoice,
    title: str,
    numel: int,
    world_size: int,
    config: OffloadConfig,
    checkpointed_activation_bytes: Optional[int],
) -> str:
    c = choice.chosen
    m = choice.machine
    lines: List[str] = [title, f"  machine: {rates_line(m.rates)}", ""]
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

    lines.append(f"placement (lookahead {c.lookahead_groups} groups)")
    lines.append(f"  {'':<12}{'device':>9}{'host':>9}{'nvme':>9}")
    for kind, placement in zip(KIND_NAMES, (c.params, c.grads, c.optimizer)):
        lines.append(f"  {kind:<12}" + "".join(f"{placement.fraction(t):>9.0%}" for t in Tier))
    budgets = {Tier.DEVICE: m.device_budget_bytes, Tier.HOST: m.host_budget_bytes, Tier.NVME: m.nvme_free_bytes}
    lines.append(f"  {'tier':<12}{'needs':>12}{'budget':>18}")
    for tier in Tier:
        budget = "none" if budgets[tier] is None else format_bytes(budgets[tier])
        if tier is Tier.NVME and budgets[tier] is not None:
            budget += " free"
        lines.append(f"  {tier.value:<12}{format_bytes(c.need_bytes[tier]):>12}{budget:>18}")
    lines.append("")

    phases = c.cost.phases()
    lines.append(f"bytes moved per step ({c.cost.num_micro_batches} micro-batch(es); forward and backward per micro-batch)")
    lines.append(f"  {'link':<20}" + "".join(f"{name:>12}" for name in phases))
    for label, attr in (("NVMe read", "nvme_read_bytes"), ("NVMe write", "nvme_write_bytes"), ("host -> device", "copy_bytes")):
        lines.append(f"  {label:<20}" + "".join(f"{format_bytes(getattr(p, attr)):>12}" for p in phases.values()))
    lines.append("")
    lines.append("predicted seconds per phase")
    lines.append(f"  {'phase':<12}{'compute':>10}{'io':>10}{'time':>10}  bound")
    for name, p in phases.items():
        lines.append(f"  {name:<12}{p.compute_s:>10.3f}{p.io_s:>10.3f}{p.time_s:>10.3f}  {p.bound}")
    lines.append(f"  {'step':<12}{'':>10}{'':>10}{c.cost.step_s:>10.3f}")
    lines.append("")
    lines.append("why")
    lines += [f"  - {reason}" for reason in choice.reasons]
    lines.append(f"  ({choice.num_fitting} of {choice.num_candidates} placements on the grid fit the budgets)")
    return "\n".join(lines)


def _phase_dict(p: PhaseCost) -> dict:
    return {
        "compute_s": p.compute_s, "io_s": p.io_s, "time_s": p.time_s, "bound": p.bound,
        "blocking_copy_s": p.blocking_copy_s,
        "nvme_read_bytes": p.nvme_read_bytes, "nvme_write_bytes": p.nvme_write_bytes, "copy_bytes": p.copy_bytes,
    }


def as_dict(
    choice: PlacementChoice, numel: int, world_size: int, config: OffloadConfig, checkpointed_activation_bytes: Optional[int]
) -> dict:
    c = choice.chosen
    return {
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
        "phases": {name: _phase_dict(p) for name, p in c.cost.phases().items()},
        "predicted_step_s": c.cost.step_s,
        "bottleneck": c.cost.bottleneck,
        "reasons": list(choice.reasons),
        "rates": choice.machine.rates.to_dict(),
    }
