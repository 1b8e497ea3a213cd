"""What the layer-major schedule changes in a plan: the activations it keeps and the parameter bytes it moves.

    estimate = estimate_layer_major(spec, partition, choice.chosen.cost, micro_batch, num_micro_batches, dtype_bytes)
    print("\n".join(estimate.lines()))       # offload-plan, under train.micro_batch_order = "layer_major"

Pure arithmetic beside the planner's (runtime/layer_major.py says what the schedule does):
- activations: every block's input for every micro-batch of the step (the boundaries, T x dim in
  the compute dtype each; with tied embeddings the last block's outputs too, [Note: Tied weights]),
  plus what one block and the head keep of one micro-batch while they run: activation
  checkpointing's bytes for one micro-batch (zero_memory.activation_bytes) with its one boundary
  per block replaced by the step's. The boundaries stay on the device as far as its budget has
  room, then go to host memory, then NVMe (runtime/boundary_store.py): the planner does not yet
  weigh that placement or its copies against the other tiers' needs.
- parameter bytes fetched per step: the cost model's forward and backward fetches (bytes copied
  into device slots) happen once per micro-batch micro-batch-major, once per step layer-major; with
  tied embeddings the tied weight's group is fetched once more in backward (the begin's backward
  runs the head again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set

import torch

from offload_trainer.config.byte_size import format_bytes
from offload_trainer.planning.cost_model import StepCost
from offload_trainer.planning.model_spec import MicroBatch, ModelSpec
from offload_trainer.planning.zero_memory import activation_bytes
from offload_trainer.runtime.layout.partition import PartitionPlan


@dataclass(frozen=True)
class LayerMajorEstimate:
    """The layer-major schedule's activations and parameter traffic for one step, beside micro-batch-major's."""

    num_micro_batches: int
    tied: bool
    """The embedding and the head share their weight (one more boundary per micro-batch, one more fetch)."""
    boundary_bytes: int
    """Every block's input for every micro-batch (and the last block's outputs when tied)."""
    activation_bytes: int
    """The boundaries plus one block's and the head's saved tensors of one micro-batch."""
    micro_batch_major_activation_bytes: int
    """One micro-batch's activations, as the planner counts them for micro-batch-major."""
    param_bytes_per_step: int
    """Parameter bytes fetched into the device per step, layer-major."""
    micro_batch_major_param_bytes_per_step: int
    """The same, micro-batch-major: the cost model's per micro-batch fetches, times the micro-batches."""

    @property
    def param_bytes_ratio(self) -> float:
        """Layer-major's parameter bytes per step over micro-batch-major's (1/M, a little more when tied)."""
        return self.param_bytes_per_step / max(1, self.micro_batch_major_param_bytes_per_step)

    def lines(self) -> List[str]:
        """The report's section."""
        m = self.num_micro_batches
        tie = ", and the last block's outputs (tied embeddings)" if self.tied else ""
        return [
            f'layer-major schedule (train.micro_batch_order = "layer_major", {m} micro-batch(es) per step)',
            f"  activations: {format_bytes(self.activation_bytes)} (micro-batch-major: "
            f"{format_bytes(self.micro_batch_major_activation_bytes)} per micro-batch)",
            f"    of which boundaries: {format_bytes(self.boundary_bytes)}: every block's input for every "
            f"micro-batch{tie}; kept on the device while its budget has room, then host memory, then NVMe",
            f"  parameter bytes fetched per step: {format_bytes(self.param_bytes_per_step)} (micro-batch-major: "
            f"{format_bytes(self.micro_batch_major_param_bytes_per_step)}; ratio {self.param_bytes_ratio:.3f})",
        ]

    def as_dict(self) -> Dict[str, Any]:
        return {
            "num_micro_batches": self.num_micro_batches,
            "tied": self.tied,
            "boundary_bytes": self.boundary_bytes,
            "activation_bytes": self.activation_bytes,
            "micro_batch_major_activation_bytes": self.micro_batch_major_activation_bytes,
            "param_bytes_per_step": self.param_bytes_per_step,
            "micro_batch_major_param_bytes_per_step": self.micro_batch_major_param_bytes_per_step,
            "param_bytes_ratio": self.param_bytes_ratio,
        }


def _tied_groups(spec: ModelSpec, partition: PartitionPlan) -> Set[int]:
    """The groups holding a parameter registered under more than one name (tied embeddings)."""
    counts: Dict[int, List[str]] = {}
    for name, p in spec.module.named_parameters(remove_duplicate=False):
        counts.setdefault(id(p), []).append(name)
    tied_names = {n for names in counts.values() if len(names) > 1 for n in names}
    return {g.index for g in partition.groups if any(p.name in tied_names for p in g.params)}


def estimate_layer_major(
    spec: ModelSpec,
    partition: PartitionPlan,
    cost: StepCost,
    micro_batch: MicroBatch,
    num_micro_batches: int,
    dtype_bytes: int,
    micro_batch_major_activation_bytes: int,
    device: Optional[torch.device] = None,
) -> LayerMajorEstimate:
    """The estimate for `spec` with `cost` (the planner's chosen placement's StepCost), computed on
    `device` (zero_memory.activation_bytes)."""
    tied_groups = _tied_groups(spec, partition)
    tied = bool(tied_groups)
    boundary_bytes = 0
    acts = micro_batch_major_activation_bytes
    if spec.shape is not None:
        one = micro_batch.batch_size * micro_batch.seq_len * spec.shape.dim * dtype_bytes
        boundary_bytes = (spec.shape.n_layers + tied) * num_micro_batches * one
        checkpointed = activation_bytes(
            spec.shape, micro_batch.batch_size, micro_batch.seq_len, dtype_bytes, True, device
        )
        acts = checkpointed - spec.shape.n_layers * one + boundary_bytes
    per_pass = cost.forward.copy_bytes + cost.backward.copy_bytes
    pbytes = dtype_bytes
    tied_extra = sum(g.flat_numel * pbytes for g in partition.groups if g.index in tied_groups) if per_pass else 0
    return LayerMajorEstimate(
        num_micro_batches=num_micro_batches,
        tied=tied,
        boundary_bytes=boundary_bytes,
        activation_bytes=acts,
        micro_batch_major_activation_bytes=micro_batch_major_activation_bytes,
        param_bytes_per_step=per_pass + tied_extra,
        micro_batch_major_param_bytes_per_step=num_micro_batches * per_pass,
    )


__all__ = ["LayerMajorEstimate", "estimate_layer_major"]
