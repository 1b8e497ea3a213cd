"""Models and training loops plain PyTorch trains, through the engine API, round 6 (rounds 1-5:
test_model_zoo.py to test_model_zoo_5.py, whose settings and helpers this file shares): each trains
bitwise equal to plain PyTorch (fused AdamW, weight decay by torch_param_groups, clipping) in fp32 on
one rank, with every loss or output and buffer, or is refused with one line naming what and the fix.
Probed on host homes on the CPU and NVMe homes on the simulated accelerator, two micro-batches a step.

| probed                                                              | result                     |
|---------------------------------------------------------------------|----------------------------|
| a block class overriding __call__ with `return self.forward(x)`     | fixed (direct_reads)       |
| a .detach() of a weight kept as an attribute or a buffer            | fixed: refused by name     |
| (model_claims.refuse_aliases)                                       |                            |
| torch.nn.utils.spectral_norm's `weight` (weight_orig.data until its | held (not an alias)        |
| pre-hook runs); parameters that are disjoint views of one tensor    |                            |
| a library's activation instance shared by every model it builds     | fixed (model_claims)       |
| (HF XLM, OpenAI GPT): a second model after the first one's engine   |                            |
| a weight read by a plain object kept as an attribute (a helper that | fixed (direct_reads)       |
| is not a module, keeping the embedding)                             |                            |
| a wrapper's __getattr__ answering for the module it wraps (PEFT's)  | fixed (direct_reads)       |
| in-place ops on block outputs and on a block's input, a block       | held (HELD, slow)          |
| returning one tensor twice, weights by a run-time name,             |                            |
| get_submodule, _modules, ModuleDict.items(), reentrant checkpoint   |                            |
| of a closure adding a root parameter, a head used at some steps     |                            |
| a partial of F.linear over the embedding's weight, a nested         | held (probed, not kept)    |
| function, generator and list comprehensions over the blocks'        |                            |
| weights, functools.reduce over the blocks, torch.vmap of a lambda,  |                            |
| a walrus, a root overriding __call__, slices and reversed() of the  |                            |
| ModuleList, a Sequential subclass indexing itself, a penalty over   |                            |
| one block's parameters() inside forward; minLoRA's form (a          |                            |
| parametrization holding trainable low-rank factors, the original    |                            |
| frozen or not, and under parametrize.cached())                      |                            |
| HF EncoderDecoder (BERT to BERT, tie_encoder_decoder), FSMT,        | held (probed, not kept)    |
| NLLB-MoE, LongT5 (transient-global), UMT5, Blenderbot, M2M100,      |                            |
| PLBart, X-MOD, RoCBert                                              |                            |
| HF Reformer                                                         | not comparable: plain      |
|                                                                     | PyTorch's seeds its LSH    |
|                                                                     | from torch.seed() (two     |
|                                                                     | plain runs differ)         |
| an item of a ModuleList handed to a function reading its weight     | fixed (direct_reads)       |
| (`project(self.layers[-1], h)`, `project(layer, h)` in a loop)      |                            |
| non-reentrant checkpoint of a closure adding a root parameter       | NOT PLAIN then: its        |
| (`checkpoint(lambda x: tanh(x + self.pos), h)` at the root, with or | recomputation in backward  |
| without blocks inside it; the same inside a block trains bitwise)   | read the placeholder ("size|
|                                                                     | of tensor b (0)"); fixed in|
|                                                                     | round 8 (test_model_zoo_8) |

The fixes:
- a module whose class overrides `__call__` without reaching nn.Module's runs no hooks when called, so
  a block of that class computed on the empty placeholders ("Expected weight to be of same shape as
  normalized_shape, but got weight of shape [0]"): its call is a read of its parameters by the
  caller now, as `.forward(...)` already was; an override that calls `super().__call__` is a call;
- a tensor sharing a parameter's memory (a `.detach()` kept as an attribute or registered as a
  buffer, or a second Parameter of the same memory) follows every update in plain PyTorch, but the
  engine moves the parameter into its homes, and the alias kept the initial values: every parameter
  differed from the first step, silently. Refused at initialize, naming both; an attribute a forward
  pre-hook sets before each forward and names (`hook.name`: spectral_norm's `weight`) is no alias;
- HF's XLM and OpenAI GPT hold the library's module-level `gelu` instance, the same object in every
  such model a process builds: once one engine had taken one model, a second model was refused ("its
  module 'm.transformer.ffns.0.act' was given to an engine that is closed"), and copy.deepcopy of it
  raised. A module without parameters gave the engine nothing: it is neither refused nor kept from
  copies now;
- a plain object kept as an attribute that keeps a module (`self.tied = Helper(self.emb)`, whose
  `__call__` reads `self.emb.weight`), and a name only the class's own `__getattr__` finds (a wrapper
  delegating to the module it wraps) hid the read, and the code computed on placeholders ("size
  mismatch, got input (12), mat (12x16), vec (0)"; "mat2 must be a matrix, got 1-D tensor"): both
  are reads now, of what the object keeps and of the whole module;
- an item of a ModuleList handed first to a function that reads its weights (`project(self.layers[-1],
  h)`, `project(layer, h)` in a loop) was taken for a call, as the item itself is, and the function
  computed on the placeholder ("size mismatch, got input (12), mat (12x16), vec (0)"); a child handed
  so was already read whole. The function's chains on its first parameter are resolved on the item
  now; code that cannot be read or hands the item on (torch's checkpoint, which calls it) stays a
  call, so a loop of checkpointed blocks keeps every block in its own group.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offload_trainer as ot
from tests.offload_trainer.runtime.test_model_zoo import DIM, SETTINGS, VOCAB, config, token_batches
from tests.offload_trainer.runtime.test_model_zoo import train_and_compare as zoo_train_and_compare
from tests.offload_trainer.runtime.test_model_zoo_5 import some


def train_and_compare(build, tmp_path: Path, setting: Tuple[str, int, str]) -> None:  # type: ignore[no-untyped-def]
    zoo_train_and_compare(build, tmp_path, setting, accum=2, batches=token_batches(4), outputs_and_buffers=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h)))


class BlocksLM(nn.Module):
    def __init__(self, block: type = Block) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([block() for _ in range(3)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


# -- fixed: a block whose __call__ runs no hooks ---------------------------------------------------


class ForwardCall(Block):
    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.forward(h)


class TypedCall(Block):
    """The common override for type hints: nn.Module's __call__ runs, hooks and all."""

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().__call__(h)


class MixedCallsLM(BlocksLM):
    def __init__(self) -> None:
        super().__init__(ForwardCall)
        self.layers.append(TypedCall())


@pytest.mark.parametrize("setting", some((0,)))
def test_a_block_whose_call_override_runs_no_hooks(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    train_and_compare(MixedCallsLM, tmp_path, setting)


def test_a_call_override_reaching_module_call_is_a_call() -> None:
    from offload_trainer.runtime.layout.direct_reads import called_modules, direct_reads

    model = MixedCallsLM()
    reads = direct_reads(model)[id(model)]
    assert {id(p) for p in reads} == {id(p) for layer in model.layers[:3] for p in layer.parameters()}
    assert model.layers[3] in [callee for _, callee in called_modules(model)]


# -- fixed: a tensor sharing a parameter's memory ----------------------------------------------------


class AttributeAlias(BlocksLM):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = self.emb.weight.detach()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) + (self.frozen[ids] @ self.emb.weight.t()).detach() * 0.1


class BufferAlias(BlocksLM):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w_alias", self.head.weight.detach()[:, :8], persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) + F.linear(self.emb(ids)[..., :8], self.w_alias)


class ParameterAlias(BlocksLM):
    def __init__(self) -> None:
        super().__init__()
        self.layers[2].fc.bias = nn.Parameter(self.layers[1].fc.bias.data)


class DisjointViews(BlocksLM):
    """Parameters that are disjoint views of one buffer (as cuDNN flattens an LSTM's): no alias."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.randn(2 * DIM)
        self.layers[0].norm.weight = nn.Parameter(flat[:DIM])
        self.layers[0].norm.bias = nn.Parameter(flat[DIM:])
        self.spare = [self.head.weight]  # the parameter itself, kept in a plain list: no alias either


@pytest.mark.parametrize(
    "build, what",
    [
        (AttributeAlias, r"attribute 'frozen' shares memory with parameter 'emb.weight'"),
        (BufferAlias, r"buffer 'w_alias' shares memory with parameter 'head.weight'"),
        (ParameterAlias, r"parameter 'layers.2.fc.bias' shares memory with parameter 'layers.1.fc.bias'"),
    ],
)
def test_a_tensor_sharing_a_parameters_memory_is_refused(tmp_path: Path, build: type, what: str) -> None:
    """Plain PyTorch's alias follows each in-place update of the parameter; the engine's kept the initial
    values, and every parameter differed from the first step, silently."""
    model = build()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=what + r".*instead of keeping a second tensor of it"):
        ot.initialize(model, config(tmp_path, "host", 1))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing taken


def test_disjoint_views_of_one_buffer_train(tmp_path: Path) -> None:
    train_and_compare(DisjointViews, tmp_path, SETTINGS[0])


class HookSetWeights(BlocksLM):
    """torch.nn.utils.spectral_norm keeps `weight` as a plain attribute, `weight_orig.data`, until its
    forward pre-hook first sets it from weight_orig: no alias, as that hook sets it before every use."""

    def __init__(self) -> None:
        super().__init__()
        nn.utils.spectral_norm(self.layers[0].fc)
        nn.utils.spectral_norm(self.head)


@pytest.mark.filterwarnings("ignore:.*torch.nn.utils.spectral_norm is deprecated")
def test_an_attribute_a_pre_hook_sets_is_no_alias(tmp_path: Path) -> None:
    train_and_compare(HookSetWeights, tmp_path, SETTINGS[0])


# -- fixed: a module without parameters shared by two models -------------------------------------------

SHARED_ACT = nn.GELU()  # as transformers' `gelu = get_activation("gelu")`, which XLM and OpenAI GPT hold


class SharedActBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.act = SHARED_ACT

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.act(self.fc(self.norm(h)))


def shared_act_lm() -> nn.Module:
    return BlocksLM(SharedActBlock)


def test_a_module_without_parameters_in_two_models(tmp_path: Path) -> None:
    """The second model trains bitwise (its engine opened while the first's is open, then after it
    closed), and is copied whole; the first stays refused to a second engine and to copies."""
    first = shared_act_lm()
    with ot.initialize(first, config(tmp_path / "a", "host", 1)):
        train_and_compare(shared_act_lm, tmp_path / "b", SETTINGS[0])
        with pytest.raises(TypeError, match="copy.deepcopy of this BlocksLM"):
            copy.deepcopy(first)
    train_and_compare(shared_act_lm, tmp_path / "c", SETTINGS[0])
    second = shared_act_lm()
    assert torch.equal(copy.deepcopy(second).head.weight, second.head.weight)
    with pytest.raises(ValueError, match="given to an engine that is closed"):
        ot.initialize(first, config(tmp_path / "d", "host", 1))


# -- fixed: weights reached through a plain object, or through a class's own __getattr__ ---------------


class Helper:
    """Not a module: a plain object keeping one, whose code reads its weight."""

    def __init__(self, emb: nn.Embedding) -> None:
        self.emb = emb

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.emb.weight) * 0.5


class HelperLM(BlocksLM):
    def __init__(self) -> None:
        super().__init__()
        self.tied = Helper(self.emb)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h) + self.tied(h)


class Delegating(nn.Module):
    """A wrapper answering for the module it wraps (as PEFT's do): `self.weight` is the inner one's."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight, self.bias)


class DelegatingLM(BlocksLM):
    def __init__(self) -> None:
        super().__init__()
        self.head = Delegating(nn.Linear(DIM, VOCAB))


@pytest.mark.parametrize("build", [HelperLM, DelegatingLM])
@pytest.mark.parametrize("setting", some((0,)))
def test_weights_read_through_a_plain_object_or_a_getattr(tmp_path: Path, build: type, setting: Tuple[str, int, str]) -> None:
    train_and_compare(build, tmp_path, setting)


# -- fixed: an item of a ModuleList handed to a function that reads its weights ----------------------


def project(block: Block, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, block.fc.weight)


class HandedItemsLM(BlocksLM):
    """The last block and every block in a loop handed to a function reading their weights; the
    blocks in a loop handed to torch's checkpoint too, which calls them (their own hooks fetch them)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
        extra = project(self.layers[-1], h)
        for layer in self.layers:
            extra = extra + project(layer, h) * 0.1
        return self.head(h + extra)


@pytest.mark.parametrize("setting", some((0,)))
def test_items_handed_to_a_function_reading_their_weights(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    train_and_compare(HandedItemsLM, tmp_path, setting)


def test_items_handed_to_checkpoint_stay_calls() -> None:
    """checkpoint(layer, h) calls the block, whose hooks fetch it: reading it there would put every
    block's weights in the root's group."""
    from offload_trainer.runtime.layout.direct_reads import direct_reads

    model = HandedItemsLM()
    assert {id(p) for p in direct_reads(model)[id(model)]} == {id(layer.fc.weight) for layer in model.layers}


# -- held: probed in this round, kept here so they stay so ---------------------------------------------


class InPlaceOnOutputsLM(BlocksLM):
    """A block's output changed in place by the caller (mul_, an in-place ReLU of a slice of it)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
            h.mul_(0.9)
            F.relu(h[..., :4], inplace=True)
        return self.head(h)


class TwiceBlock(Block):
    def forward(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        out = super().forward(h)
        return out, out.transpose(0, 1)  # the same tensor twice: itself and a view of it


class TwiceLM(BlocksLM):
    def __init__(self) -> None:
        super().__init__(TwiceBlock)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            a, b = layer(h)
            a.add_(1.0)
            h = a + b.transpose(0, 1)
        return self.head(h)


class InputInPlaceBlock(Block):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h.mul_(1.5)  # its input, the previous block's output, changed in place
        return super().forward(h)


class InputInPlaceLM(BlocksLM):
    def __init__(self) -> None:
        super().__init__(InputInPlaceBlock)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * 1.0
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class ByNameLM(BlocksLM):
    """Weights reached by a name built at run time, get_submodule and _modules, a ModuleDict's items()."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"a": nn.Linear(DIM, VOCAB), "b": nn.Linear(DIM, VOCAB)})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        out = F.linear(h, getattr(self, "he" + "ad").weight) + h @ self._modules["emb"].weight.t()
        out = out + (h @ self.get_submodule("layers.1.fc").weight).sum(-1, keepdim=True)
        for _, head in self.heads.items():
            out = out + F.linear(h, head.weight, head.bias)
        return out


class CheckpointedRootReadLM(BlocksLM):
    """Reentrant checkpoint of a closure adding a root parameter, then two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(6, DIM) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        def segment(x: torch.Tensor) -> torch.Tensor:
            x = x + self.pos
            for layer in self.layers[:2]:
                x = layer(x)
            return x

        h = torch.utils.checkpoint.checkpoint(segment, self.emb(ids), use_reentrant=True)
        return self.head(self.layers[2](h))


class SometimesLM(BlocksLM):
    """A head used at some micro-batches only: AdamW counts its steps from its first gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(DIM, VOCAB)
        self.calls = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = super().forward(ids)
        return out + self.extra(self.emb(ids)) if self.calls % 5 in (3, 4) else out


HELD = {
    "in-place on outputs": InPlaceOnOutputsLM,
    "an output twice": TwiceLM,
    "an input changed in place": InputInPlaceLM,
    "weights by name": ByNameLM,
    "reentrant checkpoint reading a root parameter": CheckpointedRootReadLM,
    "a head used at some steps": SometimesLM,
}


@pytest.mark.slow
@pytest.mark.parametrize("setting", some(()))
@pytest.mark.parametrize("case", list(HELD))
def test_held_models_train_bitwise(tmp_path: Path, case: str, setting: Tuple[str, int, str]) -> None:
    zoo_train_and_compare(HELD[case], tmp_path, setting, batches=token_batches(8), outputs_and_buffers=True)
