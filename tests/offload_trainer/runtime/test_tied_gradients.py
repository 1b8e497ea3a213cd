"""A tied parameter's gradient is summed in place: [Note: Summing a tied parameter's gradient in place].

Plain PyTorch sums a tied embedding's two contributions (the head's, a view, and the lookup's) into
a third tensor of the weight's size; under the engine the sum is made in the memory of the first
contribution, so one weight-sized tensor fewer is alive at the end of backward (147 MiB on
gpt2-124m), and the values stay plain PyTorch's bit for bit (test_engine_parity.py's tied cases).
"""

from __future__ import annotations

from typing import Any, List, Set

import pytest
import torch
from torch import nn

import offload_trainer as ot
from offload_trainer.runtime.tied_gradients import TiedGradients

VOCAB, DIM = 64, 16


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


def _feeders(loss: torch.Tensor, weight: torch.Tensor) -> List[Any]:
    """The nodes of `loss`'s graph whose gradients flow into `weight`'s AccumulateGrad."""
    out, seen, stack = [], {loss.grad_fn}, [loss.grad_fn]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if type(nxt).__name__ == "AccumulateGrad":
                if nxt.variable is weight:
                    out.append(node)
            elif nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return out


def _sum_lands_in_a_contribution(backward: Any, model: TiedLM, loss: torch.Tensor) -> bool:
    """Whether the summed gradient autograd hands the tied weight lives in the memory of one of its
    contributions (in place) rather than in a tensor of its own."""
    weight = model.emb.weight
    contributions: Set[int] = set()
    summed: List[int] = []

    def record(grad_inputs: Any, grad_outputs: Any) -> None:
        contributions.update(g.data_ptr() for g in grad_inputs if g is not None and g.shape == weight.shape)

    feeders = _feeders(loss, weight)
    assert len(feeders) == 2, "the head's and the lookup's"
    for node in feeders:
        node.register_hook(record)
    handle = weight.register_hook(lambda g: summed.append(g.data_ptr()))
    try:
        backward(loss)
    finally:
        handle.remove()
    assert len(contributions) == 2 and len(summed) == 1
    return summed[0] in contributions


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def test_plain_pytorch_sums_a_tied_weight_into_a_third_tensor() -> None:
    """What the engine improves on: without the hooks the sum is a tensor of its own (if torch
    starts summing in place by itself, this fails and the hooks can go)."""
    torch.manual_seed(0)
    model = TiedLM()
    loss = model(_tokens()).square().mean()
    assert not _sum_lands_in_a_contribution(lambda l: l.backward(), model, loss)


def test_the_hooks_make_the_sum_in_place_with_the_same_values() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    ref = TiedLM()
    ref.load_state_dict(model.state_dict())
    ref.head.weight = ref.emb.weight
    ref(_tokens()).square().mean().backward()

    tied = TiedGradients(model)
    loss = model(_tokens()).square().mean()

    def backward(l: torch.Tensor) -> None:
        assert tied.sum_in_place(l) == 2
        l.backward()

    assert _sum_lands_in_a_contribution(backward, model, loss)
    assert torch.equal(model.emb.weight.grad, ref.emb.weight.grad)


def test_a_model_without_tied_parameters_gets_no_walk() -> None:
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB))
    loss = model(_tokens()).sum()
    assert not TiedGradients(model).any
    assert TiedGradients(model).sum_in_place(loss) == 0


def test_a_gradient_that_requires_grad_keeps_its_graph() -> None:
    """create_graph=True: the contributions carry their own graph, which a detach would cut (the
    second derivative through the head's contribution would be lost)."""

    def second_derivative(hooked: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = TiedLM()
        loss = model(_tokens()).square().mean()
        if hooked:
            TiedGradients(model).sum_in_place(loss)
        (grad,) = torch.autograd.grad(loss, [model.emb.weight], create_graph=True)
        (again,) = torch.autograd.grad(grad.square().sum(), [model.emb.weight])
        return again

    assert torch.equal(second_derivative(True), second_derivative(False))


@pytest.mark.parametrize("params", ["device", "nvme"])
def test_the_engine_sums_a_tied_weight_in_place(tmp_path, params: str) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    engine = ot.initialize(model, ot.OffloadConfig(tiers=dict(params=params, grads="host", optimizer="host",
                                                               nvme_dir=str(tmp_path))))
    try:
        loss = engine(_tokens()).square().mean()
        assert _sum_lands_in_a_contribution(engine.backward, model, loss)
    finally:
        engine.close()


def test_the_layer_major_schedule_sums_a_tied_weight_in_place(tmp_path) -> None:
    """Layer-major's begin piece is the one backward call where the head's and the lookup's uses of a tied
    embedding meet ([Note: Tied weights] in layer_major.py): its sum is made in place there too, and the
    values stay plain PyTorch's (test_layer_major.py's tied cases)."""
    from offload_trainer.models import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=VOCAB, dim=DIM, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, tie_embeddings=True))
    weight = model.embed_tokens.weight
    contributions: Set[int] = set()
    summed: List[int] = []

    def record(grad_inputs: Any, grad_outputs: Any) -> None:
        contributions.update(g.data_ptr() for g in grad_inputs if g is not None and g.shape == weight.shape)

    with ot.initialize(model, ot.OffloadConfig(tiers=dict(params="host", grads="host", optimizer="host"))) as engine:
        backward_piece = engine.layer_major._backward_piece

        def spied(outputs: List[torch.Tensor], *rest: Any, **named: Any) -> Any:
            for out in outputs:
                for node in _feeders(out, weight) if out.grad_fn is not None else ():
                    node.register_hook(record)
            return backward_piece(outputs, *rest, **named)

        engine.layer_major._backward_piece = spied
        handle = weight.register_hook(lambda g: summed.append(g.data_ptr()))
        tokens = _tokens()
        engine.forward_backward_layer_major([tokens], lambda out, m: out.float().square().mean())
        handle.remove()
    assert len(contributions) == 2 and len(summed) == 1
    assert summed[0] in contributions
