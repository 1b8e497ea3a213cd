"""MoEDecoderLM: routing against a dense reference, data-dependent module order, sparse gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from offload_trainer.models import DecoderConfig, MoEConfig, MoEDecoderLM, MoEFeedForward, init_weights, num_params

CONFIG = MoEConfig()


def make_model(config: MoEConfig = CONFIG, seed: int = 0, **kwargs) -> MoEDecoderLM:
    torch.manual_seed(seed)
    return MoEDecoderLM(config, **kwargs)


def batch(size: tuple[int, int] = (2, 17), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, CONFIG.vocab_size, size, generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


def record_experts(model: MoEDecoderLM) -> list[str]:
    """Forward hooks on every expert; returns the list they append 'layers.L.experts.E' to, in call order."""
    ran: list[str] = []
    for name, module in model.named_modules():
        if ".experts." in name and name.count(".") == 4:  # layers.L.mlp.experts.E
            module.register_forward_hook(lambda *_, name=name: ran.append(name))
    return ran


def test_defaults_are_tiny_and_counted() -> None:
    model = make_model()
    assert (CONFIG.dim, CONFIG.n_layers, CONFIG.n_experts, CONFIG.vocab_size) == (32, 2, 4, 64)
    assert len(model.layers[0].mlp.experts) == 4
    assert num_params(CONFIG) == sum(p.numel() for p in model.parameters())
    tied = MoEConfig(tie_embeddings=True, top_k=2)
    assert num_params(tied) == sum(p.numel() for p in make_model(tied).parameters())


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="top_k=5"):
        MoEConfig(top_k=5)
    with pytest.raises(ValueError, match="n_experts=0"):
        MoEConfig(n_experts=0, top_k=1)
    with pytest.raises(TypeError, match="MoEConfig"):
        MoEDecoderLM(DecoderConfig.preset("tiny"))
    assert MoEConfig.preset("7b").ffn_dim == 11008  # preset shapes, experts as wide as the dense MLP


def test_shapes_and_loss() -> None:
    model = make_model()
    inputs, targets = batch()
    logits, loss = model(inputs, targets=targets)
    assert logits.shape == (2, 16, CONFIG.vocab_size)
    assert torch.isfinite(loss) and abs(loss.item() - math.log(CONFIG.vocab_size)) < 0.1
    assert torch.equal(model(inputs), logits)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_layer_matches_dense_reference(top_k: int) -> None:
    """Dispatching tokens to experts equals running every expert on every token and mixing by gate."""
    torch.manual_seed(0)
    config = MoEConfig(top_k=top_k)
    layer = MoEFeedForward(config)
    for module in layer.modules():
        init_weights(module)
    x = torch.randn(3, 5, config.dim)

    probs = torch.softmax(layer.router(x), dim=-1)
    gate, chosen = probs.topk(top_k, dim=-1)
    if top_k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(-1, chosen, gate)  # [B, T, n_experts], zero off the top_k
    every_expert = torch.stack([expert(x) for expert in layer.experts], dim=-2)  # [B, T, n_experts, dim]
    expected = (weights.unsqueeze(-1) * every_expert).sum(-2)

    torch.testing.assert_close(layer(x), expected)


def test_different_batches_run_different_experts() -> None:
    model = make_model()
    ran = record_experts(model)

    # A sequence repeating one token keeps every position identical through attention, so each
    # block sends all its tokens to one expert: one expert per layer runs.
    expert_sets: dict[int, tuple[str, ...]] = {}
    for token in range(CONFIG.vocab_size):
        ran.clear()
        with torch.no_grad():
            model(torch.full((2, 8), token))
        assert len(ran) == CONFIG.n_layers, ran
        expert_sets[token] = tuple(ran)
    distinct = set(expert_sets.values())
    assert len(distinct) >= 2, distinct

    # A batch of varied tokens runs several experts per layer, in ascending order within a layer.
    ran.clear()
    with torch.no_grad():
        model(batch(size=(4, 33))[0])
    assert len(ran) > CONFIG.n_layers
    assert ran == sorted(ran)


def test_only_experts_that_ran_get_gradients() -> None:
    model = make_model()
    ran = record_experts(model)
    _, loss = model(torch.full((2, 8), 3), targets=torch.full((2, 8), 5))
    loss.backward()
    assert len(ran) == CONFIG.n_layers
    for layer_id, layer in enumerate(model.layers):
        assert layer.mlp.router.weight.grad is not None  # the gate weight is the chosen expert's probability
        for expert_id, expert in enumerate(layer.mlp.experts):
            expected_to_run = f"layers.{layer_id}.mlp.experts.{expert_id}" in ran
            for name, p in expert.named_parameters():
                assert (p.grad is not None) == expected_to_run, (layer_id, expert_id, name)
                if expected_to_run:
                    assert p.grad.abs().sum() > 0


def test_activation_checkpointing_is_bitwise_identical() -> None:
    plain = make_model()
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing = True
    inputs, targets = batch()
    _, loss_plain = plain(inputs, targets=targets)
    _, loss_ckpt = checkpointed(inputs, targets=targets)
    loss_plain.backward()
    loss_ckpt.backward()
    assert torch.equal(loss_plain, loss_ckpt)
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name


def test_meta_construction_then_init_equals_direct_construction() -> None:
    direct = make_model(seed=5)
    with torch.device("meta"):
        meta = MoEDecoderLM(CONFIG)
    meta.to_empty(device="cpu")
    torch.manual_seed(5)
    meta.reset_parameters()
    for (name, a), (_, b) in zip(direct.named_parameters(), meta.named_parameters(), strict=True):
        assert torch.equal(a, b), name


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
