"""A step's loss is the mean over its target tokens, however the step is split into micro-batches:
with chat data (prompt targets IGNORE_INDEX, so micro-batches train on different numbers of tokens)
`data.batch_size 4` and `data.batch_size 2 --grad_accum_steps 2` give the gradient and the loss of
plain PyTorch's cross entropy over the whole batch. An eval weighs its batches alike."""

from __future__ import annotations

import copy
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F

import offload_trainer as ot
from offload_trainer.app.causal_lm import CausalLM
from offload_trainer.app.data import IGNORE_INDEX, Batch, ByteTokenizer
from offload_trainer.app.layer_major_step import train_step_layer_major
from offload_trainer.app.target_weights import target_weights
from offload_trainer.app.trainer import evaluate, train_step
from offload_trainer.models.decoder import DecoderConfig, DecoderLM

SEQ = 16
TRAINED_FROM = [15, 15, 2, 9]
"""Row r's targets before this position are a prompt's (IGNORE_INDEX): 1, 1, 14 and 7 trained tokens."""


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def chat_like_batch() -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4, SEQ + 1), generator=generator)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for row, start in enumerate(TRAINED_FROM):
        targets[row, :start] = IGNORE_INDEX
    return inputs, targets


class Rows:
    """The four rows, `rows` at a time, as BatchStream hands out micro-batches."""

    def __init__(self, rows: int) -> None:
        inputs, targets = chat_like_batch()
        self.batches = [Batch(x, t, None) for x, t in zip(inputs.split(rows), targets.split(rows))]

    def next_batch(self) -> Batch:
        return self.batches.pop(0)


def fresh_model() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig.preset("tiny", max_seq_len=SEQ))


def engine_step(rows: int, layer_major: bool = False) -> Tuple[float, float, dict]:
    """(logged loss, gradient norm, weights after the step) of one step over the four rows, `rows` a micro-batch."""
    accum = 4 // rows
    lm = CausalLM(fresh_model(), lambda m: None, ByteTokenizer(), [], None)
    # Plain SGD at lr 1: the weights move by the gradient itself (AdamW's first step moves each by about lr,
    # whatever its gradient's size, so it shows rounding, not scaling).
    sgd = {"kind": "sgd", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0}
    cfg = ot.OffloadConfig(grad_accum_steps=accum, optimizer=sgd)
    with ot.initialize(lm.model, cfg) as engine:
        step = train_step_layer_major if layer_major else train_step
        loss, trained = step(engine, lm, Rows(rows), accum)  # type: ignore[arg-type]
        assert trained == int((chat_like_batch()[1] != IGNORE_INDEX).sum())  # the step's targets, once each
        return loss, engine.stats().grad_norm, engine.full_state_dict()


def test_a_step_of_chat_data_is_the_token_mean_whatever_the_micro_batches() -> None:
    model = fresh_model()
    reference = copy.deepcopy(model)
    inputs, targets = chat_like_batch()
    loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()
    stepped = {name: (p - p.grad).detach() for name, p in reference.named_parameters()}
    for rows, layer_major in ((4, False), (2, False), (1, False), (2, True)):
        got_loss, got_norm, weights = engine_step(rows, layer_major)
        # Without the weights: 2 x 2 logged a loss 1% off and a gradient norm 6% off plain PyTorch's.
        assert got_loss == pytest.approx(loss.item(), rel=1e-6), (rows, layer_major)
        assert got_norm == pytest.approx(norm, rel=1e-5), (rows, layer_major)
        for name, value in stepped.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} {rows} {layer_major}")


def test_micro_batches_of_as_many_targets_weigh_exactly_one() -> None:
    """Packed text (every target trained) computes bitwise what it did before the weights."""
    full = torch.zeros(2, SEQ, dtype=torch.long)
    assert target_weights([full, full, full]) == [1.0, 1.0, 1.0]
    half = full.clone()
    half[:, : SEQ // 2] = IGNORE_INDEX
    assert target_weights([half, half]) == [1.0, 1.0]
    assert target_weights([torch.full_like(full, IGNORE_INDEX)] * 2) == [1.0, 1.0]  # nothing trained: losses are 0
    assert target_weights([full, half]) == [4 / 3, 2 / 3]


def test_an_eval_is_the_mean_over_its_target_tokens() -> None:
    class HeldOut:
        def eval_batches(self, batch_size: int):
            inputs, targets = chat_like_batch()
            return (Batch(x, t, None) for x, t in zip(inputs.split(batch_size), targets.split(batch_size)))

    model = fresh_model()
    reference = copy.deepcopy(model)
    inputs, targets = chat_like_batch()
    with torch.no_grad():
        want = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).item()
    lm = CausalLM(model, lambda m: None, ByteTokenizer(), [], None)
    with ot.initialize(lm.model, ot.OffloadConfig()) as engine:
        got: List[float] = [evaluate(engine, lm, HeldOut(), rows, 16) for rows in (4, 3, 1)]  # type: ignore[arg-type]
    assert got == pytest.approx([want] * 3, rel=1e-6)


class ThreadRanks:
    """The collectives evaluate() uses (rank, world_size, all_reduce_sum), between threads standing in for ranks."""

    def __init__(self, rank: int, world_size: int, shared: dict) -> None:
        self.rank, self.world_size, self.shared = rank, world_size, shared

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        barrier, parts = self.shared["barrier"], self.shared["parts"]
        parts[self.rank] = t.clone()
        barrier.wait()
        t.copy_(sum(parts[r] for r in range(self.world_size)))
        barrier.wait()  # every rank has read the sum before the next all-reduce writes its part


def test_an_eval_on_two_ranks_splits_each_batch_between_them_and_is_the_mean_over_every_target() -> None:
    """Each rank evaluated every whole batch (the global data.batch_size), so on N GPUs an eval's forward
    took N times the logits and activations a training micro-batch does (what the run's checks and the
    planner size the device for) and did the same work N times. Each rank now takes its rows of each
    batch; one left without a row (a last batch of fewer rows than ranks) runs a stand-in row that
    weighs nothing (the forward all-gathers the parameters on every rank), and the eval loss is still
    plain PyTorch's cross entropy over every held-out target."""
    import threading
    from types import SimpleNamespace

    class HeldOut:  # 5 rows, batches of 4: 4 rows, then 1
        def eval_batches(self, batch_size: int):
            inputs, targets = chat_like_batch()
            inputs, targets = torch.cat([inputs, inputs[2:3]]), torch.cat([targets, targets[2:3]])
            return (Batch(x, t, None) for x, t in zip(inputs.split(batch_size), targets.split(batch_size)))

    model = fresh_model().eval()
    inputs, targets = chat_like_batch()
    inputs, targets = torch.cat([inputs, inputs[2:3]]), torch.cat([targets, targets[2:3]])
    with torch.no_grad():
        want = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).item()
    rows: dict = {0: [], 1: []}

    class Recording(CausalLM):
        def loss(self, engine, batch_inputs, batch_targets, position_ids=None):
            rows[engine.collectives.rank].append(batch_inputs.shape[0])
            return self.loss_of(self.model(batch_inputs), batch_targets)

    shared = {"barrier": threading.Barrier(2), "parts": {}}
    got: dict = {}

    def rank(r: int) -> None:
        lm = Recording(model, lambda m: None, ByteTokenizer(), [], None)
        engine = SimpleNamespace(collectives=ThreadRanks(r, 2, shared))
        got[r] = evaluate(engine, lm, HeldOut(), 4, 16)  # type: ignore[arg-type]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert rows == {0: [2, 1], 1: [2, 1]}, rows  # without the split: [4, 1] on each
    assert got[0] == got[1] == pytest.approx(want, rel=1e-6)
