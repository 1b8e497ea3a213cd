"""Mixed precision: bf16/fp16 compute over fp32 master weights, and fp16's dynamic loss scaling.

Low-precision compute keeps the parameter homes (and device copies) in the compute dtype, and an
fp32 master copy of the trainable parameters as one more optimizer state: the update runs on
the master and its rounding is written back to the parameter home. Gradients arrive in the
compute dtype and are accumulated in fp32.

fp16 gradients underflow without scaling: the loss is multiplied by `scale` before backward, the
optimizer divides it out, and a step whose gradients hold inf or nan is skipped and halves the
scale; `loss_scale_window` good steps in a row double it. An overflow at `min_loss_scale` is no
longer a scale problem (halving cannot go on): the step counts as non-finite, as in fp32, so that
train.on_nonfinite decides, not a run that skips every step from then on without a word.

Buffers keep their dtype (buffer_dtype), but a norm's running statistics: those follow the compute
dtype, as `model.to(dtype)` makes them in plain PyTorch, since torch's batch_norm takes them only in
its weight's dtype (a BatchNorm model under bf16 stopped at its first forward with "expected scalar
type BFloat16 but found Float").
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from offload_trainer.config import PrecisionConfig


def buffer_dtype(module: nn.Module, buffer: torch.Tensor, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a buffer of `module` takes under `compute_dtype`: a floating-point buffer of a norm
    with running statistics (BatchNorm, InstanceNorm, SyncBatchNorm) takes the compute dtype; every
    other buffer keeps its own (a rotary frequency table stays fp32; a floating-point buffer that
    enters the activations then promotes them to fp32, so cast it to the input's dtype in forward)."""
    if isinstance(module, _NormBase) and buffer.is_floating_point():
        return compute_dtype
    return buffer.dtype


class LossScaler:
    """The dynamic loss scale (a constant 1 unless compute is fp16)."""

    def __init__(self, cfg: PrecisionConfig) -> None:
        self.enabled = cfg.uses_loss_scaling
        self.scale = cfg.initial_loss_scale if self.enabled else 1.0
        self.window = cfg.loss_scale_window
        self.min_scale = cfg.min_loss_scale
        self.good_steps = 0
        self.num_skipped = 0
        """Steps skipped so far because their gradients overflowed."""

    def scale_loss(self, loss: "torch.Tensor") -> "torch.Tensor":
        """The loss to backpropagate: multiplied by the scale under fp16, else unchanged."""
        return loss * self.scale if self.enabled else loss

    @property
    def at_minimum(self) -> bool:
        """Whether the scale cannot be halved any more: an overflow now is a non-finite gradient."""
        return self.enabled and self.scale <= self.min_scale

    def update(self, overflow: bool) -> None:
        """After a step: halve on overflow, double after `window` good steps."""
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            self.num_skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "num_skipped": self.num_skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.num_skipped = int(state["num_skipped"])
