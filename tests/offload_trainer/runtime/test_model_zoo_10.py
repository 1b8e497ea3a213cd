"""Models and training loops plain PyTorch trains, through the engine API, round 10 (rounds 1-8:
test_model_zoo.py to test_model_zoo_8.py, whose settings and helpers this file shares): each trains
bitwise equal to plain PyTorch in fp32 on one rank, or is refused with one line naming what and the fix.

| probed                                                              | result                      |
|---------------------------------------------------------------------|-----------------------------|
| a parameter of the user's own nn.Parameter subclass (quantization,  | fixed: its reads were not   |
| adapter libraries) read by a checkpointed closure at the root and   | fetched ("size of tensor b  |
| by a custom Function's backward                                     | (0)")                       |
| torch.save / copy.deepcopy of a parameter (or a list of them)       | fixed: refused by name (it  |
| between steps                                                       | wrote the empty placeholder)|
| torch.save of another block's weight inside a backward hook         | values held (fetched first);|
|                                                                     | fixed: it wrote the group's |
|                                                                     | whole device copy           |
| torch.save / copy.deepcopy of a module the engine holds             | held (refused, model_claims)|

The fix: a parameter's class while its engine holds it is model_changes.held_class of its own class (for
nn.Parameter HeldParameter, for a subclass of the user's one derived from both, made once), and while
unbound the engine's UnresidentParameter derived from that ([Note: Reads of unbound parameters] in
hooks.py); before, only parameters of class nn.Parameter itself were swapped, so a subclass's read in
backward computed on the placeholder. UnresidentParameter's `__reduce_ex__` and `__deepcopy__` make the
group resident first and refuse where nothing can (between steps), where they copied 0 elements.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any, Tuple

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload_trainer as ot
from offload_trainer.runtime.hooks import UnresidentParameter
from offload_trainer.runtime.model_changes import HeldParameter
from tests.offload_trainer.runtime.test_model_zoo import DIM, config, lm_loss, token_batches
from tests.offload_trainer.runtime.test_model_zoo_5 import some
from tests.offload_trainer.runtime.test_model_zoo_6 import BlocksLM, train_and_compare
from tests.offload_trainer.runtime.test_model_zoo_8 import ScaleByWeight

# -- fixed: parameters of the user's own nn.Parameter subclass -----------------------------------------


class AdapterParam(nn.Parameter):
    """A user's parameter class, as quantization and adapter libraries have (its own method and repr)."""

    def doubled(self) -> torch.Tensor:
        return self * 2

    def __repr__(self) -> str:
        return "AdapterParam()"


class SubclassReadsLM(BlocksLM):
    """A root AdapterParam read by a non-reentrant checkpoint of a closure (recomputed after the blocks'
    backward acquisitions let the root's group go), and the blocks' weights AdapterParams read by a
    Function's backward before their block's backward acquisition."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = AdapterParam(torch.randn(6, DIM) * 0.1)
        for layer in self.layers:
            layer.fc.weight = AdapterParam(layer.fc.weight.detach().clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda x: torch.tanh(x + self.pos.doubled()), self.emb(ids), use_reentrant=False)
        for layer in self.layers:
            h = ScaleByWeight.apply(layer(h), layer)
        return self.head(h)


@pytest.mark.parametrize("setting", some((0,)))
def test_reads_of_a_users_parameter_subclass(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    train_and_compare(SubclassReadsLM, tmp_path, setting)


def test_a_users_parameter_subclass_keeps_its_class(tmp_path: Path) -> None:
    """Bound, unbound and after close an AdapterParam (held and unresident classes derived from it), its
    methods its own; a copy made in backward is an AdapterParam with the values, as plain PyTorch's."""
    model = SubclassReadsLM()
    pos, weight = model.pos, model.layers[1].fc.weight
    bound_classes, copies = [], []
    model.layers[1].register_forward_pre_hook(lambda m, args: bound_classes.append(type(m.fc.weight)))
    model.layers[0].register_full_backward_hook(lambda m, gi, go: copies.append(copy.deepcopy(model.pos)))
    ids = token_batches(1)[0]
    with ot.initialize(model, config(tmp_path, "host", 1)) as engine:
        assert isinstance(weight, AdapterParam) and isinstance(weight, UnresidentParameter) and repr(weight) == "AdapterParam()"
        engine.backward(lm_loss(engine(ids), ids))
        values = engine.full_state_dict()["pos"]  # before the step: what the copy in backward read
        engine.step()
        assert all(issubclass(c, AdapterParam) and issubclass(c, HeldParameter) for c in bound_classes)
        assert type(copies[0]) is AdapterParam and torch.equal(copies[0].detach(), values)
    assert type(weight) is AdapterParam and type(pos) is AdapterParam


# -- fixed: pickling and copying a parameter between steps ----------------------------------------------


def test_saving_or_copying_a_parameter_between_steps_is_refused(tmp_path: Path) -> None:
    model = BlocksLM()
    ids = token_batches(1)[0]
    with ot.initialize(model, config(tmp_path, "host", 1)) as engine:
        engine.backward(lm_loss(engine(ids), ids))
        engine.step()
        weight = model.layers[0].fc.weight
        for save in (lambda: torch.save(weight, io.BytesIO()), lambda: torch.save(list(model.parameters()), io.BytesIO())):
            with pytest.raises(TypeError, match=r"pickling \(torch.save\) of parameter '(layers.0.fc.weight|emb.weight)'.*full_state_dict"):
                save()
        with pytest.raises(TypeError, match=r"copy.deepcopy of parameter 'layers.0.fc.weight'"):
            copy.deepcopy(weight)
        engine.backward(lm_loss(engine(ids), ids))  # the engine trains on
        engine.step()


class SaveInHookLM(BlocksLM):
    """A backward hook of the first block scaling by the norm of the last block's weight as torch.save
    wrote it (its group is not resident there: the save fetches it first)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[0].register_full_backward_hook(self.scale)

    def scale(self, module: nn.Module, grad_in: Tuple[torch.Tensor, ...], grad_out: Any) -> Tuple[torch.Tensor]:
        buffer = io.BytesIO()
        torch.save(self.layers[2].fc.weight, buffer)
        buffer.seek(0)
        weight = torch.load(buffer)
        return (grad_in[0] * (1 + weight.detach().norm() * 0.01),)


@pytest.mark.parametrize("setting", some((0,)))
def test_a_weight_saved_in_backward(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    train_and_compare(SaveInHookLM, tmp_path, setting)


class SaveSizeLM(BlocksLM):
    """A backward hook of the first block saving the last block's weight (fetched there: a view of its
    group's device copy), noting how many bytes torch.save wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.saved_bytes: list = []
        self.layers[0].register_full_backward_hook(self.save)

    def save(self, module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        buffer = io.BytesIO()
        torch.save(self.layers[2].fc.weight, buffer)
        self.saved_bytes.append(len(buffer.getvalue()))


def test_a_weight_saved_in_backward_is_saved_alone(tmp_path: Path) -> None:
    """torch.save of a view saves its whole storage: a bound parameter pickles its values alone, as plain
    PyTorch's does, not every parameter of its group's device copy."""
    ids = token_batches(1)[0]
    plain = SaveSizeLM()
    lm_loss(plain(ids), ids).backward()
    model = SaveSizeLM()
    with ot.initialize(model, config(tmp_path, "host", 1)) as engine:
        engine.backward(lm_loss(engine(ids), ids))
        engine.step()
    assert model.saved_bytes == plain.saved_bytes
