"""A mixture-of-experts decoder LM: the DecoderLM with each block's MLP replaced by routed experts.

    each block:  h = h + self_attn(input_layernorm(h))
                 h = h + moe(post_attention_layernorm(h))
    moe(x):      router(x) -> softmax -> top_k experts per token; each expert is its own SwiGLU
                 submodule, called only on the tokens routed to it, and not called at all when
                 no token picks it

So the set and order of modules that run (and of parameters that get gradients) changes with the
data: this is the model the engine's tests use for steps whose module order differs from the
recorded one. Run it:

    import torch
    from offload_trainer.models import MoEConfig, MoEDecoderLM
    model = MoEDecoderLM(MoEConfig())  # tiny: dim 32, 2 layers, 4 experts, vocab 64
    tokens = torch.randint(0, 64, (2, 16))
    logits, loss = model(tokens[:, :-1], targets=tokens[:, 1:])

There is no load-balancing loss: forward's loss is the language-model loss alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from offload_trainer.models.decoder import DecoderBlock, DecoderConfig, DecoderLM, SwiGLU, linear, residual_init_std


@dataclass(frozen=True)
class MoEConfig(DecoderConfig):
    """A DecoderConfig whose blocks route each token to top_k of n_experts SwiGLU experts.

    Every field has a default (a tiny model for tests); ffn_dim is each expert's hidden size.
    MoEConfig.preset(name) gives a DecoderConfig preset's shapes with n_experts experts of its ffn_dim.
    """

    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int | None = 64
    max_seq_len: int = 64

    n_experts: int = 4
    """Experts per block, each its own SwiGLU submodule in MoEFeedForward.experts."""

    top_k: int = 1
    """Experts each token is sent to: those with the largest router logits (1 is Switch-style routing)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.n_experts, int) or isinstance(self.n_experts, bool) or self.n_experts <= 0:
            raise ValueError(f"MoEConfig.n_experts={self.n_experts!r} must be a positive int")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k!r} must be an int from 1 to n_experts={self.n_experts}"
            )

    def mlp_numel(self) -> int:
        """Parameters of one block's MoE layer: the router plus every expert."""
        assert self.ffn_dim is not None  # set in __post_init__
        return self.dim * self.n_experts + self.n_experts * 3 * self.dim * self.ffn_dim


class MoEFeedForward(nn.Module):
    """Token-choice top-k routing over SwiGLU experts, dispatching each token only to its experts.

    Gate weights are the router's softmax probabilities of the chosen experts; with top_k > 1 they
    are renormalised to sum to one (Mixtral). With top_k = 1 the weight is the chosen expert's
    probability itself (Switch Transformer), which is what lets the router learn.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        assert config.ffn_dim is not None  # set in __post_init__
        self.top_k = config.top_k
        self.router = linear(config.dim, config.n_experts)
        out_std = residual_init_std(config.n_layers)
        self.experts = nn.ModuleList(SwiGLU(config.dim, config.ffn_dim, out_std) for _ in range(config.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        gate, chosen = probs.topk(self.top_k, dim=-1)  # [num_tokens, top_k] each
        if self.top_k > 1:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        gate = gate.to(x.dtype)

        out = torch.zeros_like(flat)
        # Only experts some token chose are called, in ascending expert order; .tolist() syncs with
        # the device once per block, which data-dependent dispatch cannot avoid.
        for expert_id in chosen.unique().tolist():
            token_ids, slot = torch.where(chosen == expert_id)
            expert_out = self.experts[expert_id](flat[token_ids])
            # Each token appears at most once per expert, so index_add is free of colliding (atomic) adds.
            out = out.index_add(0, token_ids, expert_out * gate[token_ids, slot].unsqueeze(-1))
        return out.view_as(x)


class MoEDecoderLM(DecoderLM):
    """DecoderLM whose blocks' mlp is a MoEFeedForward; same forward(tokens, targets=None) and init."""

    config: MoEConfig

    def __init__(self, config: MoEConfig, activation_checkpointing: bool = False) -> None:
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoEDecoderLM needs an MoEConfig, got {type(config).__name__}: use DecoderLM for it")
        super().__init__(config, activation_checkpointing=activation_checkpointing)

    def _make_block(self) -> DecoderBlock:
        return DecoderBlock(self.config, mlp=MoEFeedForward(self.config))
