"""zero_memory: ZeRO's per-rank model-state bytes and the decoder's activation bytes, on paper and measured.

The ZeRO paper's Figure 1 and hand-computed cases; the homes this engine's memory plan allocates
(above the stage-3 figure by at most the partition's alignment padding, on meta-device models); and
the activation formula against the bytes autograd saves, measured with saved_tensors_hooks on small
decoders. Run: python3 -m pytest -q tests/offload_trainer/planning/test_zero_memory.py
"""

from __future__ import annotations

from typing import Dict, Set

import pytest
import torch

from offload_trainer.config import ComputeDtype, OffloadConfig, OptimizerConfig, OptimizerKind, PrecisionConfig
from offload_trainer.runtime.layout.memory_plan import plan_memory
from offload_trainer.models import DecoderConfig, DecoderLM
from offload_trainer.runtime.layout.partition import PARAM_ALIGN_BYTES, plan_partition
from offload_trainer.planning.zero_memory import (
    DecoderShape,
    ZeroBytes,
    activation_bytes,
    training_bytes_per_element,
    zero_bytes_per_rank,
)

GB = 10**9
"""The paper's GB."""

# -- ZeRO on paper ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_paper_figure_1(stage: int, expected_gb: float) -> None:
    # Ψ = 7.5B parameters, N_d = 64 ranks, mixed-precision Adam (2 + 2 + 12 bytes per parameter).
    assert round(zero_bytes_per_rank(7_500_000_000, 64, stage, 2, 2, 12).total_bytes / GB, 1) == expected_gb


@pytest.mark.parametrize(
    "numel, world_size, stage, per_element, expected",
    [
        # ceil(1000 / 3) = 334 elements per rank once partitioned.
        (1000, 3, 0, (2, 2, 12), ZeroBytes(2000, 2000, 12000)),
        (1000, 3, 1, (2, 2, 12), ZeroBytes(2000, 2000, 334 * 12)),
        (1000, 3, 2, (2, 2, 12), ZeroBytes(2000, 334 * 2, 334 * 12)),
        (1000, 3, 3, (2, 2, 12), ZeroBytes(334 * 2, 334 * 2, 334 * 12)),
        # fp32 AdamW in this engine; ceil(10 / 4) = 3.
        (10, 4, 1, (4, 4, 8), ZeroBytes(40, 40, 24)),
        (10, 4, 3, (4, 4, 8), ZeroBytes(12, 12, 24)),
        # More ranks than elements: each still holds one whole element.
        (7, 8, 3, (2, 4, 12), ZeroBytes(2, 4, 12)),
        (0, 8, 3, (2, 4, 12), ZeroBytes(0, 0, 0)),
    ],
)
def test_hand_computed_cases(
    numel: int, world_size: int, stage: int, per_element: tuple, expected: ZeroBytes
) -> None:
    assert zero_bytes_per_rank(numel, world_size, stage, *per_element) == expected


@pytest.mark.parametrize("numel", [1, 12345, 7_500_000_000])
def test_stage_3_on_one_rank_is_the_baseline(numel: int) -> None:
    assert zero_bytes_per_rank(numel, 1, 3, 2, 4, 12) == zero_bytes_per_rank(numel, 8, 0, 2, 4, 12)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((-1, 1, 3, 2, 2, 12), ValueError, "numel=-1 must be at least 0"),
        ((7.5e9, 1, 3, 2, 2, 12), TypeError, r"int\(7.5e9\)"),
        ((10, 0, 3, 2, 2, 12), ValueError, "world_size=0 must be at least 1"),
        ((10, 1, 4, 2, 2, 12), ValueError, "stage=4 must be 0"),
        ((10, 1, 3, 2, -2, 12), ValueError, "grad_bytes=-2"),
    ],
)
def test_bad_arguments_say_what_to_pass(args: tuple, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        zero_bytes_per_rank(*args)


@pytest.mark.parametrize(
    "dtype, kind, momentum, expected",
    [
        (torch.float32, OptimizerKind.ADAMW, 0.9, (4, 4, 8)),
        (torch.bfloat16, OptimizerKind.ADAMW, 0.9, (2, 4, 12)),  # the paper's K = 12
        (torch.float16, "sgd", 0.9, (2, 4, 8)),
        (torch.float32, "sgd", 0.0, (4, 4, 0)),
        (torch.bfloat16, OptimizerKind.SGD, 0.0, (2, 4, 4)),  # the master copy only
    ],
)
def test_training_bytes_per_element(dtype: torch.dtype, kind: object, momentum: float, expected: tuple) -> None:
    assert training_bytes_per_element(dtype, kind, momentum) == expected  # type: ignore[arg-type]


def test_training_bytes_per_element_refuses_what_the_engine_has_not() -> None:
    with pytest.raises(ValueError, match="optimizer_kind='adam' must be one of 'adamw', 'sgd'"):
        training_bytes_per_element(torch.float32, "adam", 0.9)
    with pytest.raises(ValueError, match="compute_dtype=torch.float64"):
        training_bytes_per_element(torch.float64, OptimizerKind.ADAMW, 0.9)


# -- ZeRO against this engine's memory plan ----------------------------------------------------------

ALIGN_NUMEL = 1024
"""What engine.py passes to plan_partition."""

ENGINE_MODELS = {
    "tiny": DecoderConfig.preset("tiny"),
    "tiny, wider, 3 layers, tied": DecoderConfig.preset("tiny", dim=96, n_layers=3, ffn_dim=200, tie_embeddings=True),
}
OPTIMIZERS = {"adamw": OptimizerConfig(), "sgd without momentum": OptimizerConfig(kind=OptimizerKind.SGD, momentum=0.0)}


@pytest.mark.parametrize("model_name", ENGINE_MODELS)
@pytest.mark.parametrize("compute", [ComputeDtype.FP32, ComputeDtype.BF16])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_engine_homes_exceed_stage_3_by_at_most_the_padding(
    model_name: str, compute: ComputeDtype, optimizer: str, world_size: int
) -> None:
    with torch.device("meta"):  # partitioning and planning are pure: no parameter memory needed
        model = DecoderLM(ENGINE_MODELS[model_name])
    config = OffloadConfig(precision=PrecisionConfig(compute_dtype=compute), optimizer=OPTIMIZERS[optimizer])
    partition = plan_partition(model, config.grouping, world_size=world_size, align_numel=ALIGN_NUMEL)
    numel = sum(p.numel() for p in model.parameters())  # every parameter is trainable
    per_element = training_bytes_per_element(compute.torch_dtype, config.optimizer.kind, config.optimizer.momentum)
    paper = zero_bytes_per_rank(numel, world_size, 3, *per_element)
    # A group's flat buffer is padded up to a multiple of world_size * ALIGN_NUMEL: less than that
    # many elements in all, so less than ALIGN_NUMEL above the rank's even share of the group; and
    # each parameter starts PARAM_ALIGN_BYTES aligned ([Note: Parameter alignment]), a gap of less
    # than that before each.
    gaps = sum(g.trainable_numel for g in partition.groups) - numel
    assert 0 <= gaps < sum(len(g.params) for g in partition.groups) * PARAM_ALIGN_BYTES // compute.torch_dtype.itemsize
    pad_numel = len(partition.groups) * ALIGN_NUMEL + gaps

    homes = []
    for rank in range(world_size):
        plan = plan_memory(partition, config, rank, compute.torch_dtype, device_is_host=True)
        param_bytes = torch.empty((), dtype=plan.param_dtype).element_size()
        trainable_numel = sum(plan.local_trainable_numel)
        home = ZeroBytes(
            sum(g.shard_numel for g in partition.groups) * param_bytes,
            trainable_numel * 4,  # fp32 gradient shards
            trainable_numel * 4 * len(plan.optimizer_states),  # fp32 states
        )
        homes.append(home)
        assert (param_bytes, 4, 4 * len(plan.optimizer_states)) == per_element
        assert paper.params_bytes <= home.params_bytes <= paper.params_bytes + pad_numel * per_element[0]
        assert home.grads_bytes <= paper.grads_bytes + pad_numel * per_element[1]
        assert home.optimizer_bytes <= paper.optimizer_bytes + pad_numel * per_element[2]
    # Gradients and optimizer states cover only the trainable elements, which start each group's
    # buffer: rank 0 holds the most of them (at least the even share), later ranks less.
    assert homes[0].grads_bytes >= paper.grads_bytes and homes[0].optimizer_bytes >= paper.optimizer_bytes
    assert sum(h.grads_bytes for h in homes) == (numel + gaps) * per_element[1]
    assert sum(h.optimizer_bytes for h in homes) == (numel + gaps) * per_element[2]


# -- activations -----------------------------------------------------------------------------------

REL_TOL = 0.01
"""The formula counts every saved tensor, so it matches to the byte but for cross-entropy's 4-byte
weight sum. 1% leaves room for such scalars and nothing more: a change in what autograd keeps (SDPA
falling back to its math kernel and keeping s x s scores, a linear saving a copy of its input) moves
these shapes by 10% or more."""

ACTIVATION_SHAPES = {
    "tiny (GQA)": (DecoderConfig.preset("tiny"), 2, 32),
    "MHA, odd sizes": (
        DecoderConfig(vocab_size=100, dim=48, n_layers=3, n_heads=3, n_kv_heads=3, ffn_dim=136, max_seq_len=64),
        3,
        40,
    ),
    # seq_len well above dim: s x s attention scores would add about as much as a whole block.
    "long sequence": (
        DecoderConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=256),
        1,
        256,
    ),
}


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _record_saved(into: Dict[int, int], excluded: Set[int]) -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks that record the bytes of each storage autograd saves, once per storage (by address),
    skipping `excluded`. A saved tensor stays alive until backward, so no address is reused."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _ptr(t) not in excluded:
            into[_ptr(t)] = t.untyped_storage().nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def measured_activation_bytes(
    config: DecoderConfig, batch_size: int, seq_len: int, dtype: torch.dtype, checkpointing: bool
) -> int:
    """Bytes of the storages autograd saves in a forward with the loss, plus the logits the caller holds.

    Under checkpointing, the checkpoint's own hooks hide the saves inside each block; what it keeps
    (each block's input) is saved under ours. Backward then recomputes one block at a time, first
    the last: we replay that block on the input the checkpoint kept and add what it saves. The sum,
    the end of forward plus one recomputed block, is what activation_bytes counts.
    """
    torch.manual_seed(0)
    model = DecoderLM(config, activation_checkpointing=checkpointing).to(dtype)
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    targets = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    excluded = {_ptr(t) for t in (tokens, targets, *model.parameters())}
    last_block_args = []
    model.layers[-1].register_forward_pre_hook(lambda module, args: last_block_args.append(args))
    saved: Dict[int, int] = {}
    with _record_saved(saved, excluded):
        logits, _ = model(tokens, targets)
    saved[_ptr(logits)] = logits.untyped_storage().nbytes()
    if checkpointing:
        with _record_saved(saved, excluded):
            model.layers[-1](*last_block_args[0])
    return sum(saved.values())


@pytest.mark.parametrize("shape_name", ACTIVATION_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
def test_activation_bytes_match_what_autograd_saves(shape_name: str, dtype: torch.dtype, checkpointing: bool) -> None:
    config, batch_size, seq_len = ACTIVATION_SHAPES[shape_name]
    measured = measured_activation_bytes(config, batch_size, seq_len, dtype, checkpointing)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    shape = DecoderShape.from_decoder_config(config)
    # Told the device, the estimate knows whether attention repeats k and v to every head there
    # (torch < 2.9 on the CPU): then each block it keeps holds them h wide rather than k wide.
    estimate = activation_bytes(shape, batch_size, seq_len, dtype_bytes, checkpointing, torch.device("cpu"))
    assert estimate == pytest.approx(measured, rel=REL_TOL)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
def test_activation_bytes_count_repeated_kv_where_attention_repeats_them(
    monkeypatch: pytest.MonkeyPatch, checkpointing: bool
) -> None:
    """Where no fused kernel takes grouped k/v (torch < 2.9 on the CPU, fp32 on CUDA), every kept
    block holds k and v h wide: 2pT(h - k) bytes more each. The planner (planning/model_spec.py's
    activations) and the fit check pass their device, so they count it."""
    import offload_trainer.planning.zero_memory as zero_memory
    from offload_trainer.planning.model_spec import MicroBatch, ModelSpec, activations

    config = DecoderConfig.preset("small")
    shape = DecoderShape.from_decoder_config(config)
    cpu = torch.device("cpu")
    grouped = activation_bytes(shape, 2, 64, 4, checkpointing)
    monkeypatch.setattr(zero_memory, "expands_kv_heads", lambda q, k: True)
    assert zero_memory.attention_repeats_kv(shape, 4, cpu)
    repeated = activation_bytes(shape, 2, 64, 4, checkpointing, cpu)
    kept_blocks = 1 if checkpointing else config.n_layers
    assert repeated - grouped == kept_blocks * 2 * 4 * 2 * 64 * (shape.dim - shape.n_kv_heads * shape.head_dim)
    spec = ModelSpec.from_preset("small", activation_checkpointing=checkpointing)
    assert activations(spec, OffloadConfig(), MicroBatch(2, 64), checkpointing, cpu) == repeated
    monkeypatch.setattr(zero_memory, "expands_kv_heads", lambda q, k: False)
    assert activations(spec, OffloadConfig(), MicroBatch(2, 64), checkpointing, cpu) == grouped
    full = DecoderShape(shape.dim, shape.n_layers, shape.n_heads, shape.n_heads, shape.ffn_dim, shape.vocab_size)
    assert not zero_memory.attention_repeats_kv(full, 4, cpu)  # nothing to repeat


def test_activation_bytes_refuses_other_dtype_sizes() -> None:
    shape = DecoderShape.from_decoder_config(DecoderConfig.preset("tiny"))
    with pytest.raises(ValueError, match="dtype_bytes=8 must be 4 .fp32. or 2"):
        activation_bytes(shape, 1, 16, 8, False)
    with pytest.raises(ValueError, match="seq_len=0 must be at least 1"):
        activation_bytes(shape, 1, 0, 4, False)


LLAMA_2_7B_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-05,
    "vocab_size": 32000,
}


def test_shape_from_hf_config_is_the_preset() -> None:
    expected = DecoderShape.from_decoder_config(DecoderConfig.preset("7b"))
    assert DecoderShape.from_hf_config(LLAMA_2_7B_CONFIG_JSON) == expected
    without_kv_heads = {k: v for k, v in LLAMA_2_7B_CONFIG_JSON.items() if k != "num_key_value_heads"}
    assert DecoderShape.from_hf_config(without_kv_heads) == expected  # defaults to num_attention_heads


def test_shape_from_hf_config_names_the_missing_key() -> None:
    config = {k: v for k, v in LLAMA_2_7B_CONFIG_JSON.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="has no 'intermediate_size'"):
        DecoderShape.from_hf_config(config)
