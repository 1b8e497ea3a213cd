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
| dropout in the root's checkpointed closure; LSTM and GRU with       | held (HELD, slow)          |
| flatten_parameters() in forward; functional_call of a block with    |                            |
| other weights inside forward                                        |                            |
| a torch.compile'd function (inductor, aot_eager) taking a block's   | held (probed, not kept)    |
| weights, called in its forward                                      |                            |
| HF DeepSeek-V2 (MLA, group-limited MoE), GLM4-MoE, LLaVA (CLIP      | held (slow test)           |
| tower + Llama), VisionEncoderDecoder (ViT to GPT-2 cross-attention) |                            |
| HF ERNIE-4.5-MoE, dots1, GraniteMoeHybrid, OLMo3, Helium, BigBird-  | held (probed, not kept)    |
| Pegasus, ERNIE, Data2Vec-text, DeiT (distilled), CvT, MobileViT,    |                            |
| PoolFormer, RegNet                                                  |                            |

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
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import offload_trainer as ot
from offload_trainer.runtime.hooks import UnresidentParameter
from offload_trainer.runtime.model_changes import HeldParameter
from tests.offload_trainer.runtime.test_model_zoo import DIM, SETTINGS, VOCAB, config, lm_loss, token_batches
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


@pytest.mark.parametrize("setting", some((0,)))
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


@pytest.mark.parametrize("setting", some((0,)))
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


@pytest.mark.parametrize("setting", some((0,)))
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
        assert isinstance(weight, UnresidentParameter)
        assert weight.shape == (16, 16)  # the layout's size, not the placeholder's ([Note: Sizes of unbound parameters])
        assert weight.norm().item() == 0.0 and isinstance(weight, UnresidentParameter)  # between steps: as before
        engine.backward(lm_loss(engine(ids), ids))
        engine.step()  # every device copy dropped
        assert classes == [HeldParameter] and isinstance(weight, UnresidentParameter)
    assert type(weight) is nn.Parameter and all(type(p) is nn.Parameter for p in model.parameters())


# -- held: probed in this round, kept here so they stay so ---------------------------------------------


class DropoutRootClosureLM(CheckpointedRootClosureLM):
    """Dropout inside the root's checkpointed closure: its recomputation replays the RNG state."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda x: self.drop(torch.tanh(x + self.pos)), self.emb(ids), use_reentrant=False)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class FlattenedRNNLM(nn.Module):
    """An LSTM and a bidirectional GRU as blocks, flatten_parameters() called in forward (as RNN code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.rnns = nn.ModuleList(
            [nn.LSTM(DIM, DIM, batch_first=True), nn.GRU(DIM, DIM, batch_first=True, bidirectional=True)]
        )
        self.proj = nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for rnn in self.rnns:
            rnn.flatten_parameters()
            h = rnn(h)[0]
        return self.head(self.proj(h))


class FunctionalCallInsideLM(BlocksLM):
    """The first block run again through torch.func.functional_call with halved weights."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        halved = {name: p * 0.5 for name, p in self.layers[0].named_parameters()}
        return self.head(h + torch.func.functional_call(self.layers[0], halved, (h,)))


HELD = {
    "dropout in the root's checkpointed closure": DropoutRootClosureLM,
    "flattened LSTM and GRU": FlattenedRNNLM,
    "functional_call of a block inside forward": FunctionalCallInsideLM,
}


@pytest.mark.slow
@pytest.mark.parametrize("setting", some(()))
@pytest.mark.parametrize("case", list(HELD))
def test_held_models_train_bitwise(tmp_path: Path, case: str, setting: Tuple[str, int, str]) -> None:
    train_and_compare(HELD[case], tmp_path, setting)


def _pixels(ids: torch.Tensor, size: int) -> torch.Tensor:
    """A (batch, 3, size, size) image made of the token ids."""
    b, n = ids.shape
    flat = (ids.float() / VOCAB).repeat_interleave(3 * size * size // n + 1, dim=1)[:, : 3 * size * size]
    return flat.view(b, 3, size, size)


class VisionToText(nn.Module):
    """HF VisionEncoderDecoder: a ViT encoder, a GPT-2 decoder cross-attending to it."""

    def __init__(self) -> None:
        super().__init__()
        t = pytest.importorskip("transformers")
        encoder = t.ViTConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=16,
            patch_size=8,
        )
        decoder = t.GPT2Config(
            vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, add_cross_attention=True, is_decoder=True
        )
        config = t.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
        self.m = t.VisionEncoderDecoderModel(config=config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(pixel_values=_pixels(ids, 16), decoder_input_ids=ids).logits


class Llava(nn.Module):
    """HF LLaVA: a CLIP vision tower and a projector whose features replace the image tokens of a Llama."""

    def __init__(self) -> None:
        super().__init__()
        t = pytest.importorskip("transformers")
        vision = t.CLIPVisionConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=16,
            patch_size=8, projection_dim=16,
        )
        text = t.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            num_key_value_heads=1,
        )
        self.m = t.LlavaForConditionalGeneration(t.LlavaConfig(
            vision_config=vision, text_config=text, image_token_index=VOCAB - 1, projector_hidden_act="gelu",
            vision_feature_layer=-1, image_seq_length=4,
        ))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.masked_fill(ids == VOCAB - 1, 0)
        image = torch.full((ids.shape[0], 4), VOCAB - 1, dtype=ids.dtype)
        return self.m(input_ids=torch.cat([image, ids], 1), pixel_values=_pixels(ids, 16)).logits[:, 4:]


def hf_models() -> Dict[str, Callable[[], nn.Module]]:
    t = pytest.importorskip("transformers")
    from tests.offload_trainer.runtime.test_model_zoo_3 import HFLogits

    small = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    moe = dict(
        small, num_key_value_heads=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        n_shared_experts=1, first_k_dense_replace=1,
    )
    return {
        "deepseek-v2": lambda: HFLogits(t.DeepseekV2ForCausalLM(t.DeepseekV2Config(
            **moe, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=2,
            topk_group=1, topk_method="group_limited_greedy",
        ))),
        "glm4-moe": lambda: HFLogits(t.Glm4MoeForCausalLM(t.Glm4MoeConfig(**moe, head_dim=8, n_group=1, topk_group=1))),
        "llava": Llava,
        "vision-encoder-decoder": VisionToText,
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek-v2", "glm4-moe", "llava", "vision-encoder-decoder"])
def test_hugging_face_models_train_bitwise(tmp_path: Path, name: str) -> None:
    train_and_compare(hf_models()[name], tmp_path, SETTINGS[3])
