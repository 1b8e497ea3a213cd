"""The errors a user of the engine meets: each message says what is wrong, with the numbers, and the fix.

Configuration mistakes are ValueError or TypeError (see offload_trainer.config); these are the
eight the engine adds. IO failures are io_engine.TransferError (path, offset, size).
"""

from __future__ import annotations


class PlanError(ValueError):
    """The model does not fit the budgets as configured; the message gives the numbers."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupted, or of another model."""


class NonFiniteError(ValueError):
    """The training state holds inf or nan: nothing is saved or exported from it."""


class PartialStateError(RuntimeError):
    """The engine's state is part one state and part another: an update pass, a `load_checkpoint` or a
    `load_safetensors` failed part-way. Nothing trains, saves or exports from it until a load completes."""


class UnresidentReadError(RuntimeError):
    """A parameter was read where the engine had not made it resident, where it is an empty
    placeholder: outside the forward of every module that uses it (backward then refused its
    gradient), or by `state_dict()` of a module whose parameters the engine holds."""


class BackwardOutsideEngineError(RuntimeError):
    """`loss.backward()` (or `torch.autograd.backward`) reached a parameter the engine holds
    outside `engine.backward(loss)`, which alone scales the loss, hands the gradients to their
    homes and counts the micro-batch: call that instead."""


class GradientReadError(RuntimeError):
    """`.grad` of a parameter the engine holds was read between `engine.backward()` and `engine.step()`,
    where the gradient is in the engine's homes and `.grad` is None (`clip_grad_norm_` would return 0):
    clip with `optimizer.grad_clip_norm`, read `engine.stats().grad_norm` after the step."""


class RanksOutOfStepError(RuntimeError):
    """Another rank (or this one) left an engine call on an error its peers did not all meet at the same
    point, so the ranks' collectives no longer pair: every rank's engine refuses each call that
    communicates from then on. End the run on every rank and resume from the last checkpoint."""
