"""From a model, a micro-batch and a config to a placement: what the planner needs to know, in one place.

    spec = ModelSpec.from_preset("350m")            # or from_hf_config(dir), from_module(model)
    choice = plan_for_model(spec, cfg, MicroBatch(2, 256), torch.device("cpu"))
    cfg = choice.apply(cfg)                          # tiers and lookahead chosen

The model is only ever built on the meta device here. Its compute time comes from
compute_probe (one block and the ends, timed at the micro-batch's batch_size x seq_len), the
machine's rates from machine (both cached per machine), activations from zero_memory's estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from offload_trainer.config import json_text
from offload_trainer.planning.compute_probe import cached_decoder_times
from offload_trainer.config import OffloadConfig, OptimizerKind
from offload_trainer.planning.cost_model import ComputeTimes
from offload_trainer.planning.machine import MachineRates, default_cache_path, machine_rates
from offload_trainer.models.decoder import DecoderConfig, DecoderLM
from offload_trainer.models.hf_checkpointing import hf_checkpointing_on
from offload_trainer.models.meta_init import on_meta
from offload_trainer.runtime.layout.merge_groups import merge_small_groups
from offload_trainer.runtime.layout.partition import SHARD_ALIGN_NUMEL, PartitionPlan, plan_partition
from offload_trainer.errors import PlanError
from offload_trainer.planning.planner import Candidate, Machine, PlacementChoice, evaluate, over_budget, plan_placement
from offload_trainer.planning.zero_memory import DecoderShape, activation_bytes, check_hf_sizes



@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one rank: what compute time and activations are predicted for."""

    batch_size: int
    """Sequences per micro-batch on one rank."""
    seq_len: int
    """Tokens per sequence."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"micro_batch {name}={value!r} must be an int of at least 1")


@dataclass
class ModelSpec:
    """A model to plan for: its module tree (parameters on meta, or a live model) and its shape."""

    name: str
    module: nn.Module
    shape: Optional[DecoderShape]
    """None for a model that is not a decoder the probe knows: compute is then not predicted."""
    activation_checkpointing: bool

    @classmethod
    def from_preset(cls, preset: str, activation_checkpointing: bool = False, **overrides: object) -> ModelSpec:
        config = DecoderConfig.preset(preset, **overrides)
        with on_meta():
            module = DecoderLM(config, activation_checkpointing=activation_checkpointing)
        return cls(f"preset {preset}", module, DecoderShape.from_decoder_config(config), activation_checkpointing)

    @classmethod
    def from_hf_config(cls, path: str | Path, activation_checkpointing: bool = False) -> ModelSpec:
        """A Hugging Face causal LM from its config.json (a file, or the directory holding it)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"{str(path)!r} is neither a config.json nor a directory holding one")
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise ValueError("planning a Hugging Face model needs transformers: pip install 'offload-trainer[hf]'") from None
        raw = json_text.loads(file.read_text(encoding="utf-8"))
        check_hf_sizes(raw)  # before transformers builds a model of them
        hf_config = AutoConfig.from_pretrained(file.parent if file.name == "config.json" else file)
        # Only shapes are read here (nothing runs), so buffers may stay on meta with the parameters.
        with on_meta():
            module = AutoModelForCausalLM.from_config(hf_config)
        return cls(f"{file}", module, DecoderShape.from_hf_config(raw), activation_checkpointing)

    @classmethod
    def from_module(cls, module: nn.Module, activation_checkpointing: Optional[bool] = None) -> ModelSpec:
        """A live model (or one on meta): the built-in decoder and HF decoders have a known shape."""
        shape: Optional[DecoderShape] = None
        ckpt = bool(getattr(module, "activation_checkpointing", False) or hf_checkpointing_on(module))
        if isinstance(module, DecoderLM):
            shape = DecoderShape.from_decoder_config(module.config)
        elif hasattr(module, "config") and hasattr(module.config, "to_dict"):
            try:
                shape = DecoderShape.from_hf_config(module.config.to_dict())
            except ValueError:
                shape = None
        return cls(type(module).__name__, module, shape, ckpt if activation_checkpointing is None else activation_checkpointing)

    def partition(self, config: OffloadConfig, world_size: int) -> PartitionPlan:
        grouping = config.grouping
        plan = plan_partition(self.module, grouping, world_size=world_size, align_numel=SHARD_ALIGN_NUMEL)
        return merge_small_groups(plan, grouping.min_group_bytes, grouping.max_group_bytes, SHARD_ALIGN_NUMEL)


def compute_times(
    spec: ModelSpec,
    config: OffloadConfig,
    micro_batch: MicroBatch,
    partition: PartitionPlan,
    rates: MachineRates,
    cache_path: Path,
    refresh: bool = False,
    progress: Optional[Callable[[str], None]] = None,
    rank: int = 0,
    device: torch.device = torch.device("cpu"),
) -> ComputeTimes:
    """One micro-batch's forward and backward (probed on `device`, or 0 for an unknown shape) and
    rank's update time."""
    trainable = sum(g.trainable_shard_numel(rank) for g in partition.groups)
    adamw = config.optimizer.kind is OptimizerKind.ADAMW
    update_s = trainable / (rates.adamw_elements_per_s if adamw else rates.sgd_elements_per_s)
    if spec.shape is None:
        return ComputeTimes(0.0, 0.0, update_s)
    times, _ = cached_decoder_times(
        spec.shape, micro_batch.batch_size, micro_batch.seq_len, config.precision.compute_dtype.torch_dtype,
        spec.activation_checkpointing, cache_path, refresh, progress, device=device,
    )
    return ComputeTimes(times.forward_s, times.backward_s, update_s)


def activations(
    spec: ModelSpec, config: OffloadConfig, micro_batch: MicroBatch, checkpointing: bool, device: torch.device
) -> int:
    """One micro-batch's activation bytes on `device` (0 for a model of unknown shape)."""
    if spec.shape is None:
        return 0
    dtype_bytes = config.precision.compute_dtype.torch_dtype.itemsize
    return activation_bytes(
        spec.shape, micro_batch.batch_size, micro_batch.seq_len, dtype_bytes, checkpointing, device=device
    )


@dataclass(frozen=True)
class PlanningInputs:
    """What the planner needs about one model on this machine, for plan_placement and evaluate."""

    partition: PartitionPlan
    machine: Machine
    compute: ComputeTimes
    activation_bytes: int


def planning_inputs(
    spec: ModelSpec,
    config: OffloadConfig,
    micro_batch: MicroBatch,
    device: torch.device,
    world_size: int = 1,
    cache_path: Optional[Path] = None,
    refresh: bool = False,
    progress: Optional[Callable[[str], None]] = None,
    rates: Optional[MachineRates] = None,
    partition: Optional[PartitionPlan] = None,
) -> PlanningInputs:
    """Rates (measured or cached), the partition (unless given), compute time and activations."""
    cache = cache_path if cache_path is not None else default_cache_path()
    if rates is None:
        rates, _ = machine_rates(config.tiers.nvme_dir, config.io, device, cache_path=cache, refresh=refresh, progress=progress)
    if partition is None:
        partition = spec.partition(config, world_size)
    compute = compute_times(
        spec, config, micro_batch, partition, rates, cache.with_name("compute.json"), refresh, progress, device=device
    )
    acts = activations(spec, config, micro_batch, spec.activation_checkpointing, device)
    return PlanningInputs(partition, Machine.from_config(config, device, rates), compute, acts)


def plan_for_model(
    spec: ModelSpec, config: OffloadConfig, micro_batch: MicroBatch, device: torch.device, **options: Any
) -> PlacementChoice:
    """The planner's choice for `spec` trained as `config` says on this machine (PlanError if nothing fits).

    `options` are planning_inputs's: world_size, cache_path, refresh, progress, rates, partition.
    Budgets are checked before anything is measured: see [Note: Refuse before timing]."""
    if options.get("partition") is None:
        options["partition"] = spec.partition(config, options.get("world_size", 1))
    acts_ckpt = None if spec.activation_checkpointing else activations(spec, config, micro_batch, True, device)
    repartition = lambda w: spec.partition(config, w)  # noqa: E731
    refuse_if_nothing_fits(spec, config, micro_batch, device, options["partition"], acts_ckpt, repartition)
    inputs = planning_inputs(spec, config, micro_batch, device, **options)
    return plan_placement(
        inputs.partition, config, inputs.machine, inputs.compute, inputs.activation_bytes, acts_ckpt,
        repartition=repartition,
    )


# [Note: Refuse before timing]
# Whether a placement fits depends on the budgets, the partition and the activations alone: the
# machine's rates and the compute probe only rank the placements that fit. Measuring them is
# slow (a disk pass on a cache miss; a block of a 70b model timed at the micro-batch takes
# minutes on a CPU), so plan_for_model first runs the planner with placeholder rates and zero
# compute time, and raises its refusal before measuring anything; only a model that fits
# somewhere is measured and planned for real.

_PLACEHOLDER_RATE = 1.0
"""Any positive rate: with it the planner's fit check runs, and no prediction of it is used."""


def refuse_if_nothing_fits(
    spec: ModelSpec,
    config: OffloadConfig,
    micro_batch: MicroBatch,
    device: torch.device,
    partition: PartitionPlan,
    checkpointed_activation_bytes: Optional[int],
    repartition: Callable[[int], PartitionPlan],
) -> PlacementChoice:
    """PlanError, with the planner's numbers and fixes, if no placement fits the budgets; nothing is measured.

    Returns the planner's choice with every rate equal and compute free: its needs per tier and bytes
    moved are real, its times and reasons are not (offload-plan --no-measure shows the former alone)."""
    has_nvme = config.tiers.nvme_dir is not None
    nvme_rate = _PLACEHOLDER_RATE if has_nvme else None
    rates = MachineRates(
        nvme_read_bytes_per_s=nvme_rate, nvme_write_bytes_per_s=nvme_rate, nvme_direct_io=True if has_nvme else None,
        host_to_device_bytes_per_s=_PLACEHOLDER_RATE, device_to_host_bytes_per_s=_PLACEHOLDER_RATE,
        adamw_elements_per_s=_PLACEHOLDER_RATE, sgd_elements_per_s=_PLACEHOLDER_RATE,
    )
    return plan_placement(
        partition, config, Machine.from_config(config, device, rates), ComputeTimes(0.0, 0.0, 0.0),
        activations(spec, config, micro_batch, spec.activation_checkpointing, device), checkpointed_activation_bytes,
        repartition=repartition,
    )


def predict_config(
    spec: ModelSpec,
    config: OffloadConfig,
    micro_batch: MicroBatch,
    device: torch.device,
    rates: MachineRates,
    cache_path: Optional[Path] = None,
    world_size: int = 1,
) -> Candidate:
    """The planner's view of `config` as written (placement, lookahead, grouping): needs and predicted cost.

    Raises PlanError when the config does not fit its budgets (as initialize would)."""
    inputs = planning_inputs(spec, config, micro_batch, device, world_size, cache_path, rates=rates)
    placement = (config.tiers.params, config.tiers.grads, config.tiers.optimizer)
    candidate = evaluate(
        inputs.partition, config, inputs.machine, inputs.compute, inputs.activation_bytes, placement,
        config.prefetch.lookahead_groups,
    )
    if candidate is None:
        raise PlanError("this placement has no path in this version for this device (see memory_plan)")
    over = over_budget(candidate, inputs.machine)
    if over:
        raise PlanError(
            "the config does not fit: "
            + ", ".join(f"{tier.value} needs {candidate.need_bytes[tier]} bytes, {over[tier]} over" for tier in over)
        )
    return candidate
