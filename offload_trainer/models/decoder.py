"""A Llama-style causal decoder LM, small enough to read in one sitting.

    tokens ─▶ embed_tokens ─▶ layers[0..N) ─▶ norm ─▶ lm_head ─▶ logits
    each DecoderBlock:  h = h + self_attn(input_layernorm(h))            (RoPE, grouped-query)
                        h = h + mlp(post_attention_layernorm(h))         (SwiGLU)

Run it:

    import torch
    from offload_trainer.models import DecoderConfig, DecoderLM
    model = DecoderLM(DecoderConfig.preset("tiny"))
    tokens = torch.randint(0, 256, (2, 16))
    logits, loss = model(tokens[:, :-1], targets=tokens[:, 1:])

What the offload engine relies on, and this file keeps true:
- every parameter is a plain ``nn.Parameter`` owned by a submodule; RoPE is computed on the fly,
  so the model has no buffers at all;
- forward never writes to a parameter and keeps nothing derived from one between calls, so the
  engine may swap ``param.data`` in and out around each block's forward and backward;
- ``init_weights(module)`` initialises one module's own parameters in place, and applying it to
  every module in ``model.modules()`` order from a given RNG state reproduces what construction
  does from that state: a model built on the meta device can be materialised one block at a time
  and come out bit for bit equal to one built directly.

Parameter names follow Hugging Face's Llama (``layers.0.self_attn.q_proj.weight``, ...) and RoPE
uses the same rotate-half convention, so a Llama checkpoint loads once its ``model.`` prefix is
stripped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend
from torch.utils.checkpoint import checkpoint

from offload_trainer.models.meta_init import on_meta

INIT_STD = 0.02
"""Standard deviation of the normal init of embeddings and linear layers (GPT-2, Llama)."""

_FFN_MULTIPLE_OF = 256
"""The default ffn_dim is 8/3 * dim rounded up to a multiple of this, as in Llama."""


def default_ffn_dim(dim: int) -> int:
    """Llama's SwiGLU hidden size: 2/3 of 4*dim (same FLOPs as a 4*dim GELU MLP), rounded up to 256."""
    hidden = int(2 * 4 * dim / 3)
    return _FFN_MULTIPLE_OF * ((hidden + _FFN_MULTIPLE_OF - 1) // _FFN_MULTIPLE_OF)


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of a DecoderLM. Every field is validated when the config is made."""

    vocab_size: int
    """Number of token ids; embedding rows and logits per position."""

    dim: int
    """Width of the residual stream."""

    n_layers: int
    """Number of DecoderBlocks."""

    n_heads: int
    """Query heads per attention layer; dim must be a multiple of it, and head_dim = dim // n_heads even (RoPE)."""

    n_kv_heads: int
    """Key/value heads (grouped-query attention): n_heads must be a multiple of it; equal to n_heads is plain MHA."""

    ffn_dim: int | None = None
    """Hidden size of the SwiGLU MLP; None computes Llama's 8/3 * dim rounded up to a multiple of 256."""

    max_seq_len: int = 2048
    """Longest sequence forward accepts. RoPE is computed on the fly, so this costs no memory."""

    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""

    norm_eps: float = 1e-5
    """Epsilon inside every RMSNorm's square root."""

    tie_embeddings: bool = False
    """Use the token embedding matrix as the lm_head weight too (one Parameter, used by two modules)."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}.{field}={value!r} must be a positive int")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"{name}.dim={self.dim} is not a multiple of n_heads={self.n_heads}: "
                f"choose dim = n_heads * head_dim, e.g. dim={self.n_heads * max(2, self.dim // self.n_heads)}"
            )
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(
                f"{name}: head_dim = dim // n_heads = {self.dim // self.n_heads} is odd; rotary embeddings "
                f"rotate pairs of channels, so choose dim and n_heads with an even quotient"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"{name}.n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: "
                f"each key/value head must serve the same number of query heads"
            )
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", default_ffn_dim(self.dim))
        elif not isinstance(self.ffn_dim, int) or isinstance(self.ffn_dim, bool) or self.ffn_dim <= 0:
            raise ValueError(f"{name}.ffn_dim={self.ffn_dim!r} must be a positive int, or None for the Llama default")
        if not self.rope_theta > 0:
            raise ValueError(f"{name}.rope_theta={self.rope_theta!r} must be positive (10000.0 is usual)")
        if not self.norm_eps > 0:
            raise ValueError(f"{name}.norm_eps={self.norm_eps!r} must be positive (1e-5 is usual)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def mlp_numel(self) -> int:
        """Parameters of one block's MLP (gate, up and down projections)."""
        assert self.ffn_dim is not None  # set in __post_init__
        return 3 * self.dim * self.ffn_dim

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DecoderConfig:
        """A named shape from PRESETS, with any field overridden, e.g. preset("7b", max_seq_len=1024)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
        return dataclasses.replace(cls(**PRESETS[name]), **overrides)


PRESETS: dict[str, dict[str, Any]] = {
    # Byte-level (vocab 256) models for tests and quick runs.
    "tiny": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=256),
    "small": dict(vocab_size=256, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_seq_len=512),
    # GPT-3 small / medium widths with GQA so that the count lands near the name.
    "125m": dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
    "350m": dict(vocab_size=32000, dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=2816),
    # TinyLlama-1.1B.
    "1b": dict(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632),
    # Llama-2 7B / 13B / 70B.
    "7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, max_seq_len=4096),
    "13b": dict(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, max_seq_len=4096),
    "70b": dict(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, max_seq_len=4096),
}
"""Named shapes for DecoderConfig.preset. ffn_dim is written out (it is the Llama default for all but
70b, which uses Llama-2's ffn_dim_multiplier=1.3) so that MoEConfig.preset gets the same experts' size."""


def num_params(config: DecoderConfig) -> int:
    """Number of parameters (a tied embedding counted once) of the model `config` describes, on paper.

    Works for an MoEConfig too: its blocks differ only in mlp_numel().
    """
    d, kv_dim = config.dim, config.n_kv_heads * config.head_dim
    attention = d * d + 2 * d * kv_dim + d * d  # q, k, v, o projections
    block = attention + config.mlp_numel() + 2 * d  # + two RMSNorm weights
    embedding = config.vocab_size * d
    lm_head = 0 if config.tie_embeddings else config.vocab_size * d
    return embedding + config.n_layers * block + d + lm_head  # + final norm


def linear(in_features: int, out_features: int, init_std: float = INIT_STD) -> nn.Linear:
    """A bias-free nn.Linear that remembers the std init_weights gives it (a float on the module)."""
    layer = nn.Linear(in_features, out_features, bias=False)
    layer.init_std = init_std
    return layer


def residual_init_std(n_layers: int) -> float:
    """Std of the projections that write into the residual stream: GPT-2's 0.02 / sqrt(2 * n_layers)."""
    return INIT_STD / math.sqrt(2 * n_layers)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles, fp32 [seq_len, head_dim], in rotate-half layout (frequencies repeated)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, head_dim] by position: channel i pairs with channel i + head_dim/2."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).type_as(x)


_fused_sdp_choice = getattr(torch, "_fused_sdp_choice", None)
_MATH_KERNEL = int(SDPBackend.MATH)


def expands_kv_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether Attention repeats k and v to q's head count before SDPA: where SDPA's fused kernels
    refuse grouped k/v (enable_gqa) but take them repeated. Else SDPA falls back to its math kernel,
    which keeps the s x s attention scores for backward. The CPU flash kernel takes grouped k/v only
    from torch 2.9 (pytorch#157893); on CUDA only flash attention does (so not in fp32).
    torch._fused_sdp_choice is the dispatcher's own choice, with the inputs, flags and grad mode."""
    if _fused_sdp_choice is None or q.shape[1] == k.shape[1] or q.is_meta:
        return False
    if _fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=True) != _MATH_KERNEL:
        return False
    return _fused_sdp_choice(q, q, q, is_causal=True) != _MATH_KERNEL


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, out_init_std: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.q_proj = linear(dim, n_heads * self.head_dim)
        self.k_proj = linear(dim, n_kv_heads * self.head_dim)
        self.v_proj = linear(dim, n_kv_heads * self.head_dim)
        self.o_proj = linear(n_heads * self.head_dim, dim, init_std=out_init_std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        grouped = self.n_kv_heads != self.n_heads
        if grouped and expands_kv_heads(q, k):
            groups = self.n_heads // self.n_kv_heads
            k, v, grouped = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq_len, -1))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int, out_init_std: float) -> None:
        super().__init__()
        self.gate_proj = linear(dim, hidden_dim)
        self.up_proj = linear(dim, hidden_dim)
        self.down_proj = linear(hidden_dim, dim, init_std=out_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """Pre-norm transformer block: the unit the engine moves (one ShardGroup per block)."""

    def __init__(self, config: DecoderConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        out_std = residual_init_std(config.n_layers)
        assert config.ffn_dim is not None  # set in __post_init__
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config.dim, config.n_heads, config.n_kv_heads, out_std)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = mlp if mlp is not None else SwiGLU(config.dim, config.ffn_dim, out_std)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


@torch.no_grad()
def init_weights(module: nn.Module) -> None:
    """Initialise `module`'s own parameters (not its children's) in place from the global RNG.

    RMSNorm weights are ones; embeddings are N(0, 0.02); linear weights are N(0, init_std), where
    init_std is 0.02 except for residual projections (0.02 / sqrt(2 * n_layers)). Modules without
    parameters of their own are left alone, so this can be applied to each module of a model in turn.
    """
    if isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
    elif isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", INIT_STD))
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class DecoderLM(nn.Module):
    """Causal decoder LM: forward(tokens[B, T]) -> logits[B, T, vocab], or (logits, mean CE loss) with targets.

    activation_checkpointing (also a plain attribute, settable later) runs each block under
    torch.utils.checkpoint(use_reentrant=False): its activations are dropped after forward and the
    block is called again in backward, so its forward pre-hooks fire twice per step. Its forward
    post-hooks need not fire the second time: the recomputation stops early, once it has rebuilt
    what backward needs (torch.utils.checkpoint.set_checkpoint_early_stop).
    """

    def __init__(self, config: DecoderConfig, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.config = config
        self.activation_checkpointing = activation_checkpointing

        # Build on meta, then materialise and run init_weights: nn.Linear's own default init would
        # draw from the RNG first, and construction must draw exactly what a meta-built model's
        # reset_parameters() draws, so that the two give identical weights from the same seed.
        # Where a factory function puts a tensor now. Not torch.get_default_device(): before torch 2.8
        # it misses a `with torch.device("meta"):` block (pytorch#148621), so a 7B model asked for on
        # meta was built for real in host memory.
        device = torch.empty(0).device
        with on_meta():
            self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(self._make_block() for _ in range(config.n_layers))
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.lm_head = linear(config.dim, config.vocab_size)
        self._tie_weights()
        if device.type != "meta":
            self.to_empty(device=device)
            self.reset_parameters()

    def _make_block(self) -> DecoderBlock:
        return DecoderBlock(self.config)

    def _tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _apply(self, fn: Any, recurse: bool = True) -> DecoderLM:
        # to_empty() (and any conversion that cannot reuse the storage) gives each module its own
        # new Parameter, which would silently untie lm_head from the embedding: tie them again.
        super()._apply(fn, recurse)
        self._tie_weights()
        return self

    def reset_parameters(self) -> None:
        """Initialise every parameter in place: init_weights on each module, in self.modules() order."""
        for module in self.modules():
            init_weights(module)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h, (cos, sin) = self.stack_begin(tokens)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        logits = self.stack_end(h, (cos, sin))
        if targets is None:
            return logits
        return logits, self.loss_of(logits, targets)

    @staticmethod
    def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of the logits against the next tokens, in fp32 (what forward returns)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    # -- the block stack (offload_trainer.runtime.layer_major.BlockStack) ------------------------------

    def stack_begin(self, tokens: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """tokens -> (the first block's input, the RoPE tables every block of this batch shares)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be a [batch, seq_len] LongTensor, got shape {tuple(tokens.shape)}")
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len={self.config.max_seq_len}: "
                f"shorten the batch or raise max_seq_len in the config"
            )
        cos, sin = rotary_cos_sin(seq_len, self.config.head_dim, self.config.rope_theta, tokens.device)
        return self.embed_tokens(tokens), (cos, sin)

    def stack_blocks(self) -> nn.ModuleList:
        return self.layers

    def stack_block(self, block: nn.Module, h: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One block, never checkpointed (the layer-major schedule recomputes blocks itself)."""
        return block(h, *context)

    def stack_end(self, h: torch.Tensor, context: Any) -> torch.Tensor:
        """The last block's output -> logits."""
        return self.lm_head(self.norm(h))
