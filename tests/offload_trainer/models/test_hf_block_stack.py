"""models/hf_block_stack.py: a Hugging Face decoder-only model trained layer-major is bitwise plain PyTorch's
`model(input_ids)` micro-batch-major training (fp32, one rank), or refused with one line.

Found wrong, fixed: the adapter called every block with the first block's arguments, ended with
`head(norm(h))`, and ran the base model with use_cache=False, and each trained other values than plain
PyTorch, silently:
- Gemma2/3, Qwen2 with sliding-window layers, Cohere2, GPT-OSS give each block the mask (and Gemma3 the
  rotary table) of its layer type: every block got the first one's;
- Gemma2's and NanoChat's final logit soft-cap, Cohere's logit_scale and Granite's logits_scaling come
  after the head;
- GPT-J's attention reads its keys from the key/value cache `model(input_ids)` makes (a contiguous copy),
  whose matmul rounds otherwise than over the uncached keys' layout: its gradients differed in the last bits.
The begin now runs the base model's forward with stand-ins for the blocks, noting each block's arguments,
the end runs the model's own forward over the base model's output, and each block call gets a fresh cache.
A base model that does not run its blocks back to back, or gives them arguments parameters' gradients
flow through (the schedule's check, runtime/layer_major.py), is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
import torch
from torch import nn

import offload_trainer as ot
from offload_trainer.models import hf_block_stack
from tests.offload_trainer.runtime.test_layer_major import (
    OPT, TIERS, VOCAB, assert_params_equal, batches, train_layer_major, train_reference,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def hf_models() -> Dict[str, Callable[[], nn.Module]]:
    T = pytest.importorskip("transformers")
    shape = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    return {
        # sliding-window and full layers (masks per block, window 4 < 12 tokens), the final logit soft-cap
        "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(sliding_window=4, head_dim=8, **shape)),
        # local and global rotary tables per block
        "gemma3": lambda: T.Gemma3ForCausalLM(
            T.Gemma3TextConfig(
                sliding_window=4, head_dim=8, layer_types=["sliding_attention", "full_attention"], **shape
            )
        ),
        # keys through the key/value cache; blocks returning tuples
        "gptj": lambda: T.GPTJForCausalLM(
            T.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        ),
        # logits scaled after the head
        "cohere": lambda: T.CohereForCausalLM(T.CohereConfig(logit_scale=0.5, **shape)),
        # its final norm also normalises the embeddings, before the blocks; a final logit soft-cap
        "nanochat": lambda: T.NanoChatForCausalLM(T.NanoChatConfig(**shape)),
    }


@pytest.mark.parametrize(
    "name",
    ["gemma2", "gptj"] + [pytest.param(name, marks=pytest.mark.slow) for name in ("gemma3", "cohere", "nanochat")],
)
def test_hugging_face_models_train_layer_major_bitwise(tmp_path: Path, name: str) -> None:
    torch.manual_seed(0)
    model = hf_models()[name]().float().train()
    steps = batches(2, 2, seq=12)
    ref = train_reference(model, steps)
    cfg = ot.OffloadConfig(
        tiers=dict(TIERS["all-nvme"], nvme_dir=str(tmp_path)), prefetch={"lookahead_groups": 1}, optimizer=OPT,
        grad_accum_steps=2,
    )
    with ot.initialize(model, cfg) as engine:
        train_layer_major(engine, steps, stack=hf_block_stack(model))
        assert_params_equal(ref, engine.full_state_dict())


# -- refused: what the schedule cannot run -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["mixtral_jitter", "llama_attention_dropout"])
def test_a_model_drawing_random_numbers_in_its_blocks_is_refused(tmp_path: Path, kind: str) -> None:
    """Mixtral's router jitter multiplies each block's input by noise drawn in training, from no dropout module
    or config field the adapter knew: layer-major trained all 21 of its parameters to other values than plain
    PyTorch, silently. Refused now by the schedule's watch on the random generators ([Note: Random draws]), as
    Llama's attention dropout (SDPA's dropout_p) is, which the adapter refused by its config field before."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )
    if kind == "mixtral_jitter":
        config = T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1, **shape)
        model = T.MixtralForCausalLM(config).train()
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(attention_dropout=0.1, **shape)).train()
    cfg = ot.OffloadConfig(tiers=dict(TIERS["all-host"], nvme_dir=str(tmp_path)), optimizer=OPT, grad_accum_steps=2)
    with ot.initialize(model, cfg) as engine:
        with pytest.raises(ValueError, match=r"^block 0 \(model\.layers\.0\) drew random numbers"):
            train_layer_major(engine, batches(1, 2, seq=12), stack=hf_block_stack(model))



@dataclass
class Output:
    last_hidden_state: torch.Tensor


class Block(nn.Linear):
    def forward(self, h: torch.Tensor, extra: Any = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(h if extra is None else h + extra)


class Base(nn.Module):
    """A base model of Hugging Face's shape: `between` runs between its blocks, `extra` is given to each."""

    def __init__(self, between: Callable[[torch.Tensor], torch.Tensor], extra: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList([Block(16, 16) for _ in range(2)])
        self.norm = nn.LayerNorm(16)
        self.between, self.extra = between, extra

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Output:
        h = self.emb(input_ids)
        for layer in self.layers:
            h = self.between(layer(h, *((h * 2,) if self.extra else ())))
        return Output(self.norm(h))


class LM(nn.Module):
    base_model_prefix = "model"

    def __init__(self, between: Callable[[torch.Tensor], torch.Tensor] = lambda h: h, extra: bool = False) -> None:
        super().__init__()
        self.model = Base(between, extra)
        self.lm_head = nn.Linear(16, VOCAB)

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.lm_head(self.model(input_ids).last_hidden_state)


def test_a_base_model_of_hugging_faces_shape_runs_as_its_forward() -> None:
    model = LM()
    ids = torch.randint(0, VOCAB, (2, 5))
    stack = hf_block_stack(model)
    h, context = stack.stack_begin(ids)
    for block in stack.stack_blocks():
        h = stack.stack_block(block, h, context)
    assert torch.equal(stack.stack_end(h, context), model(ids))


def test_a_base_model_changing_the_hidden_state_between_blocks_is_refused() -> None:
    refused = r"LM's base model does not run its blocks back to back \(it passes block 1 something other"
    with pytest.raises(ValueError, match=refused):
        hf_block_stack(LM(between=lambda h: h * 0.5)).stack_begin(torch.randint(0, VOCAB, (2, 5)))


def test_block_arguments_that_require_grad_are_refused(tmp_path: Path) -> None:
    """The blocks get `h * 2` beside h: the schedule backpropagates each block into h alone. Before, autograd
    failed in the second block's backward ("Trying to backward through the graph a second time")."""
    model = LM(extra=True)
    ids = [torch.randint(0, VOCAB, (2, 5)) for _ in range(2)]
    cfg = ot.OffloadConfig(tiers=dict(TIERS["all-host"], nvme_dir=str(tmp_path)), optimizer=OPT, grad_accum_steps=2)
    loss = lambda out, m: nn.functional.cross_entropy(out.flatten(0, 1), ids[m].flatten())  # noqa: E731
    with ot.initialize(model, cfg) as engine:
        refused = r"context of micro-batch 0 .* holds a tensor of shape \(2, 5, 16\) that requires grad"
        with pytest.raises(ValueError, match=refused):
            engine.forward_backward_layer_major(ids, loss, stack=hf_block_stack(model))
        for x in ids:  # nothing kept: the step trains micro-batch-major
            engine.backward(loss(engine(x), 0) / 2)
        assert engine.step()
