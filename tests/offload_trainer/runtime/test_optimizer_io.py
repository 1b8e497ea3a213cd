"""The optimizer's NVMe traffic: one read and one write request per group and step, whatever the
number of state kinds on NVMe ([Note: Batched per-group work] in runtime/optimizer.py).

Counted two ways, never timed: the engine's own counter (StepStats.optimizer_nvme_requests) and
the swap store's request methods as the optimizer's thread calls them. Results stay bitwise those
of plain PyTorch.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

import offload_trainer as ot
from io_engine import FileStore
from tests.offload_trainer.runtime.test_optimizer_pipeline import (
    Reference,
    SmallLM,
    assert_params_equal,
    batches,
    engine_step,
)

PLACEMENTS = {
    # param, grad, exp_avg and exp_avg_sq of every group on NVMe: four kinds read, three written.
    "all-nvme": dict(params="nvme", grads="nvme", optimizer="nvme"),
    # Only the two Adam states on NVMe.
    "states-nvme": dict(params="host", grads="host", optimizer="nvme"),
}


def count_store_requests(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Calls of the swap store's request methods made on the optimizer's update thread, by method."""
    calls: Counter = Counter()
    for name in ("pread", "pwrite", "pread_many", "pwrite_many"):
        real = getattr(FileStore, name)

        def counted(self: FileStore, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            if threading.current_thread().name == "optimizer-updates":
                calls[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(FileStore, name, counted)
    return calls


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("ahead", [0, 1])
def test_each_group_reads_and_writes_its_nvme_state_with_one_request_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, placement: str, compute_dtype: str, ahead: int
) -> None:
    """With read-ahead (prefetch.optimizer_groups_ahead), the first groups' states are read at the
    end of the pass before; a group whose gradient is on NVMe then reads it in one more request."""
    calls = count_store_requests(monkeypatch)
    torch.manual_seed(0)
    model = SmallLM(n_layers=6)
    cfg = ot.OffloadConfig(
        tiers=dict(PLACEMENTS[placement], nvme_dir=str(tmp_path / "swap")),
        optimizer=ot.OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, grad_clip_norm=0.5),
        precision={"compute_dtype": compute_dtype},
        prefetch={"optimizer_groups_ahead": ahead},
    )
    ref = Reference(model, cfg)
    num_steps = 3
    with ot.initialize(model, cfg) as engine:
        num_groups = sum(1 for g in engine.groups if g.local_trainable_numel > 0)
        assert num_groups >= 8, "the model should be cut into many groups"
        per_step: Dict[int, int] = {}
        for k, batch in enumerate(batches(num_steps, 1)):
            ref.step(batch)
            engine_step(engine, batch)
            # step() collects the update pass of the step before (the backward waited for it).
            per_step[k] = engine.stats().optimizer_nvme_requests
        engine.pipeline.wait_all()
        if compute_dtype == "fp32":
            assert_params_equal(ref.model, engine.full_state_dict())
    if ahead:
        # One more read for the group read ahead when its gradient is on NVMe (not final before
        # backward), and the first pass also reads the next pass's first group ahead.
        extra = ahead if PLACEMENTS[placement]["grads"] == "nvme" else 0
        assert per_step[0] == 0 and per_step[1] == 2 * num_groups + ahead, per_step
        assert per_step[2] == 2 * num_groups + extra, per_step
        assert calls == Counter(
            pread_many=num_steps * (num_groups + extra) + ahead - extra, pwrite_many=num_steps * num_groups
        ), calls
        return
    assert per_step[0] == 0 and per_step[1] == per_step[2] == 2 * num_groups, per_step
    # The store saw the same: one read and one write per group per update pass, and no request of
    # a single state kind on the update thread.
    assert calls == Counter(pread_many=num_steps * num_groups, pwrite_many=num_steps * num_groups), calls


def test_writes_in_several_requests_give_each_staging_buffer_back_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's homes in several swap files are written in one request per file (homes.start_writes).
    Made so here for every group (each home its own request), the pass gives each staging buffer
    back once, when all its group's requests are done (a second give fails BufferPool's check), and
    training stays bitwise that of plain PyTorch."""
    import offload_trainer.runtime.optimizer as optimizer_module

    real = optimizer_module.start_writes

    def one_request_per_home(tiers: Any, moves: Any, background: bool = False) -> Any:
        return [handle for move in moves for handle in real(tiers, [move], background)]

    monkeypatch.setattr(optimizer_module, "start_writes", one_request_per_home)
    torch.manual_seed(0)
    model = SmallLM(n_layers=3)
    cfg = ot.OffloadConfig(
        tiers=dict(PLACEMENTS["all-nvme"], nvme_dir=str(tmp_path / "swap")),
        optimizer=ot.OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, grad_clip_norm=0.5),
    )
    ref = Reference(model, cfg)
    with ot.initialize(model, cfg) as engine:
        for batch in batches(3, 1):
            ref.step(batch)
            engine_step(engine, batch)
        engine.pipeline.wait_all()
        assert_params_equal(ref.model, engine.full_state_dict())
