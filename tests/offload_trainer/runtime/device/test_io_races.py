"""Whole training scripts on the CPU and the simulated accelerator touch no swap-file bytes and no host
memory that an NVMe request still in flight moves (io_races.py says how this is checked), with every
NVMe read and write made late. The scripts are test_late_copy_scenarios.py's (accumulation,
evaluation and an export between micro-batches, checkpoints saved and loaded, a non-finite step),
micro-batch-major and layer-major with boundaries spilled to NVMe, in fp32 and bf16. Values are not
checked here: test_late_copy_scenarios.py does that."""

from __future__ import annotations

import contextlib
import time
from typing import Any, List

import pytest
from io_engine import TransferError

import offload_trainer as ot
from offload_trainer.runtime.gradients import GradAccumulator
from offload_trainer.runtime.optimizer import StreamingOptimizer
from tests.offload_trainer.runtime.device import test_late_copy_scenarios as scenarios
from tests.offload_trainer.runtime.device.io_races import IORaces

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def late_nvme(monkeypatch: pytest.MonkeyPatch, delay_s: float, names: Any = ("preadv", "pwritev")) -> None:
    """Every NVMe read and write (of `names`) lands `delay_s` late (each block, on the IO engine's workers)."""
    import io_engine.transfer as transfer

    for name in names:
        real = getattr(transfer.os, name)

        def slow(*args: Any, real: Any = real) -> int:
            time.sleep(delay_s)
            return real(*args)

        monkeypatch.setattr(transfer.os, name, slow)


def no_drain(self: GradAccumulator) -> None:
    """drain giving the staging buffers of the gradients' writes back without waiting for them: the
    update pass then reads the gradient homes while the last writes to them are in flight."""
    for _, buffer, _ in self._writes:
        self.staging.give(buffer)  # type: ignore[union-attr]
    self._writes = []


def no_wait_before_give_back(self: StreamingOptimizer) -> None:
    """_retire_oldest giving the staging buffers of the oldest writes back without waiting for them."""
    _, bufs, _ = self._writes.pop(0)  # (handles, buffers, the fills reading them)
    for buf in bufs:
        self.staging.give(buf)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "owner, name, fault, placement, expected",
    [
        pytest.param(
            GradAccumulator, "drain", no_drain, "hnh", ("nvme write of the file", "nvme read of its bytes"),
            marks=pytest.mark.slow, id="gradient-home-read-before-its-write",  # about 11 s
        ),
        pytest.param(
            StreamingOptimizer, "_retire_oldest", no_wait_before_give_back, "hhn", ("nvme write of memory", "nvme read of it"),
            id="staging-read-into-under-its-write",
        ),
    ],
)
def test_the_check_finds_a_transfer_that_skips_its_wait(
    tmp_path, monkeypatch, owner: Any, name: str, fault: Any, placement: str, expected: Any
) -> None:
    """The check itself: an update pass that reads the gradient homes without waiting for the last
    gradients' writes to them, or optimizer staging buffers lent again before their writes landed,
    are found while the writes are in flight (made 50 ms late). What the fault does to the numbers (a
    checksum that no longer matches, say) is not this test's: the engine may raise."""
    late_nvme(monkeypatch, 0.05, names=("pwritev",))
    monkeypatch.setattr(owner, name, fault)
    races = IORaces.install(monkeypatch)
    case = scenarios.placed(placement, events=False)
    with races.watching(), contextlib.suppress(TransferError):
        with ot.initialize(scenarios.decoder(), scenarios.config(case, tmp_path / "swap"), device="cpu") as engine:
            for step in scenarios.script_batches(2, num_steps=1):
                for x, y in step:
                    engine.backward(scenarios.ce(engine(x), y) / 2)
                engine.step()
    seen: List[Any] = [(first, then) for first, then, _, _ in races.found]
    assert expected in seen, (seen, races.report())


CASES = [
    ("nnn", {}), ("hnh", {}), ("dnd", {}), ("ndh", {}), ("dhn", {}), ("nnn", {"precision": "bf16"}),
    ("nnn", {"layer_major": True, "accum": 3}), ("hnh", {"layer_major": True, "accum": 3, "spill": "nvme"}),
    ("dnd", {"layer_major": True, "accum": 3, "spill": "nvme", "precision": "bf16"}),
]


@pytest.mark.slow  # 3 to 10 s each: every NVMe block is 3 ms late
@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize(
    "case", [pytest.param(scenarios.placed(code, **kw), id=f"{code}-{'-'.join(f'{k}={v}' for k, v in kw.items())}") for code, kw in CASES]
)
def test_no_access_overlaps_an_nvme_transfer_in_flight(tmp_path, monkeypatch, case: scenarios.Case, device: str) -> None:
    late_nvme(monkeypatch, 0.003)
    races = IORaces.install(monkeypatch)
    make = (lambda: "cpu") if device == "cpu" else (lambda: scenarios.simulated(case))
    budgets = scenarios.spill_budgets(case, make(), tmp_path / "probe") if case.spill else None
    with races.watching():
        with ot.initialize(scenarios.decoder(), scenarios.config(case, tmp_path / "swap", budgets), device=make()) as engine:
            scenarios.run_script(scenarios.EngineTrainer(engine), case, tmp_path)
            engine.wait_for_updates()
    assert not races.found, races.report()
