"""Models and training loops plain PyTorch trains, through the engine API, round 4 (rounds 1-3:
test_model_zoo.py, test_model_zoo_2.py, test_model_zoo_3.py, whose settings and helpers this file
shares): each trains bitwise equal to plain PyTorch (fused AdamW, weight decay by torch_param_groups,
clipping) in fp32 on one rank, with every loss or output and buffer, or is refused with one line
naming the module and the fix.

Found wrong, fixed:
- a module reached through a plain Python list attribute (`self.ref = [self.emb]`, `self.norms =
  [self.layers[3].norm]`: a list hides its modules from nn.Module's setattr, so they are registered
  only where they are also attributes) was not seen by direct_reads: a weight read through it
  (`self.ref[0].weight`) or a module inside a block called through it computed on the empty
  placeholder ("size mismatch, got input (12), mat (12x16), vec (0)"; "Expected weight to be of same
  shape as normalized_shape, but got weight of shape [0]"). Plain lists, tuples and dicts of modules
  (and a module kept in the instance's attributes unregistered) are resolved as ModuleLists are now;
- a parametrization with a right_inverse (torch.nn.utils.parametrizations.weight_norm, spectral_norm,
  register_parametrization of one's own) added to a held parameter after initialize failed inside
  torch on the empty placeholder ("cannot reshape tensor of 0 elements into shape [0, -1]"), before
  the registration the engine refuses: refused by name as torch begins to build it now
  (model_changes._refuse_parametrization), and training goes on as plain PyTorch's without it.
  orthogonal() still fails inside torch first, with its own "Expected a matrix or batch of matrices.
  Got a tensor of 1 dimensions" (it checks the placeholder's shape before it builds anything);
- a depthwise Conv2d weight (C, 1, kH, kW) made channels_last is_contiguous() (torch ignores the
  strides of dimensions of size 1) but its strides (9, 1, 3, 1) make PyTorch run channels_last
  convolutions: the engine laid it out row-major, and every output and parameter differed in its last
  bits from the first forward. Only row-major strides count as row-major now ([Note: Parameter
  memory order] in layout/partition.py);
- selective activation checkpointing (torch.utils.checkpoint with context_fn=
  create_selective_checkpoint_contexts) failed in backward: "aten.slice.Tensor encountered during
  backward but not found in storage". Its TorchDispatchMode records every op of a block's forward
  and expects the same ops when backward recomputes it, and it saw the engine's own work in the
  block's pre-hook, which differs there (the groups are resident and pinned). The engine's hooks
  work outside the user's TorchDispatchModes now ([Note: The engine's own tensor work] in
  hooks.py), as they already did outside torch.func transforms; a step under FlopCounterMode counts
  what plain PyTorch's does;
- a model of many small modules of one size (a recursive tree of 15 Linears: 15 groups of one
  staging class) with NVMe gradient homes, gradient accumulation and the simulated accelerator's
  late copies failed at the second micro-batch: "no host staging buffer is free and none can be
  freed". Every buffer of the class was held by a staged group, and flushing one (which reads the
  home back to add to it) needed another, whose flush needed another. A new staged entry now leaves
  one buffer of its class for a flush's read ([Note: A merge's second buffer] in gradients.py).

Held (they trained right when probed, with accumulation over two micro-batches and clipping, host and
NVMe homes, on the CPU and the simulated accelerator; those kept here in HELD and the slow HF test):
Hugging Face GPT-J, Phi, StableLM, Qwen2-MoE and Qwen3-MoE (experts idle in a step), Mistral with a
sliding window, Llama (tied, left-padded attention mask; sequence classification), HF gradient
checkpointing with use_reentrant True and False, GPT-2 and Qwen2 tied and resize_token_embeddings'd
before initialize, GPTBigCode (multi-query), CodeGen, OLMo2, Cohere, Starcoder2, GPT-Neo (local
attention), MPT (alibi), ALBERT (one layer shared by all), DeBERTa-v2, ELECTRA, DistilBERT, Pegasus,
mT5, Switch Transformers, Marian, ViT, ConvNeXt, ResNet, Swin, wav2vec2 (its weight_norm'd positional
convolution; SpecAugment's masks with numpy seeded alike), Whisper, CLIP, RWKV, Jamba, ModernBERT, DBRX,
DeepSeek-V3; torch: TransformerEncoder norm_first (with and without biases) and post-norm on the eval
fast path with a padding mask (nested tensors), kwargs-only forwards, frozen parameters inside trained
groups and whole frozen layers, torch.nn.utils.prune before initialize, MultiheadAttention with
add_bias_kv and add_zero_attn (batch first and not), AdaptiveLogSoftmaxWithLoss (log_prob, and its
loss as the output), ParameterList/ParameterDict in blocks and on the root, a module passed as an
argument to a block, grouped/transposed/3-d convolutions with BatchNorm (momentum None) channels_last,
buffers updated in forward, a weight's view read by another module, an auxiliary loss over a root
parameter, training in eval mode, LayerDrop, a block under no_grad, save_on_cpu inside and around the
forward, SDPA with enable_gqa, a namedtuple output with None, a module reached by tuple assignment.

Refused up front, plainly: a model of mixed dtypes (an fp64 head in an fp32 model: "pass an fp32
model"). Not plain, left then: a user pre-hook registered after initialize with prepend=True runs before
the engine's acquisition and reads the placeholder; backward then fails with torch's "TBackward0
returned an invalid gradient at index 0 - got [32, 16] but expected shape compatible with [0]". Such a
read makes the group resident since round 8 (test_model_zoo_8.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
from torch import nn
from torch.nn.utils import prune
from torch.nn.utils.parametrizations import spectral_norm, weight_norm
from torch.nn.utils.parametrize import register_parametrization
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from tests.offload_trainer.runtime.test_model_zoo import DIM, SETTINGS, VOCAB, ZooLM, lm_loss, token_batches
from tests.offload_trainer.runtime.test_model_zoo import train_and_compare as zoo_train_and_compare
from tests.offload_trainer.runtime.test_model_zoo_2 import (
    IDS, Backward, Step, evaluation_between, plain_step, train_and_compare,
)
from tests.offload_trainer.runtime.test_model_zoo_3 import HFLogits, train_with_a_change


# -- fixed: modules reached through plain Python containers ------------------------------------------


class PlainListLM(ZooLM):
    """The embedding's weight read through a plain list (a tied head), the last block's norm called
    through a plain dict as a final norm, and block 1 called through a tuple attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.tied = [self.emb]
        self.final = {"norm": self.layers[3].norm}
        self.middle = (self.layers[1],)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](self.emb(ids))
        for layer in self.middle:
            h = layer(h)
        h = self.run(2, 4, h)
        return self.head(self.final["norm"](h)) + h @ self.tied[0].weight.t()


@pytest.mark.parametrize(
    "setting", [pytest.param(SETTINGS[0], id=IDS[0]), pytest.param(SETTINGS[3], marks=pytest.mark.slow, id=IDS[3])]
)
def test_modules_reached_through_plain_containers(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    train_and_compare(PlainListLM, tmp_path, setting)


# -- fixed: a parametrization with right_inverse added after initialize ------------------------------


class Shifted(nn.Module):
    """A parametrization with a right_inverse (as weight_norm's and spectral_norm's)."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + 1

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.reshape(weight.shape[0], -1) - 1


PARAMETRIZATIONS = {
    "weight_norm": lambda m: weight_norm(m.head),
    "spectral_norm": lambda m: spectral_norm(m.layers[2].fc1),
    "right_inverse": lambda m: register_parametrization(m.layers[0].fc2, "weight", Shifted()),
}


@pytest.mark.parametrize(
    "how", [pytest.param(h, marks=() if h == "weight_norm" else pytest.mark.slow) for h in sorted(PARAMETRIZATIONS)]
)
def test_a_parametrization_with_right_inverse_added_after_initialize_is_refused(tmp_path: Path, how: str) -> None:
    """torch calls the right_inverse on the parameter before registering it, and on the empty
    placeholder that failed inside torch ("cannot reshape tensor of 0 elements into shape [0, -1]")."""
    names = [n for n, _ in ZooLM().named_parameters()]

    def unchanged(model: nn.Module) -> None:
        assert [n for n, _ in model.named_parameters()] == names

    refusal = r"a parametrization added to parameter '.*weight' after offload_trainer.initialize"
    train_with_a_change(tmp_path, PARAMETRIZATIONS[how], refusal, unchanged=unchanged)


# -- fixed: strides of dimensions of size 1 ----------------------------------------------------------


class DepthwiseCNN(nn.Module):
    """MobileNet's depthwise-separable convolutions, made channels_last: the depthwise weight (C, 1, 3, 3)
    is_contiguous() as well, yet its strides (9, 1, 3, 1) make PyTorch run channels_last convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8 * 4 * 4)
        self.depthwise = nn.ModuleList([nn.Conv2d(8, 8, 3, padding=1, groups=8) for _ in range(2)])
        self.pointwise = nn.ModuleList([nn.Conv2d(8, 8, 1) for _ in range(2)])
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 4 * 4, VOCAB)
        self.to(memory_format=torch.channels_last)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.emb(ids).view(b * t, 8, 4, 4)
        for depthwise, pointwise in zip(self.depthwise, self.pointwise):
            h = h + pointwise(torch.relu(depthwise(h)))
        return self.head(self.norm(h).flatten(1)).view(b, t, -1)


@pytest.mark.parametrize(
    "setting", [pytest.param(SETTINGS[0], id=IDS[0]), pytest.param(SETTINGS[3], marks=pytest.mark.slow, id=IDS[3])]
)
def test_a_depthwise_convolution_made_channels_last(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    """The depthwise weights were laid out row-major, being is_contiguous(): the engine's convolutions ran
    row-major where plain PyTorch's ran channels_last, and every output and parameter differed in its last
    bits from the first evaluation on."""
    assert DepthwiseCNN().depthwise[0].weight.is_contiguous()
    train_and_compare(DepthwiseCNN, tmp_path, setting, evaluation_between)


# -- fixed: the engine's hooks under the user's TorchDispatchModes -----------------------------------


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveCheckpointLM(ZooLM):
    """Each block under selective activation checkpointing: matmul outputs saved, the rest recomputed."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            h = checkpoint(layer, h, use_reentrant=False, context_fn=context)
        return self.head(h)


def counting_flops(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> torch.Tensor:
    """A step under FlopCounterMode: the count, which sees the engine's work no more than the loss does."""
    with FlopCounterMode(display=False) as counter:
        backward(lm_loss(run(ids), ids))
    return torch.tensor(counter.get_total_flops())


@pytest.mark.parametrize(
    "setting", [pytest.param(SETTINGS[0], id=IDS[0]), pytest.param(SETTINGS[3], marks=pytest.mark.slow, id=IDS[3])]
)
def test_selective_activation_checkpointing(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    """It failed in backward: "aten.slice.Tensor encountered during backward but not found in storage"
    (the checkpoint's TorchDispatchMode had recorded the engine's own ops in the block's pre-hook, which
    the recomputation's pre-hook did not make again)."""
    batches = token_batches(2)
    zoo_train_and_compare(SelectiveCheckpointLM, tmp_path, setting, accum=2, batches=batches, outputs_and_buffers=True)


@pytest.mark.slow
def test_a_step_under_flop_counter_mode(tmp_path: Path) -> None:
    train_and_compare(ZooLM, tmp_path, SETTINGS[3], counting_flops)


# -- fixed: more groups of a size than staging buffers of it -----------------------------------------


class TreeNode(nn.Module):
    """A binary tree of depth 3 (15 nodes), each a Linear and its children, called recursively."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.kids = nn.ModuleList([TreeNode(depth - 1) for _ in range(2)] if depth else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        for kid in self.kids:
            y = y + 0.5 * kid(x)
        return y


class TreeLM(ZooLM):
    def __init__(self) -> None:
        super().__init__()
        self.tree = TreeNode()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tree(self.emb(ids)))


def test_many_small_groups_with_nvme_gradients_and_accumulation(tmp_path: Path) -> None:
    """Fifteen groups of one size, their gradients staged on the way to NVMe homes while the simulated
    accelerator's copies land late: at the second micro-batch every staging buffer of the class was
    held by a staged group, and each flush (which reads the home back to add to it) needed one more:
    "no host staging buffer is free and none can be freed" ([Note: A merge's second buffer] in
    gradients.py)."""
    train_and_compare(TreeLM, tmp_path, SETTINGS[3], accum=2)


# -- held: models and loops that trained right when probed -------------------------------------------


def padding_mask(ids: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[0, -2:] = True
    return mask


class NormFirstEncoderLM(nn.Module):
    """nn.TransformerEncoder of norm_first layers without biases, with a padding mask: in eval under
    no_grad torch's fast path runs on nested tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True, norm_first=True, bias=False)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True, norm=nn.LayerNorm(DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = padding_mask(ids)
        return self.head(self.enc(self.emb(ids), src_key_padding_mask=mask).masked_fill(mask[..., None], 0.0))


class BiasKVAttentionLM(nn.Module):
    """nn.MultiheadAttention with add_bias_kv and add_zero_attn (bias_k, bias_v read in its forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, add_bias_kv=True, add_zero_attn=True, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(h + self.attn(h, h, h, key_padding_mask=padding_mask(ids), need_weights=False)[0])


class AdaptiveSoftmaxLM(nn.Module):
    """ZooLM's body under nn.AdaptiveLogSoftmaxWithLoss (a head and a ModuleList of tail Sequentials)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = ZooLM()
        self.body.head = nn.Identity()
        self.out = nn.AdaptiveLogSoftmaxWithLoss(DIM, VOCAB, cutoffs=[8, 16], div_value=2.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out.log_prob(self.body(ids).flatten(0, 1)).view(*ids.shape, VOCAB)


class ParameterContainersBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(DIM, DIM) * 0.1) for _ in range(2)])
        self.gains = nn.ParameterDict({"scale": nn.Parameter(torch.ones(DIM)), "shift": nn.Parameter(torch.zeros(DIM))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = x + torch.tanh(x @ w) * self.gains["scale"] + self.gains["shift"]
        return x


class ParameterContainersLM(ZooLM):
    """Blocks of a ParameterList and a ParameterDict, zipped with a ParameterList on the root."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ParameterContainersBlock() for _ in range(3)])
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(DIM)) for _ in range(3)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer, scale in zip(self.layers, self.scales):
            h = layer(h) * scale
        return self.head(h)


class LayerDropLM(ZooLM):
    """Blocks skipped at random in training (LayerDrop): which groups a step uses changes."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            if not (self.training and torch.rand(()) < 0.4):
                h = layer(h)
        return self.head(h)


class NoGradBlockLM(ZooLM):
    """Block 0 run under no_grad although trainable: it gets no gradient, and no update."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.layers[0](self.emb(ids))
        return self.head(self.run(1, 4, h))


def pruned() -> nn.Module:
    """torch.nn.utils.prune before initialize: weight_orig trained, weight = weight_orig * weight_mask
    (a buffer) computed in a forward pre-hook."""
    model = ZooLM()
    prune.l1_unstructured(model.layers[0].fc1, "weight", amount=0.5)
    prune.ln_structured(model.layers[2].fc2, "weight", amount=0.25, n=2, dim=0)
    prune.random_unstructured(model.head, "weight", amount=0.3)
    return model


def partly_frozen() -> nn.Module:
    """Frozen parameters inside trained groups (a bias, a norm's weight, the head's weight)."""
    model = ZooLM()
    for p in (model.layers[1].fc1.bias, model.layers[2].norm.weight, model.head.weight):
        p.requires_grad_(False)
    return model


HELD: Dict[str, Tuple[Callable[[], nn.Module], Step]] = {
    "norm_first encoder, nested fast path": (NormFirstEncoderLM, evaluation_between),
    "attention with bias_kv, zero_attn": (BiasKVAttentionLM, evaluation_between),
    "adaptive log softmax": (AdaptiveSoftmaxLM, plain_step),
    "parameter containers": (ParameterContainersLM, plain_step),
    "layerdrop": (LayerDropLM, plain_step),
    "no_grad block": (NoGradBlockLM, plain_step),
    "pruned": (pruned, evaluation_between),
    "frozen inside groups": (partly_frozen, plain_step),
}
DEFAULT = ("layerdrop",)


@pytest.mark.parametrize(
    "setting", [pytest.param(SETTINGS[1], marks=pytest.mark.slow, id=IDS[1]), pytest.param(SETTINGS[2], id=IDS[2])]
)
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c in DEFAULT else pytest.mark.slow) for c in sorted(HELD)]
)
def test_held_models_and_loops_train_bitwise(tmp_path: Path, case: str, setting: Tuple[str, int, str]) -> None:
    build, step = HELD[case]
    train_and_compare(build, tmp_path, setting, step, accum=2)


def hf_models() -> Dict[str, Callable[[], nn.Module]]:
    t = pytest.importorskip("transformers")
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)

    def checkpointed(model: nn.Module, reentrant: bool) -> nn.Module:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model

    def resized(model: Any) -> nn.Module:
        model.resize_token_embeddings(VOCAB + 8)
        return model

    llama = dict(common, num_key_value_heads=1)
    return {
        "qwen2-moe": lambda: HFLogits(t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
            **llama, num_experts=8, num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=16
        ))),
        "mistral sliding window": lambda: HFLogits(t.MistralForCausalLM(t.MistralConfig(**llama, sliding_window=3))),
        "llama checkpointed reentrant": lambda: HFLogits(
            checkpointed(t.LlamaForCausalLM(t.LlamaConfig(**llama)), True)
        ),
        "qwen2 tied, resized, checkpointed": lambda: HFLogits(checkpointed(resized(
            t.Qwen2ForCausalLM(t.Qwen2Config(**llama, tie_word_embeddings=True))
        ), False)),
        "albert shared layers": lambda: HFLogits(t.AlbertForMaskedLM(t.AlbertConfig(
            **dict(common, num_hidden_layers=3), embedding_size=8, max_position_embeddings=32
        ))),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["qwen2-moe", "mistral sliding window", "llama checkpointed reentrant", "qwen2 tied, resized, checkpointed",
     "albert shared layers"],
)
def test_hugging_face_models_train_bitwise(tmp_path: Path, name: str) -> None:
    train_and_compare(hf_models()[name], tmp_path, SETTINGS[3], accum=2)
