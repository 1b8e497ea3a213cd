"""The engine's config sections: tiers and budgets, prefetch, grouping, optimizer, precision.

Each is a frozen dataclass with a docstring under every field, checked in `__post_init__`: a
mistake raises ValueError or TypeError naming the key as a config file writes it
("optimizer.lr"), the value and the fix. OffloadConfig (offload.py) holds them all.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from offload_trainer.config.loader import coerce_fields, path_field
from offload_trainer.config.placement import Placement, Tier


@dataclass(frozen=True)
class TierConfig:
    """Where each state kind is homed, and how many bytes each tier may hold."""

    params: Placement = Placement()
    """Home of the parameter shards. Also takes a tier name ("nvme") or a mapping of fractions."""

    grads: Placement = Placement()
    """Home of the fp32 gradient shards, accumulated there across micro-batches."""

    optimizer: Placement = Placement()
    """Home of the optimizer states: the moments, and the fp32 master copy when compute is low precision."""

    device_budget_bytes: int | None = None
    """Most bytes resident in device memory at once; None = no limit. Takes size strings ("40GiB")."""

    host_budget_bytes: int | None = None
    """Most bytes resident in host memory at once; None = no limit. Takes size strings ("64GiB")."""

    nvme_dir: str | None = path_field(None)
    """Directory for swap files; required when any placement puts bytes on NVME. Also takes a Path; a
    leading ~ is expanded."""

    release_idle_memory: bool = False
    """Give host memory that holds nothing live for a while back to the OS (a gradient home from its
    update to the next backward, idle staging buffers through a backward; tensors of 1 MiB or more,
    unpinned only, so not under CUDA; on the CPU also the heap memory a backward frees, at each
    group: glibc's malloc_trim): the process's peak RSS falls (gpt2-124m on the CPU: 0.49-0.50 x
    plain PyTorch's against 0.78), but every step faults those pages in again, which costs CPU and,
    when IO bounds the step, time (io-bound bench: about +20%). Budgets count the memory either way."""

    def __post_init__(self) -> None:
        coerce_fields(self, "tiers")
        for name in ("device_budget_bytes", "host_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"tiers.{name}={value} must be at least 1 byte, or None for no limit")
        if self.nvme_dir is not None and not self.nvme_dir.strip():
            raise ValueError(f"tiers.nvme_dir={self.nvme_dir!r} is empty: give a directory on the NVMe drive, or None")
        for kind in ("params", "grads", "optimizer"):
            placement: Placement = getattr(self, kind)
            if placement.nvme > 0.0 and self.nvme_dir is None:
                raise ValueError(
                    f"tiers.nvme_dir=None, but it is required when any placement puts bytes on nvme, and "
                    f"tiers.{kind} has nvme={placement.nvme:g}: set tiers.nvme_dir to a directory on the "
                    "NVMe drive (the swap files go there)"
                )

    def uses(self, tier: Tier) -> bool:
        """Whether any state kind homes bytes on `tier`."""
        return any(p.fraction(tier) > 0.0 for p in (self.params, self.grads, self.optimizer))


@dataclass(frozen=True)
class PrefetchConfig:
    """How far ahead of the group in use the scheduler fetches."""

    lookahead_groups: int = 2
    """How many groups ahead of the one in use the scheduler fetches; 0 = on demand only."""

    lookahead_bytes: int | None = None
    """Optional cap on the bytes fetched ahead, on top of the tier budgets; None = no cap. Takes size strings."""

    optimizer_groups_ahead: int = 1
    """How many groups' optimizer states (moments, master, parameter shard: all but the gradient) an
    update pass, once done, reads from NVMe again for the next pass, in the order the next forward
    needs them: they load behind that forward and backward, so that after backward the next pass
    starts on states already in memory ([Note: Hiding the optimizer step]). The default, 1, is the
    group the next forward waits for first; the pass reads each next group while it updates one.
    Bounded further by the host staging buffers free (some are left to the gradients); they are the
    existing staging pool's buffers, held from the pass to the next. 0 = read each state in its pass."""

    def __post_init__(self) -> None:
        coerce_fields(self, "prefetch")
        if self.optimizer_groups_ahead < 0:
            raise ValueError(
                f"prefetch.optimizer_groups_ahead={self.optimizer_groups_ahead} must be 0 (read optimizer "
                "states only after backward) or more"
            )
        if self.lookahead_groups < 0:
            raise ValueError(f"prefetch.lookahead_groups={self.lookahead_groups} must be 0 (on demand only) or more")
        if self.lookahead_bytes is not None and self.lookahead_bytes < 1:
            raise ValueError(
                f"prefetch.lookahead_bytes={self.lookahead_bytes} must be at least 1 byte, or None for no cap "
                "(to fetch nothing ahead, set prefetch.lookahead_groups=0)"
            )


@dataclass(frozen=True)
class GroupingConfig:
    """How the model's modules are partitioned into groups that move together."""

    module_classes: tuple[str, ...] = ()
    """Class names (type(module).__name__) whose instances each form one group; empty = auto: the
    blocks of the model's largest nn.ModuleList."""

    max_group_bytes: int | None = None
    """Pack consecutive blocks into one group up to this many parameter bytes; None = one block per
    group. Takes size strings."""

    min_group_bytes: int | None = None
    """Merge consecutive groups (after the above) until each holds at least this many parameter
    bytes, never past max_group_bytes (runtime/layout/merge_groups.py): many small blocks then move
    and are updated as a few large groups. None = no merging. Takes size strings."""

    def __post_init__(self) -> None:
        coerce_fields(self, "grouping")
        if self.min_group_bytes is not None and self.min_group_bytes < 1:
            raise ValueError(
                f"grouping.min_group_bytes={self.min_group_bytes} must be at least 1 byte, or None for no merging"
            )
        for name in self.module_classes:
            if not name.isidentifier():
                raise ValueError(
                    f"grouping.module_classes={list(self.module_classes)} holds {name!r}, which is not a class "
                    "name: give bare names such as 'LlamaDecoderLayer' (matched against type(module).__name__)"
                )
        if self.max_group_bytes is not None and self.max_group_bytes < 1:
            raise ValueError(
                f"grouping.max_group_bytes={self.max_group_bytes} must be at least 1 byte, "
                "or None for one block per group"
            )


class OptimizerKind(enum.Enum):
    """Which update rule the streaming optimizer applies to the flat fp32 shards."""

    ADAMW = "adamw"
    """AdamW with decoupled weight decay, equal to torch.optim.AdamW."""
    SGD = "sgd"
    """SGD with momentum (OptimizerConfig.momentum; 0 for plain SGD), equal to torch.optim.SGD."""

    def state_names(self, momentum: float) -> tuple[str, ...]:
        """The per-element states this update rule keeps (each one fp32 home per group): AdamW's two
        moments; SGD's momentum buffer, none for plain SGD (momentum 0)."""
        if self is OptimizerKind.ADAMW:
            return ("exp_avg", "exp_avg_sq")
        return ("momentum_buffer",) if momentum != 0 else ()


class LRSchedule(enum.Enum):
    """How the learning rate changes with the optimizer step (see OptimizerConfig.lr_at)."""

    CONSTANT = "constant"
    """OptimizerConfig.lr at every step."""
    WARMUP_COSINE = "warmup_cosine"
    """Linear warmup over warmup_steps, then cosine decay to lr * min_lr_ratio at total_steps; flat after."""



_DEFAULT_MOMENTUM = 0.9
_DEFAULT_EPS = 1e-8


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer, its hyperparameters and its learning-rate schedule."""

    kind: OptimizerKind = OptimizerKind.ADAMW
    """The update rule: "adamw" or "sgd"."""

    lr: float = 1e-3
    """Peak learning rate (the rate itself under the constant schedule)."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's decay rates of the first and second moments (SGD ignores them)."""

    eps: float = _DEFAULT_EPS
    """AdamW's term added to the denominator (SGD refuses another value)."""

    weight_decay: float = 0.01
    """Decoupled weight decay of matrices (parameters of two or more dimensions). Biases, norm weights
    (LayerNorm, RMSNorm, GroupNorm, ... and HF's own norm classes, by module type) and every other
    parameter of fewer than two dimensions get none, as in nanoGPT and the HF Trainer."""

    decay_embeddings: bool = True
    """Whether embedding weights (nn.Embedding, modules whose class is named *Embedding(s)) decay;
    True as in nanoGPT and the HF Trainer."""

    momentum: float = _DEFAULT_MOMENTUM
    """SGD momentum; 0 = plain SGD. AdamW refuses another value than this default."""

    no_decay_patterns: tuple[str, ...] = ()
    """Extra parameters to exempt from decay: those whose name contains one of these (case-insensitive).
    A pattern in no trainable parameter's name is refused at initialize (runtime/optimizer.py)."""

    grad_clip_norm: float | None = None
    """Clip the global L2 norm of the gradients to this; None = no clipping."""

    schedule: LRSchedule = LRSchedule.CONSTANT
    """The learning-rate schedule: "constant" or "warmup_cosine"."""

    warmup_steps: int = 0
    """Optimizer steps of linear warmup (warmup_cosine only)."""

    total_steps: int | None = None
    """Optimizer step at which the cosine decay reaches its end; required for warmup_cosine."""

    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of lr."""

    update_chunk_bytes: int = 16 << 20
    """A group whose optimizer states pass through host staging (NVMe homes, or device homes updated
    on the host) and whose fp32 shard is larger than this is updated in chunks of about this many
    bytes per state kind (whole IO blocks; [Note: Chunked updates] in runtime/optimizer.py): the
    host staging buffers and the states read ahead are then chunk-sized, not the group's size.
    Results are bitwise the same for any value. 16 MiB: the 124M configuration's staging is 9 x 16
    MiB (32 MiB: 9 x 32), still requests of 16 MiB to the disk."""

    def __post_init__(self) -> None:
        coerce_fields(self, "optimizer")
        if self.lr < 0.0:
            raise ValueError(f"optimizer.lr={self.lr} must be 0 or more")
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"optimizer.betas={self.betas} must be two numbers in [0, 1), e.g. (0.9, 0.999)")
        if self.eps < 0.0 or (self.eps == 0.0 and self.kind is OptimizerKind.ADAMW):
            # AdamW divides by sqrt(v) + eps: an element whose gradient has always been 0 (an embedding row of
            # a token not yet seen) becomes 0 / 0 = nan at the first step, so eps = 0 stops every LM run.
            raise ValueError(f"optimizer.eps={self.eps} must be above 0 for AdamW, e.g. 1e-8")
        if self.weight_decay < 0.0:
            raise ValueError(f"optimizer.weight_decay={self.weight_decay} must be 0 (no decay) or more")
        if self.momentum < 0.0:
            raise ValueError(f"optimizer.momentum={self.momentum} must be 0 (plain SGD) or more")
        # A setting of the other update rule would be ignored, silently: refused where it differs from
        # its default. (betas is not: the CLI's defaults set it whatever the kind.)
        if self.kind is OptimizerKind.ADAMW and self.momentum != _DEFAULT_MOMENTUM:
            raise ValueError(
                f"optimizer.momentum={self.momentum} is SGD's and AdamW does not use it: remove it (AdamW's "
                "first-moment decay is optimizer.betas[0]), or set optimizer.kind='sgd'"
            )
        if self.kind is OptimizerKind.SGD and self.eps != _DEFAULT_EPS:
            raise ValueError(
                f"optimizer.eps={self.eps} is AdamW's and SGD does not use it: remove it, or set optimizer.kind='adamw'"
            )
        for pattern in self.no_decay_patterns:
            if not pattern:
                raise ValueError(
                    f"optimizer.no_decay_patterns={list(self.no_decay_patterns)} holds an empty pattern, which "
                    "would match every parameter: remove it (use weight_decay=0 to turn decay off)"
                )
        if self.grad_clip_norm is not None and self.grad_clip_norm <= 0.0:
            raise ValueError(f"optimizer.grad_clip_norm={self.grad_clip_norm} must be above 0, or None for no clipping")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps={self.warmup_steps} must be 0 or more")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"optimizer.total_steps={self.total_steps} must be at least 1, or None")
        if self.update_chunk_bytes < 1:
            raise ValueError(
                f"optimizer.update_chunk_bytes={self.update_chunk_bytes} must be at least 1, e.g. 16777216 (16 MiB)"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optimizer.min_lr_ratio={self.min_lr_ratio} must be between 0 and 1")
        if self.schedule is LRSchedule.WARMUP_COSINE:
            if self.total_steps is None:
                raise ValueError(
                    "optimizer.total_steps=None, but schedule='warmup_cosine' needs it: set optimizer.total_steps "
                    "to the number of optimizer steps of the run"
                )
            if self.total_steps <= self.warmup_steps:
                raise ValueError(
                    f"optimizer.total_steps={self.total_steps} must be above warmup_steps={self.warmup_steps}, "
                    "leaving steps for the cosine decay"
                )
        elif self.warmup_steps:
            raise ValueError(
                f"optimizer.warmup_steps={self.warmup_steps} has no effect with schedule='{self.schedule.value}': "
                "set schedule='warmup_cosine' (with total_steps), or warmup_steps=0"
            )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step`, counting from 0 for the first step.

        Warmup: lr * (step + 1) / warmup_steps, reaching lr at step warmup_steps - 1. Then cosine from
        lr at step warmup_steps to lr * min_lr_ratio at step total_steps, and flat after.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step={step!r} must be an int (0 is the first optimizer step)")
        if step < 0:
            raise ValueError(f"step={step} must be 0 or more (0 is the first optimizer step)")
        if self.schedule is LRSchedule.CONSTANT:
            return self.lr
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        assert self.total_steps is not None  # checked in __post_init__
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        min_lr = self.lr * self.min_lr_ratio
        return min_lr + (self.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    @property
    def state_names(self) -> tuple[str, ...]:
        """The per-element optimizer states this config keeps (see OptimizerKind.state_names)."""
        return self.kind.state_names(self.momentum)


class ComputeDtype(enum.Enum):
    """The dtype forward and backward run in; gradients and optimizer states stay fp32."""

    FP32 = "fp32"
    """Full precision: the parameters are their own master copy, no loss scaling."""
    BF16 = "bf16"
    """bfloat16 compute with an fp32 master copy; fp32's exponent range, so no loss scaling."""
    FP16 = "fp16"
    """float16 compute with an fp32 master copy and dynamic loss scaling (see PrecisionConfig)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of this compute dtype."""
        return _TORCH_DTYPES[self]


_TORCH_DTYPES = {ComputeDtype.FP32: torch.float32, ComputeDtype.BF16: torch.bfloat16, ComputeDtype.FP16: torch.float16}


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute dtype and fp16 loss scaling."""

    compute_dtype: ComputeDtype = ComputeDtype.FP32
    """The dtype forward and backward run in: "fp32", "bf16" or "fp16"."""

    initial_loss_scale: float = 2.0**16
    """Loss scale at the first step (fp16 only)."""

    loss_scale_window: int = 1000
    """Steps without overflow before the loss scale doubles (fp16 only)."""

    min_loss_scale: float = 1.0
    """The loss scale never halves below this (fp16 only)."""

    def __post_init__(self) -> None:
        coerce_fields(self, "precision")
        if self.initial_loss_scale <= 0.0:
            raise ValueError(f"precision.initial_loss_scale={self.initial_loss_scale} must be above 0, e.g. 65536")
        if self.loss_scale_window < 1:
            raise ValueError(f"precision.loss_scale_window={self.loss_scale_window} must be at least 1, e.g. 1000")
        if self.min_loss_scale <= 0.0:
            raise ValueError(f"precision.min_loss_scale={self.min_loss_scale} must be above 0, e.g. 1.0")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(
                f"precision.min_loss_scale={self.min_loss_scale} is above initial_loss_scale="
                f"{self.initial_loss_scale}: lower it, or raise initial_loss_scale"
            )

    @property
    def uses_loss_scaling(self) -> bool:
        """Whether the loss is scaled (fp16 compute only)."""
        return self.compute_dtype is ComputeDtype.FP16
