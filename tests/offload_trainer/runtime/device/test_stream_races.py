"""Whole training scripts under CudaAccelerator keep the order a GPU's streams need: no copy runs
unordered with compute or host work on the memory it touches, and no memory is freed while another
stream than the one that made it may still use it (stream_races.py says how this is checked on the
CPU). The scripts are test_late_copy_scenarios.py's (accumulation, evaluation and an export between
micro-batches and its weights loaded back, checkpoints saved and loaded, a non-finite step), one rank or two
(test_cuda_host_waits.py's twin ranks, with NCCL's stream order: the compute that reads a
collective's output waits for it at finish()), also with layer-major boundaries spilled to host
memory or NVMe, and over other models: blocks recomputed under activation checkpointing, a
mixture of experts (modules that run change with the data: orders recorded again, loads
cancelled), frozen parameters and LoRA adapters (PEFT). Values are not checked here: the simulated
accelerator's tests do that."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import offload_trainer as ot
from offload_trainer.models import DecoderLM
from offload_trainer.runtime.collectives import Collectives, CollectiveWork
from offload_trainer.runtime.device.cuda import CudaAccelerator
from tests.offload_trainer.runtime.device import test_late_copy_scenarios as scenarios
from tests.offload_trainer.runtime.device.stream_races import StreamRaces
from tests.offload_trainer.runtime.device.test_cuda_host_waits import FakeEvent, twin_ranks  # noqa: F401 - a fixture


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture
def races(monkeypatch) -> StreamRaces:
    return StreamRaces.install(monkeypatch)


@pytest.fixture
def nccl_twin(races: StreamRaces, twin_ranks: None, monkeypatch) -> None:
    """The twin ranks' collectives as NCCL orders them: on the stream they are issued on (the comm
    stream), the compute that reads their output waiting for it at finish()."""
    cuda = races.cuda

    class Work:
        def __init__(self) -> None:
            self.event = FakeEvent()
            self.event.record(cuda.current_stream())

        def wait(self) -> None:
            cuda.current_stream().wait_event(self.event)

        def is_completed(self) -> bool:
            return self.event.query()

        def get_future(self) -> Any:
            raise RuntimeError("no future")

    def start_all_gather(self: Collectives, full: torch.Tensor, shard: torch.Tensor, name: str = "") -> CollectiveWork:
        if shard.data_ptr() != full.data_ptr():
            full[: shard.numel()].copy_(shard)
        full[shard.numel() :].zero_()
        return CollectiveWork(self, "all-gather", name, Work(), [])  # type: ignore[arg-type]

    def start_reduce_scatter_mean(
        self: Collectives, shard: torch.Tensor, full: torch.Tensor, name: str = "", then: Any = None
    ) -> CollectiveWork:
        shard.copy_(full[: shard.numel()])
        return CollectiveWork(self, "reduce-scatter", name, Work(), [], then)  # type: ignore[arg-type]

    monkeypatch.setattr(Collectives, "start_all_gather", start_all_gather)
    monkeypatch.setattr(Collectives, "start_reduce_scatter_mean", start_reduce_scatter_mean)


def cuda_accelerator() -> CudaAccelerator:
    accel = CudaAccelerator(torch.device("cuda", 0))
    accel.torch_device = torch.device("cpu")  # the "device" memory of these tests is the CPU's
    return accel


def run_script(races: StreamRaces, case: scenarios.Case, tmp: Path, model: Callable[[], nn.Module] = scenarios.decoder) -> None:
    budgets = None
    if case.spill:
        budgets = scenarios.spill_budgets(case, cuda_accelerator(), tmp)
        races.forget_memory()  # the probing engine's host arenas are gone: their addresses are reused
    with races.watching():
        with ot.initialize(model(), scenarios.config(case, tmp / "swap", budgets), device=cuda_accelerator()) as engine:
            scenarios.run_script(scenarios.EngineTrainer(engine), case, tmp)
            engine.wait_for_updates()
            if case.spill:
                spilled = engine.layer_major.boundary_bytes
                assert spilled[ot.Tier.HOST if case.spill == "host" else ot.Tier.NVME], spilled


@pytest.mark.slow  # about 3 s; the faults it found have default tests in test_cuda_host_waits.py
def test_a_gradient_copied_off_before_the_backward_that_wrote_it_is_caught(races: StreamRaces, tmp_path, monkeypatch) -> None:
    """The check itself: with the copies off the device made to follow nothing but their `after`
    (not the compute that wrote their source), the gradients' copies are found unordered."""
    monkeypatch.setattr(
        CudaAccelerator, "d2h", lambda self, dst, src, after=(), written_by=None: self._copy(self._d2h, dst, src, list(after))
    )
    with races.watching():
        with ot.initialize(scenarios.decoder(), scenarios.config(scenarios.placed("hhh"), tmp_path), device=cuda_accelerator()) as engine:
            for x, y in scenarios.script_batches(2, num_steps=1)[0]:
                engine.backward(scenarios.ce(engine(x), y) / 2)
    assert any(first.endswith("on compute") and then == "read on d2h" for first, then, _, _ in races.found), races.report()


@pytest.mark.slow  # about 15 s each
@pytest.mark.parametrize("fault", ["source dropped", "no record_stream"])
def test_memory_freed_while_another_stream_uses_it_is_caught(races: StreamRaces, tmp_path, monkeypatch, fault: str) -> None:
    """The check itself, for the caching allocator (stream_races.py's docstring): with a copy's source
    let go at once (not held until the copy is done), gradients copied off the device are found freed
    under their copy; without `record_stream`, a layer-major boundary copied back into memory the
    copy stream allocated is found freed while the compute that reads it may still be queued."""
    if fault == "source dropped":
        real_copy = CudaAccelerator._copy

        def copy(self: CudaAccelerator, stream: Any, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
            done = real_copy(self, stream, dst, src, after)
            with self._inflight_lock:
                self._inflight[-1] = (self._inflight[-1][0], [])
            return done

        monkeypatch.setattr(CudaAccelerator, "_copy", copy)
        expected = ("use on d2h", "freed (made on compute)")
    else:
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
        expected = ("use on compute", "freed (made on h2d)")
    run_script(races, scenarios.placed("hnh", layer_major=True, accum=3, spill="host", events=False), tmp_path)
    assert any((first, then) == expected for first, then, _, _ in races.found), races.report()


SLOW = pytest.mark.slow  # 4 to 10 s each: every aten op is logged and checked


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(scenarios.placed(code, **kw), id=f"{code}-{'-'.join(f'{k}={v}' for k, v in kw.items())}", marks=SLOW)
        for code, kw in [
            ("hhh", {}), ("nnn", {}), ("ddd", {}), ("dnd", {}), ("hdn", {}), ("ndh", {"precision": "bf16"}),
            ("dhn", {"precision": "fp16"}), ("hhh", {"layer_major": True, "accum": 3}),
            ("dnd", {"layer_major": True, "accum": 3}), ("nnn", {"layer_major": True, "accum": 3, "precision": "bf16"}),
            ("dnd", {"layer_major": True, "accum": 3, "spill": "nvme"}), ("hnh", {"layer_major": True, "accum": 3, "spill": "host"}),
            ("ddd", {"layer_major": True, "accum": 3, "spill": "nvme", "clip": None}),
        ]
    ],
)
def test_one_rank_keeps_stream_order_through_the_whole_script(races: StreamRaces, tmp_path, case: scenarios.Case) -> None:
    run_script(races, case, tmp_path)
    assert not races.found, races.report()


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(scenarios.placed(code, events=False, **kw), id=f"{code}-{'-'.join(f'{k}={v}' for k, v in kw.items())}", marks=SLOW)
        for code, kw in [
            ("hhh", {}), ("nnn", {}), ("ddd", {}), ("hnh", {}), ("hnh", {"precision": "bf16"}),
            ("dhn", {"layer_major": True, "accum": 3}), ("hnh", {"layer_major": True, "accum": 3, "spill": "nvme"}),
        ]
    ],
)
def test_two_ranks_keep_stream_order_through_the_script(
    races: StreamRaces, nccl_twin: None, tmp_path, case: scenarios.Case
) -> None:
    run_script(races, case, tmp_path)
    assert not races.found, races.report()


def checkpointed_decoder() -> nn.Module:
    torch.manual_seed(0)
    return DecoderLM(scenarios.decoder().config, activation_checkpointing=True)


@pytest.fixture
def lora_decoder() -> Callable[[], nn.Module]:
    """The decoder with PEFT LoRA adapters: PEFT (and the transformers it loads) imported before
    `races` fakes torch.cuda (transformers reads torch.cuda.Stream when imported)."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers.generation")
    return scenarios.lora_decoder


@SLOW
@pytest.mark.parametrize(
    "model, code",
    [("checkpointed", "hhh"), ("checkpointed", "dnd"), ("moe", "nnn"), ("moe", "dhd"), ("frozen", "hdn"), ("lora", "nnn"), ("lora", "dhh")],
)
def test_other_models_keep_stream_order_through_the_script(request, tmp_path, model: str, code: str) -> None:
    make = request.getfixturevalue("lora_decoder") if model == "lora" else {
        "checkpointed": checkpointed_decoder, "moe": scenarios.moe_decoder, "frozen": scenarios.frozen_decoder
    }[model]
    races = request.getfixturevalue("races")
    run_script(races, scenarios.placed(code), tmp_path, make)
    assert not races.found, races.report()
