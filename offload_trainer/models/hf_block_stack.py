"""A Hugging Face decoder-only causal LM as a block stack, for the layer-major schedule.

    from offload_trainer.models import hf_block_stack
    stack = hf_block_stack(model)          # e.g. LlamaForCausalLM, GPT2LMHeadModel, Qwen2, Mistral (tied or not)
    engine.forward_backward_layer_major(micro_batches, loss_fn, stack=stack)

It asks the model for as little as possible (the protocol is runtime/layer_major.BlockStack):
- the blocks: the decoder's `ModuleList` (`base_model.layers`, or `.h` as in GPT-2);
- the begin: the base model's own forward, stopped as the first block is called; whatever the
  model computes before its blocks (embeddings, positions, rotary tables, the causal mask) is
  done by the model itself, and the arguments it passes to the first block are the context every
  block of that micro-batch is called with (the standard signature: the same arguments for each);
- the end: the final norm (`norm` or `ln_f`) and the output embeddings (`get_output_embeddings()`).
The base model runs with use_cache=False, so the blocks keep no key/value cache between calls.
Imports nothing (it reads the model's attributes), so transformers stays an optional extra.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import nn


class _Reached(Exception):
    """Raised in the first block's pre-hook: the base model's forward has computed the blocks' input."""


class HFBlockStack:
    """The begin, blocks and end of a Hugging Face decoder-only causal LM."""

    def __init__(self, model: nn.Module) -> None:
        name = type(model).__name__
        base = getattr(model, "base_model", None)
        layers = None if base is None else getattr(base, "layers", getattr(base, "h", None))
        norm = None if base is None else getattr(base, "norm", getattr(base, "ln_f", None))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or norm is None or head is None:
            raise ValueError(
                f"{name} is not a decoder-only causal LM this adapter knows (base_model.layers or .h as a ModuleList, "
                "base_model.norm or .ln_f, get_output_embeddings()): train it micro-batch-major, or pass a "
                "BlockStack of your own to forward_backward_layer_major"
            )
        config = getattr(model, "config", None)
        dropout = {k: getattr(config, k) for k in ("attention_dropout", "attn_pdrop") if getattr(config, k, 0.0)}
        if dropout and model.training:
            raise ValueError(
                f"{name} has attention dropout {dropout}: the layer-major schedule recomputes each block in "
                "backward, and its draws would differ from the forward's; set them to 0.0 in the config or train "
                "micro-batch-major"
            )
        self.model = model
        self.base = base
        self.layers = layers
        self.norm = norm
        self.head = head

    def stack_begin(self, input_ids: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        captured: Dict[str, Any] = {}

        def reached(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
            captured["args"], captured["kwargs"] = args, dict(kwargs)
            raise _Reached

        handle = self.layers[0].register_forward_pre_hook(reached, with_kwargs=True, prepend=True)
        try:
            self.base(input_ids=input_ids, use_cache=False)
        except _Reached:
            pass
        finally:
            handle.remove()
        if "args" not in captured:
            raise ValueError(f"{type(self.model).__name__}'s forward never called its first block")
        args, kwargs = captured["args"], captured["kwargs"]
        if args:
            return args[0], (args[1:], kwargs)
        return kwargs.pop("hidden_states"), ((), kwargs)

    def stack_blocks(self) -> nn.ModuleList:
        return self.layers

    def stack_block(self, block: nn.Module, h: torch.Tensor, context: Any) -> torch.Tensor:
        args, kwargs = context
        out = block(h, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def stack_end(self, h: torch.Tensor, context: Any) -> torch.Tensor:
        """The logits."""
        return self.head(self.norm(h))


def hf_block_stack(model: nn.Module) -> HFBlockStack:
    """The block stack of a Hugging Face decoder-only causal LM (ValueError if it has none this adapter knows)."""
    return HFBlockStack(model)


__all__ = ["HFBlockStack", "hf_block_stack"]
