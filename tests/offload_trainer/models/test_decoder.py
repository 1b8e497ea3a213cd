"""DecoderLM: shapes, numerics against plain PyTorch, init, meta construction, tying, checkpointing."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from offload_trainer.models import PRESETS, DecoderConfig, DecoderLM, RMSNorm, init_weights, num_params
from offload_trainer.models.decoder import Attention, apply_rotary, default_ffn_dim, rotary_cos_sin

TINY = DecoderConfig.preset("tiny")


def make_model(config: DecoderConfig = TINY, seed: int = 0, **kwargs) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(config, **kwargs)


def batch(
    config: DecoderConfig = TINY, size: tuple[int, int] = (2, 17), seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, size, generator=g)
    return data[:, :-1], data[:, 1:]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


# --- config ---------------------------------------------------------------------------------------


def test_default_ffn_dim_follows_llama_rule() -> None:
    assert default_ffn_dim(4096) == 11008
    assert default_ffn_dim(5120) == 13824
    assert default_ffn_dim(64) == 256
    assert DecoderConfig(vocab_size=8, dim=4096, n_layers=1, n_heads=32, n_kv_heads=32).ffn_dim == 11008
    for name, shape in PRESETS.items():
        if name != "70b":  # Llama-2 70B uses ffn_dim_multiplier=1.3
            assert shape["ffn_dim"] == default_ffn_dim(shape["dim"]), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(dim=66), "multiple of n_heads"),
        (dict(dim=12, n_heads=4, n_kv_heads=2), "odd"),
        (dict(n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(n_layers=0), "n_layers=0"),
        (dict(ffn_dim=-1), "ffn_dim=-1"),
        (dict(norm_eps=0.0), "norm_eps"),
    ],
)
def test_config_rejects_bad_shapes(overrides: dict, message: str) -> None:
    shape = {**PRESETS["tiny"], **overrides}
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**shape)


def test_unknown_preset_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="tiny, small, 125m"):
        DecoderConfig.preset("3b")


def test_preset_overrides() -> None:
    config = DecoderConfig.preset("7b", max_seq_len=1024, tie_embeddings=True)
    assert (config.dim, config.max_seq_len, config.tie_embeddings) == (4096, 1024, True)


# --- parameter count ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config", [TINY, DecoderConfig.preset("small"), DecoderConfig.preset("tiny", tie_embeddings=True)]
)
def test_num_params_equals_real_count(config: DecoderConfig) -> None:
    model = DecoderLM(config)
    assert num_params(config) == sum(p.numel() for p in model.parameters())


def test_num_params_of_every_preset_on_meta() -> None:
    for name in PRESETS:
        config = DecoderConfig.preset(name)
        with torch.device("meta"):
            model = DecoderLM(config)
        assert num_params(config) == sum(p.numel() for p in model.parameters()), name
    assert num_params(DecoderConfig.preset("7b")) == 6_738_415_616  # Llama-2 7B's published count


# --- forward --------------------------------------------------------------------------------------


def test_shapes_and_loss() -> None:
    model = make_model()
    inputs, targets = batch()
    logits = model(inputs)
    assert logits.shape == (2, 16, TINY.vocab_size)
    logits2, loss = model(inputs, targets=targets)
    assert torch.equal(logits, logits2)
    assert loss.shape == () and torch.isfinite(loss)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, TINY.vocab_size), targets.reshape(-1)))
    # At init the prediction is near uniform.
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.1


def test_is_causal() -> None:
    model = make_model()
    inputs, _ = batch()
    changed = inputs.clone()
    changed[:, 10] = (changed[:, 10] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(inputs), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_sequence_longer_than_max_seq_len_is_refused() -> None:
    model = make_model(DecoderConfig.preset("tiny", max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_rmsnorm_matches_formula() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.data.normal_()
    x = torch.randn(3, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_attention_matches_plain_pytorch() -> None:
    torch.manual_seed(0)
    dim, n_heads, n_kv_heads, seq_len = 32, 4, 2, 7
    attn = Attention(dim, n_heads, n_kv_heads, out_init_std=0.02)
    for module in attn.modules():
        init_weights(module)
    x = torch.randn(2, seq_len, dim)
    cos, sin = rotary_cos_sin(seq_len, dim // n_heads, 10000.0, x.device)

    # Reference: rotate q/k with complex numbers, repeat kv heads, masked softmax.
    def heads(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.view(2, seq_len, n, dim // n_heads).transpose(1, 2)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        angles = torch.outer(torch.arange(seq_len).float(), 10000.0 ** (-torch.arange(half).float() / half))
        z = torch.complex(t[..., :half], t[..., half:]) * torch.polar(torch.ones_like(angles), angles)
        return torch.cat([z.real, z.imag], dim=-1)

    q = rotate(heads(attn.q_proj(x), n_heads))
    k = rotate(heads(attn.k_proj(x), n_kv_heads)).repeat_interleave(n_heads // n_kv_heads, dim=1)
    v = heads(attn.v_proj(x), n_kv_heads).repeat_interleave(n_heads // n_kv_heads, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dim // n_heads)
    scores = scores.masked_fill(torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, seq_len, dim))

    torch.testing.assert_close(attn(x, cos, sin), expected)


def test_grouped_attention_where_no_fused_kernel_takes_grouped_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch < 2.9 on the CPU (and CUDA in fp32) has no fused kernel for grouped k/v: SDPA's math
    # kernel would keep s x s scores for backward. Attention then repeats k/v itself, for the same
    # outputs and gradients, and keeps no s x s tensor. The choice is emulated here as torch 2.6 makes it.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import offload_trainer.models.decoder as decoder

    def choice_of_torch_2_6(q, k, v, *args, enable_gqa: bool = False, **kwargs) -> int:
        return int(SDPBackend.MATH if enable_gqa and k.shape[1] != q.shape[1] else SDPBackend.FLASH_ATTENTION)

    sdpa = F.scaled_dot_product_attention

    def sdpa_of_torch_2_6(q, k, v, *args, enable_gqa: bool = False, **kwargs) -> torch.Tensor:
        if enable_gqa and k.shape[1] != q.shape[1]:
            with sdpa_kernel(SDPBackend.MATH):
                return sdpa(q, k, v, *args, enable_gqa=True, **kwargs)
        return sdpa(q, k, v, *args, **kwargs)

    torch.manual_seed(0)
    dim, n_heads, n_kv_heads, seq_len = 32, 4, 2, 48
    attn = Attention(dim, n_heads, n_kv_heads, out_init_std=0.02)
    x = torch.randn(2, seq_len, dim, requires_grad=True)
    cos, sin = rotary_cos_sin(seq_len, dim // n_heads, 10000.0, x.device)
    expected = attn(x, cos, sin)
    expected_grads = torch.autograd.grad(expected.square().sum(), [x, *attn.parameters()])

    monkeypatch.setattr(decoder, "_fused_sdp_choice", choice_of_torch_2_6)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa_of_torch_2_6)
    saved_shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved_shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attn(x, cos, sin)
    assert not [s for s in saved_shapes if s[-2:] == (seq_len, seq_len)], saved_shapes
    assert (2, n_heads, seq_len, dim // n_heads) in saved_shapes  # k and v, repeated to every head
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out.square().sum(), [x, *attn.parameters()]), expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_rotary_scores_depend_only_on_relative_position() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(16), torch.randn(16)
    cos, sin = rotary_cos_sin(12, 16, 10000.0, torch.device("cpu"))

    def score(i: int, j: int) -> torch.Tensor:
        qi = apply_rotary(q.view(1, 1, 1, 16), cos[i], sin[i])
        kj = apply_rotary(k.view(1, 1, 1, 16), cos[j], sin[j])
        return (qi * kj).sum()

    torch.testing.assert_close(score(5, 2), score(11, 8))
    torch.testing.assert_close(score(0, 0), (q * k).sum())


# --- training -------------------------------------------------------------------------------------


def test_overfits_one_batch() -> None:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = batch(size=(4, 33))
    losses = []
    for _ in range(20):
        _, loss = model(inputs, targets=targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_forward_does_not_touch_parameters_and_model_has_no_buffers() -> None:
    model = make_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    _, loss = model(*batch())
    loss.backward()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert list(model.buffers()) == []  # RoPE is computed on the fly, never stored
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


# --- activation checkpointing ---------------------------------------------------------------------


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_activation_checkpointing_is_bitwise_identical(tie_embeddings: bool) -> None:
    config = DecoderConfig.preset("tiny", tie_embeddings=tie_embeddings)
    plain = make_model(config)
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing = True
    inputs, targets = batch()

    calls: list[str] = []
    # A pre-hook: the recomputation stops as soon as it has what backward needs (checkpoint's
    # early stop), so a block's forward post-hooks are not guaranteed to fire a second time.
    checkpointed.layers[0].register_forward_pre_hook(lambda *_: calls.append("layers.0"))

    _, loss_plain = plain(inputs, targets=targets)
    loss_plain.backward()
    _, loss_ckpt = checkpointed(inputs, targets=targets)
    assert calls == ["layers.0"]
    loss_ckpt.backward()
    assert calls == ["layers.0", "layers.0"]  # recomputed in backward

    assert torch.equal(loss_plain, loss_ckpt)
    grads_plain, grads_ckpt = grads(plain), grads(checkpointed)
    for name, grad in grads_plain.items():
        assert grad is not None and torch.equal(grad, grads_ckpt[name]), name


def test_activation_checkpointing_constructor_arg() -> None:
    assert make_model(activation_checkpointing=True).activation_checkpointing
    assert not make_model().activation_checkpointing


# --- tied embeddings ------------------------------------------------------------------------------


def test_tied_embeddings_share_one_parameter() -> None:
    config = DecoderConfig.preset("tiny", tie_embeddings=True)
    model = make_model(config)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert len(list(model.parameters())) == len(list(make_model().parameters())) - 1
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "embed_tokens.weight" in names  # listed once
    # Gradient is the sum of both uses.
    _, loss = model(*batch())
    loss.backward()
    assert model.embed_tokens.weight.grad is model.lm_head.weight.grad
    # Survives moves that make new Parameters (to_empty) and a state_dict round trip.
    model.to_empty(device="cpu")
    assert model.lm_head.weight is model.embed_tokens.weight
    clone = DecoderLM(config)
    clone.load_state_dict(make_model(config).state_dict())
    assert clone.lm_head.weight is clone.embed_tokens.weight


# --- init and meta construction -------------------------------------------------------------------


def test_init_statistics() -> None:
    model = make_model(DecoderConfig.preset("small"))
    out_std = 0.02 / math.sqrt(2 * 6)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            expected = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            assert abs(p.std().item() - expected) < 0.1 * expected, name
            assert abs(p.mean().item()) < 0.1 * expected, name


def test_meta_construction_where_get_default_device_misses_the_device_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch < 2.8 answers torch.get_default_device() with "cpu" inside `with torch.device("meta"):`
    # (pytorch#148621); the model built there must still be on meta, not materialised in host memory.
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("cpu"))
    with torch.device("meta"):
        model = DecoderLM(DecoderConfig.preset("tiny"))
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_meta_construction_then_init_equals_direct_construction(tie_embeddings: bool) -> None:
    config = DecoderConfig.preset("tiny", tie_embeddings=tie_embeddings)
    direct = make_model(config, seed=123)

    with torch.device("meta"):
        meta = DecoderLM(config)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(123)
    # One module at a time, as an engine materialising block by block would.
    for module in meta.modules():
        init_weights(module)

    assert (meta.lm_head.weight is meta.embed_tokens.weight) == tie_embeddings
    for (name, a), (_, b) in zip(direct.named_parameters(), meta.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    inputs, targets = batch()
    _, loss = meta(inputs, targets=targets)
    loss.backward()
    assert torch.isfinite(loss) and torch.equal(loss, direct(inputs, targets=targets)[1])


def test_construction_is_deterministic_from_the_global_seed() -> None:
    a, b, c = make_model(seed=7), make_model(seed=7), make_model(seed=8)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.layers[0].self_attn.q_proj.weight, c.layers[0].self_attn.q_proj.weight)
