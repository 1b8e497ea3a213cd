"""Training memory per rank on paper: ZeRO's model-state bytes by stage, and the decoder's activations.

Model states, as the ZeRO paper defines them (Rajbhandari et al. 2020, section 5 and Figure 1). With
Ψ parameters on N_d ranks and P, G, K bytes per parameter for parameters, gradients and optimizer
states (the paper's mixed-precision Adam: P = G = 2, K = 12), one rank holds

    stage 0  baseline      (P + G + K) Ψ
    stage 1  P_os          P Ψ + G Ψ + K Ψ / N_d
    stage 2  P_os+g        P Ψ + (G + K) Ψ / N_d
    stage 3  P_os+g+p      (P + G + K) Ψ / N_d

where a partitioned amount is ceil(Ψ / N_d) whole elements. This engine is stage 3, with the P, G, K
of `training_bytes_per_element`. Its homes (memory_plan.plan_memory) differ from the stage-3 figure
only by partition.py's layout: each group's flat buffer is padded to world_size * align_numel
elements, so a rank's parameter shard exceeds ceil(Ψ / N_d) by less than align_numel elements per
group. Gradients and optimizer states cover only the shard's trainable elements, which start each
group's buffer: with every parameter trainable, rank 0 holds the most of them (from ceil(Ψ / N_d) up
to that plus the padding), later ranks fewer, the last possibly less than ceil(Ψ / N_d).

Activations: `activation_bytes` counts, tensor by tensor, what autograd saves for backward in
models/decoder.py's DecoderLM, as Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models") did for GPT (34·s·b·h + 5·a·s²·b per layer at 16 bits). See its docstring.

    from offload_trainer.planning.zero_memory import DecoderShape, activation_bytes, zero_bytes_per_rank
    zero_bytes_per_rank(7_500_000_000, 64, 3, 2, 2, 12).total_bytes   # 1_875_000_000: Figure 1's 1.9 GB
    llama_7b = DecoderShape.from_decoder_config(DecoderConfig.preset("7b"))
    activation_bytes(llama_7b, 1, 4096, 2, checkpointing=False)       # 25_370_312_704 (23.6 GiB)
    activation_bytes(llama_7b, 1, 4096, 2, checkpointing=True)        #  2_762_522_624 (2.6 GiB)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from offload_trainer.config import OptimizerKind
from offload_trainer.models.decoder import DecoderConfig, expands_kv_heads

FP32_BYTES = 4
"""Gradient shards, optimizer states and the master copy are fp32 whatever the compute dtype."""

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _check_int(name: str, value: int, minimum: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int, {meaning} (write int(7.5e9), not 7.5e9)")
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}: it is {meaning}")


# -- model states (ZeRO) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ZeroBytes:
    """One rank's bytes of model states under a ZeRO stage."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    """Every optimizer state, the fp32 master copy included."""

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def zero_bytes_per_rank(
    numel: int, world_size: int, stage: int, param_bytes: int, grad_bytes: int, optimizer_bytes: int
) -> ZeroBytes:
    """Model-state bytes one of `world_size` ranks holds under ZeRO `stage` (0 to 3), for `numel` parameters.

    `param_bytes`, `grad_bytes` and `optimizer_bytes` are per parameter (the paper's 2, 2 and K = 12;
    this engine's come from training_bytes_per_element). Stage 1 partitions the optimizer states, 2
    also the gradients, 3 also the parameters; a partitioned amount is ceil(numel / world_size) elements.
    """
    _check_int("numel", numel, 0, "the number of parameters")
    _check_int("world_size", world_size, 1, "the number of data-parallel ranks")
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes), ("optimizer_bytes", optimizer_bytes)):
        _check_int(name, value, 0, "bytes per parameter")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(
            f"stage={stage!r} must be 0 (nothing partitioned), 1 (optimizer states), 2 (+ gradients) "
            "or 3 (+ parameters)"
        )
    shard_numel = -(-numel // world_size)
    return ZeroBytes(
        params_bytes=(shard_numel if stage >= 3 else numel) * param_bytes,
        grads_bytes=(shard_numel if stage >= 2 else numel) * grad_bytes,
        optimizer_bytes=(shard_numel if stage >= 1 else numel) * optimizer_bytes,
    )


def training_bytes_per_element(
    compute_dtype: torch.dtype, optimizer_kind: OptimizerKind | str, momentum: float
) -> tuple[int, int, int]:
    """(param_bytes, grad_bytes, optimizer_bytes) per parameter as this engine homes them.

    As memory_plan.plan_memory does: parameters in the compute dtype (fp32 4, bf16/fp16 2), gradient
    shards in fp32 (4), and 4 bytes per fp32 optimizer state: OptimizerKind.state_names (AdamW exp_avg
    and exp_avg_sq; SGD one momentum_buffer when momentum != 0, none when it is 0), plus the
    "master" copy of the parameters under bf16/fp16 compute. bf16 AdamW gives (2, 4, 12).
    """
    if compute_dtype not in (torch.float32, *_LOW_PRECISION):
        raise ValueError(f"compute_dtype={compute_dtype} must be torch.float32, torch.bfloat16 or torch.float16")
    try:
        kind = OptimizerKind(optimizer_kind)
    except ValueError:
        allowed = ", ".join(repr(k.value) for k in OptimizerKind)
        raise ValueError(f"optimizer_kind={optimizer_kind!r} must be one of {allowed} (or an OptimizerKind)") from None
    if momentum < 0:
        raise ValueError(f"momentum={momentum} must be 0 (plain SGD) or more")
    num_states = len(kind.state_names(momentum)) + (1 if compute_dtype in _LOW_PRECISION else 0)
    param_bytes = torch.empty((), dtype=compute_dtype).element_size()
    return param_bytes, FP32_BYTES, FP32_BYTES * num_states


# -- activations -----------------------------------------------------------------------------------


MAX_MODEL_SIZE = 2**31 - 1
"""The most any one size of a decoder (width, layers, heads, vocabulary) may be: a tensor of such a
dimension already holds 2**31 elements a row; larger is a corrupted or mistyped config."""

_HF_KEYS = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size", "vocab_size": "vocab_size",
}
"""DecoderShape's fields under the names a Hugging Face config.json gives them."""
_FIELD = re.compile(r"(?<!\w)(?:DecoderShape\.)?(" + "|".join(_HF_KEYS) + ")=")


def _check_size(name: str, value: int, least: int) -> None:
    """`value` is one size of a model: an int from `least` to MAX_MODEL_SIZE (10**30 reached torch as
    an overflow with a C++ stack trace)."""
    _check_int(name, value, least, "a size of the model")
    if value > MAX_MODEL_SIZE:
        raise ValueError(f"{name}={value} is beyond any model's size (at most 2**31 - 1)")


def _nan_key(config: Mapping[str, object]) -> Optional[str]:
    """The key of the first NaN in a config read from JSON, through its nested objects and lists
    ("rope_scaling.factor", "layer_types[3]"), or None. A loop, not recursion: json_text reads text
    nested almost as deep as Python's recursion limit."""
    pending: list = [("", config)]
    while pending:
        key, value = pending.pop()
        if isinstance(value, float) and math.isnan(value):
            return key
        if isinstance(value, Mapping):
            pending.extend((f"{key}.{k}" if key else str(k), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            pending.extend((f"{key}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


_HF_POSITIONS_KEY = "max_position_embeddings"
"""The longest sequence a Hugging Face config.json gives: 0 or less was taken for a limit, and the
commands said "set data.seq_len to at most 0", a value they refuse."""


def check_hf_sizes(config: Mapping[str, object]) -> None:
    """ValueError/TypeError naming the key, unless every size a Hugging Face config.json gives (of
    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
    vocab_size, max_position_embeddings) is an int from 1 (num_hidden_layers: 0) to MAX_MODEL_SIZE, and
    num_attention_heads a multiple of num_key_value_heads. Sizes it leaves out are not asked for (not every model is Llama-style). Run before a model is
    built: transformers built one of vocab_size=10**30 into torch's overflow error with its C++ stack trace.
    No value anywhere in it may be NaN (json.loads reads `NaN`, which is no JSON and no setting's value): a
    NaN rms_norm_eps built and loaded, and the first step's loss was NaN, the run's line blaming the learning rate."""
    nan_key = _nan_key(config)
    if nan_key is not None:
        raise ValueError(
            f"the Hugging Face config's {nan_key}=NaN is not a value of any setting (a damaged or hand-edited "
            "config.json): fix config.json, giving it the model's number"
        )
    for key in (*_HF_KEYS.values(), _HF_POSITIONS_KEY):
        value = config.get(key)
        if value is None:
            continue
        try:
            # No layers is a model transformers builds (embeddings and head only); no width or heads is none.
            _check_size(key, value, 0 if key == "num_hidden_layers" else 1)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"the Hugging Face config's {exc}; fix config.json") from None
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        # transformers builds such a model, and loads its weights; its first forward then failed in attention
        # ("The size of tensor a (4) must match the size of tensor b (3)"), a traceback after out_dir was written.
        raise ValueError(
            f"the Hugging Face config's num_attention_heads={heads} is not a multiple of num_key_value_heads="
            f"{kv_heads}: each key/value head serves a whole number of query heads; fix config.json"
        )


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a Llama-style decoder that decide its activation memory (head_dim = dim // n_heads)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            _check_size(f"DecoderShape.{name}", getattr(self, name), 1)
        if self.dim % self.n_heads:
            raise ValueError(f"DecoderShape.dim={self.dim} must be a multiple of n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_decoder_config(cls, config: DecoderConfig) -> DecoderShape:
        assert config.ffn_dim is not None  # set in DecoderConfig.__post_init__
        return cls(config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.ffn_dim, config.vocab_size)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object]) -> DecoderShape:
        """From a Hugging Face (Llama-style) config.json, read as a dict; num_key_value_heads defaults
        to num_attention_heads, as in transformers' LlamaConfig."""

        def get(key: str) -> int:
            if config.get(key) is None:
                raise ValueError(
                    f"the Hugging Face config has no {key!r} (keys: {', '.join(sorted(config))}): "
                    "pass a Llama-style config.json with hidden_size, num_hidden_layers, "
                    "num_attention_heads, intermediate_size and vocab_size"
                )
            return config[key]  # type: ignore[return-value]

        n_heads = get("num_attention_heads")
        n_kv_heads = config.get("num_key_value_heads")
        try:
            return cls(
                dim=get("hidden_size"),
                n_layers=get("num_hidden_layers"),
                n_heads=n_heads,
                n_kv_heads=n_heads if n_kv_heads is None else n_kv_heads,  # type: ignore[arg-type]
                ffn_dim=get("intermediate_size"),
                vocab_size=get("vocab_size"),
            )
        except (TypeError, ValueError) as exc:  # in the config's own names, which the user can find in the file
            text = _FIELD.sub(lambda m: f"{_HF_KEYS[m.group(1)]}=", str(exc))
            raise type(exc)(f"the Hugging Face config's {text}; fix config.json") from None


def activation_bytes(
    shape: DecoderShape, batch_size: int, seq_len: int, dtype_bytes: int, checkpointing: bool,
    device: Optional[torch.device] = None,
) -> int:
    """Bytes autograd keeps for backward in one forward of DecoderLM on [batch_size, seq_len] tokens.

    `dtype_bytes` is the compute dtype's (4 fp32, 2 bf16/fp16). With T = batch_size * seq_len
    tokens, h = dim, k = n_kv_heads * head_dim, f = ffn_dim, a = n_heads, V = vocab_size, p =
    dtype_bytes, what each piece saves:

      RMSNorm       its input as fp32 (4Th; in fp32 the input itself), x / rms before the weight (pTh),
                    1 / rms (4T)
      attention     the q/k/v projections' input (pTh); q and k after RoPE (pTh, pTk) and v (pTk),
                    the output (pTh, also o_proj's input) and the fp32 logsumexp (4aT) for SDPA's
                    fused kernel (flash on the CPU, flash or memory-efficient on CUDA), which keeps
                    no s x s scores (the math fallback would); RoPE saves only its cos/sin tables,
                    shared by every block (2 * seq_len * head_dim * 4)
      SwiGLU        the gate/up input (pTh), silu's input, silu's output and up (3pTf), down's input (pTf)
      head          the final RMSNorm, lm_head's input (pTh), the logits (pTV, returned to the caller,
                    who holds them through backward) and cross-entropy's fp32 log-softmax (4TV)

    so one block keeps T * (p * (6h + 2k + 4f) + 8h + 4a + 8) bytes, and the head
    T * (2ph + 4h + 4 + (p + 4)V). At 16 bits with k = h and f = 8h/3, a block is about
    45·s·b·h + 4·a·s·b against GPT's 34·s·b·h + 5·a·s²·b: more per token (fp32 RMSNorm inputs, four
    f-wide SwiGLU tensors), and no s² term.

    Without checkpointing: n_layers blocks + head + RoPE tables. With checkpointing
    (torch.utils.checkpoint around each block): each block's input (pTh, n_layers of them) + head +
    RoPE tables + one block recomputed in backward, less its input in fp32, where its RMSNorm saves
    the kept input itself. The head's saved tensors, the logits aside, are freed before the first
    recomputation, so this sum exceeds the peak by at most those.
    Left out: token ids and targets (the caller's inputs) and cross-entropy's 4-byte weight sum.
    Grouped k/v (n_kv_heads wide) are counted as SDPA keeps them, unless `device` is given and no
    fused kernel takes them there (torch < 2.9 on the CPU, fp32 on CUDA): DecoderLM then repeats k and
    v to every head (decoder.expands_kv_heads), and each kept block holds them h wide, 2pT(h - k) bytes
    more (`attention_repeats_kv`).
    """
    _check_int("batch_size", batch_size, 1, "sequences per batch")
    _check_int("seq_len", seq_len, 1, "tokens per sequence")
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes={dtype_bytes!r} must be 4 (fp32) or 2 (bf16, fp16)")
    tokens = batch_size * seq_len
    h, k, f, p = shape.dim, shape.n_kv_heads * shape.head_dim, shape.ffn_dim, dtype_bytes
    if device is not None and attention_repeats_kv(shape, dtype_bytes, device):
        k = h
    block = tokens * (p * (6 * h + 2 * k + 4 * f) + 8 * h + 4 * shape.n_heads + 8)
    head = tokens * (2 * p * h + 4 * h + 4 + (p + 4) * shape.vocab_size)
    rope_tables = 2 * seq_len * shape.head_dim * FP32_BYTES
    if not checkpointing:
        return shape.n_layers * block + head + rope_tables
    block_input = p * tokens * h
    recomputed = block - (block_input if p == FP32_BYTES else 0)
    return shape.n_layers * block_input + head + rope_tables + recomputed


_DTYPE_OF_BYTES = {4: torch.float32, 2: torch.bfloat16}
"""The compute dtype SDPA's kernel choice is asked about, by its size (fp16's choices are bf16's)."""


def attention_repeats_kv(shape: DecoderShape, dtype_bytes: int, device: torch.device) -> bool:
    """Whether DecoderLM's attention repeats grouped k and v to every head on `device` in training
    (decoder.expands_kv_heads, asked with small tensors that require grad): then its blocks keep k and
    v h wide, not n_kv_heads * head_dim."""
    if shape.n_kv_heads == shape.n_heads or device.type == "meta":
        return False
    with torch.enable_grad():
        q = torch.empty(
            1, shape.n_heads, 16, shape.head_dim, dtype=_DTYPE_OF_BYTES[dtype_bytes], device=device, requires_grad=True
        )
        return expands_kv_heads(q, q[:, : shape.n_kv_heads])
