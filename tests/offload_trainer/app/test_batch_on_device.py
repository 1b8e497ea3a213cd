"""offload-train's batches reach the engine's device: the data gives host tensors, and on a GPU the
model's parameters (and so its logits) are on the GPU, where an embedding lookup of CPU token ids
or a cross entropy against CPU targets fails.

On the CPU the engine's device is the CPU, so an engine on the meta device stands in for the GPU:
whatever is not moved there meets a meta tensor and raises, as a CPU tensor would meet a CUDA one.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from offload_trainer.app.causal_lm import CausalLM
from offload_trainer.app.data import IGNORE_INDEX, Batch
from offload_trainer.app.layer_major_step import train_step_layer_major

VOCAB = 11
META = torch.device("meta")


class EngineOnAnotherDevice:
    """What CausalLM.loss and the layer-major step use of an Engine, on the meta device."""

    device = META
    collectives = None  # one process: the step's target weights count its own targets

    def __init__(self) -> None:
        self.inputs: List[torch.Tensor] = []

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        self.inputs.append(inputs)
        assert inputs.device == META, f"the model got its inputs on {inputs.device}, not on the engine's device"
        weight = torch.empty(VOCAB, 4, device=META)
        return torch.nn.functional.embedding(inputs, weight) @ torch.empty(4, VOCAB, device=META)

    def forward_backward_layer_major(self, inputs, loss_fn, stack) -> List[torch.Tensor]:
        return [loss_fn(self(x), m) for m, x in enumerate(inputs)]

    def step(self) -> None:
        pass


class Stream:
    def __init__(self, batches) -> None:
        self._batches = list(batches)

    def next_batch(self):
        return self._batches.pop(0)


def lm() -> CausalLM:
    return CausalLM(model=torch.nn.Identity(), init_fn=lambda m: None, tokenizer=None, weight_files=[], hf_dir=None)


def host_batch(all_ignored: bool = False):
    inputs = torch.randint(0, VOCAB, (2, 5))
    targets = torch.full((2, 5), IGNORE_INDEX) if all_ignored else torch.randint(0, VOCAB, (2, 5))
    return Batch(inputs, targets, None)


@pytest.mark.parametrize("all_ignored", [False, True])
def test_the_loss_takes_the_host_batch_to_the_engines_device(all_ignored: bool) -> None:
    engine = EngineOnAnotherDevice()
    loss = lm().loss(engine, *host_batch(all_ignored))  # type: ignore[arg-type]
    assert loss.device == META and loss.dim() == 0
    assert len(engine.inputs) == 1


def test_the_layer_major_step_takes_every_micro_batch_to_the_engines_device(monkeypatch) -> None:
    monkeypatch.setattr("offload_trainer.app.layer_major_step.block_stack_of", lambda model: None)
    engine = EngineOnAnotherDevice()
    with pytest.raises(RuntimeError, match="meta"):  # the mean loss is read on the host: a meta tensor has none
        train_step_layer_major(engine, lm(), Stream([host_batch(), host_batch()]), accum=2)  # type: ignore[arg-type]
    assert [x.device for x in engine.inputs] == [META, META]


def record_host_reads(monkeypatch, events: List[str]) -> None:
    """Every float() or .item() of a tensor (a host read, which waits for a GPU) appends "read"."""
    for name in ("__float__", "item"):
        original = getattr(torch.Tensor, name)

        def reading(self, *args, _original=original, **kwargs):
            events.append("read")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, reading)


def test_a_step_reads_its_losses_on_the_host_once_after_step(monkeypatch) -> None:
    """train_step read each micro-batch's loss with float() right after its backward: on a GPU the
    host then waited for that whole backward before it could issue the next forward. The losses
    are summed on the device now and read once, after step(); the mean is the same float64 sum."""
    from offload_trainer.app.trainer import train_step

    events: List[str] = []
    losses = [torch.tensor(v, dtype=torch.float32) for v in (2.5, 1.0 / 3.0, 7.125, 0.1)]

    class RecordingEngine:
        device = torch.device("cpu")
        collectives = None

        def backward(self, loss: torch.Tensor) -> None:
            events.append("backward")

        def step(self) -> None:
            events.append("step")

    class FixedLosses(CausalLM):
        def loss(self, engine, inputs, targets, position_ids=None):
            return losses[len([e for e in events if e == "backward"])]

    record_host_reads(monkeypatch, events)
    model = FixedLosses(model=torch.nn.Identity(), init_fn=lambda m: None, tokenizer=None, weight_files=[], hf_dir=None)
    mean, _ = train_step(RecordingEngine(), model, Stream([host_batch() for _ in losses]), accum=len(losses))  # type: ignore[arg-type]
    assert events == ["backward"] * len(losses) + ["step", "read"]
    expected = 0.0
    for loss in losses:
        expected += float(loss.double())
    assert mean == expected / len(losses)


def test_an_eval_reads_its_losses_on_the_host_once_at_the_end(monkeypatch) -> None:
    """evaluate() read every batch's loss with float(): on a GPU one wait per batch. Now once, at
    the end, with the same float64 mean."""
    from offload_trainer.app.trainer import evaluate

    events: List[str] = []
    losses = [torch.tensor(v, dtype=torch.float32) for v in (0.7, 1.0 / 3.0, 5.5)]

    class FixedLosses(CausalLM):
        def loss(self, engine, inputs, targets, position_ids=None):
            events.append("loss")
            return losses[len([e for e in events if e == "loss"]) - 1]

    class Held:
        def eval_batches(self, batch_size):
            return iter([host_batch() for _ in range(10)])

    record_host_reads(monkeypatch, events)
    model = FixedLosses(model=torch.nn.Identity(), init_fn=lambda m: None, tokenizer=None, weight_files=[], hf_dir=None)
    mean = evaluate(None, model, Held(), 2, max_batches=len(losses))  # type: ignore[arg-type]
    assert events == ["loss"] * len(losses) + ["read"]
    monkeypatch.undo()
    assert mean == sum(float(loss) for loss in losses) / len(losses)


def test_a_batch_goes_to_a_gpu_through_pinned_memory_without_blocking(monkeypatch) -> None:
    """A blocking copy of a pageable host batch waits for all the work queued on the GPU (the last
    backward): to_device pins the batch and copies it with non_blocking=True. (On the CPU the batch
    is used as it is.) The GPU is stood in for by recording the calls."""
    from offload_trainer.app.causal_lm import to_device

    batch = torch.randint(0, VOCAB, (2, 5))
    assert to_device(batch, torch.device("cpu")) is batch
    calls: List[tuple] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append(("pin",)) or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(("to", a, k)) or self)
    to_device(batch, torch.device("cuda", 0))
    assert calls == [("pin",), ("to", (torch.device("cuda", 0),), {"non_blocking": True})]
