"""Models and training loops plain PyTorch trains, through the engine API, round 8 (rounds 1-7:
test_model_zoo.py to test_model_zoo_7.py, whose settings and helpers this file shares): each trains
bitwise equal to plain PyTorch (fused AdamW, weight decay by torch_param_groups, clipping) in fp32 on
one rank, with every loss or output and buffer, or is refused with one line naming what and the fix.
Probed on host homes on the CPU and NVMe homes on the simulated accelerator, two micro-batches a step.

| probed                                                              | result                     |
|---------------------------------------------------------------------|----------------------------|
| non-reentrant checkpoint of a closure adding a root parameter       | fixed (hooks.Unresident-   |
| (`checkpoint(lambda x: tanh(x + self.pos), h, use_reentrant=False)` | Parameter)                 |
| at the root; with blocks inside it; under selective checkpointing)  |                            |
| a custom autograd.Function whose backward reads a block's weight it | fixed: was silently wrong  |
| did not save (`ctx.module.fc.weight`)                               |                            |
| a full backward hook and a tensor hook reading a root parameter     | fixed                      |
| a global forward pre-hook reading a block's weight (it runs before  | fixed (was NOT PLAIN in    |
| the engine's pre-hook)                                              | round 5: the placeholder)  |
| a pre-hook registered after initialize with prepend=True, reading   | held                       |
| its block's weight                                                  |                            |
| copy.deepcopy of a block's weight in another block's backward hook | fixed: the copy was of the |
|                                                                     | placeholder (silently)     |

The fix: backward reads parameters where no module's hook fires (a checkpointed closure recomputed,
a hook, a Function's backward), and by then backward's acquisitions may have moved on from their
group; a global forward pre-hook runs before the engine's pre-hook has acquired the module's group.
The recomputation at the root computed on the empty placeholder ("The size of tensor a (16) must match
the size of tensor b (0)"), the global pre-hook's term failed in backward ("TBackward0 returned an
invalid gradient ... expected shape compatible with [0]"), and a Function's backward reading a block's
weight before that block's backward took the norm of the placeholder, 0, and every parameter differed
from plain PyTorch's without a word. An engine's parameter now has a class of its own while unbound,
whose `__torch_function__` makes its group resident when read during a forward or a backward ([Note:
Reads of unbound parameters] in hooks.py); bound, it has none, so the model's ops on parameters cost
nothing more. The engine's warning that global forward pre-hooks see placeholders is gone with them.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any, Tuple

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import offload_trainer as ot
from offload_trainer.runtime.hooks import UnresidentParameter
from offload_trainer.runtime.model_changes import HeldParameter
from tests.offload_trainer.runtime.test_model_zoo import DIM, config, lm_loss, token_batches
from tests.offload_trainer.runtime.test_model_zoo_5 import some
from tests.offload_trainer.runtime.test_model_zoo_6 import Block, BlocksLM, train_and_compare

# -- fixed: a root parameter read by a recomputation in backward -------------------------------------


class CheckpointedRootClosureLM(BlocksLM):
    """A non-reentrant checkpoint of a closure at the root adding a root parameter: its recomputation
    runs when backward reaches it, after the blocks' backward acquisitions let the root's group go."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(6, DIM) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda x: torch.tanh(x + self.pos), self.emb(ids), use_reentrant=False)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class CheckpointedRootSegmentLM(CheckpointedRootClosureLM):
    """The same closure with two blocks inside the checkpointed segment."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        def segment(x: torch.Tensor) -> torch.Tensor:
            x = torch.tanh(x + self.pos)
            for layer in self.layers[:2]:
                x = layer(x)
            return x

        h = checkpoint(segment, self.emb(ids), use_reentrant=False)
        return self.head(self.layers[2](h))


def _recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveRootClosureLM(CheckpointedRootClosureLM):
    """Selective activation checkpointing of the root's closure (a TorchDispatchMode records its ops)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        context = functools.partial(create_selective_checkpoint_contexts, _recompute_all)
        h = checkpoint(lambda x: torch.tanh(x + self.pos), self.emb(ids), use_reentrant=False, context_fn=context)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.mark.parametrize("setting", some((0, 3)))
@pytest.mark.parametrize("build", [CheckpointedRootClosureLM, CheckpointedRootSegmentLM, SelectiveRootClosureLM])
def test_a_recomputation_reading_a_root_parameter(tmp_path: Path, build: type, setting: Tuple[str, int, str]) -> None:
    train_and_compare(build, tmp_path, setting)


# -- fixed: parameters read by a Function's backward and by backward hooks ---------------------------


class ScaleByWeight(torch.autograd.Function):
    """Identity forward; its backward scales the gradient by a norm of a weight it did not save."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        ctx.module = module
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad * (1.0 + ctx.module.fc.weight.detach().norm() * 0.01), None


class FunctionReadsLM(BlocksLM):
    """Each block's output through ScaleByWeight of that block: its backward runs before the block's,
    whose acquisition had not come yet (the norm of the placeholder is 0: silently other gradients)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = ScaleByWeight.apply(layer(h), layer)
        return self.head(h)


class HooksReadRootLM(BlocksLM):
    """A root parameter read by a full backward hook of the first block and by a tensor hook, both
    running after the blocks' backward acquisitions."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))
        self.layers[0].register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * self.scale.detach(),))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * self.scale
        h.register_hook(lambda g: g + self.scale.detach() * 0.01)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.mark.parametrize("setting", some((0, 3)))
@pytest.mark.parametrize("build", [FunctionReadsLM, HooksReadRootLM])
def test_backward_code_reading_a_parameter(tmp_path: Path, build: type, setting: Tuple[str, int, str]) -> None:
    train_and_compare(build, tmp_path, setting)


def scale_by_weight(module: nn.Module, args: Tuple[torch.Tensor, ...]) -> Any:
    """A forward pre-hook of the blocks scaling their input by their weight's norm."""
    if isinstance(module, Block):
        return (args[0] * (1 + 0.01 * module.fc.weight.norm()),)
    return None


class LatePrependLM(BlocksLM):
    """The blocks' pre-hook registered at the first forward (after initialize) with prepend=True: before
    the engine's own."""

    def __init__(self) -> None:
        super().__init__()
        self.hooked = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.hooked:
            self.hooked = True
            for layer in self.layers:
                layer.register_forward_pre_hook(scale_by_weight, prepend=True)
        return super().forward(ids)


@pytest.mark.parametrize("setting", some((0, 3)))
def test_a_global_forward_pre_hook_reading_a_blocks_weight(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    handle = nn.modules.module.register_module_forward_pre_hook(scale_by_weight)
    try:
        train_and_compare(BlocksLM, tmp_path, setting)
    finally:
        handle.remove()


@pytest.mark.slow
@pytest.mark.parametrize("setting", some(()))
def test_a_late_prepended_pre_hook_reading_its_blocks_weight(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    train_and_compare(LatePrependLM, tmp_path, setting)


class CopyInHookLM(BlocksLM):
    """A backward hook of the first block scaling by the norm of a copy of the last block's weight:
    nn.Parameter.__deepcopy__ reads `.data` with __torch_function__ off, so the copy was of the empty
    placeholder (a norm of 0), and a read of the copy, of the engine's class, then failed (KeyError)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[0].register_full_backward_hook(self.scale)

    def scale(self, module: nn.Module, grad_in: Tuple[torch.Tensor, ...], grad_out: Any) -> Tuple[torch.Tensor]:
        weight = copy.deepcopy(self.layers[2].fc.weight)
        assert type(weight) is nn.Parameter
        return (grad_in[0] * (1 + weight.detach().norm() * 0.01),)


@pytest.mark.parametrize("setting", some((0,)))
def test_a_copy_of_a_weight_made_in_backward(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    train_and_compare(CopyInHookLM, tmp_path, setting)


def test_a_parameters_class_follows_its_binding(tmp_path: Path) -> None:
    """Unbound: the engine's UnresidentParameter; bound (in its module's forward): HeldParameter, whose ops
    cost nothing more; closed: nn.Parameter. A read between a forward and its backward fetches nothing."""
    model = CheckpointedRootClosureLM()
    classes = []
    model.layers[1].register_forward_pre_hook(lambda m, args: classes.append(type(m.fc.weight)))
    ids = token_batches(1)[0]
    with ot.initialize(model, config(tmp_path, "host", 1)) as engine:
        weight = model.layers[1].fc.weight
        assert isinstance(weight, UnresidentParameter) and weight.shape == (0,)
        assert weight.norm().item() == 0.0 and isinstance(weight, UnresidentParameter)  # between steps: as before
        engine.backward(lm_loss(engine(ids), ids))
        engine.step()  # every device copy dropped
        assert classes == [HeldParameter] and isinstance(weight, UnresidentParameter)
    assert type(weight) is nn.Parameter and all(type(p) is nn.Parameter for p in model.parameters())
