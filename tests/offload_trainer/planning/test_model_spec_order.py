"""plan_for_model refuses a model that fits nowhere before it measures anything: no disk pass, no
compute probe (see [Note: Refuse before timing] in planning/model_spec.py); one that fits is
measured and planned as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload_trainer.app.run_config import RunConfig
from offload_trainer.errors import PlanError
from offload_trainer.planning import model_spec
from offload_trainer.planning.machine import MachineRates
from offload_trainer.planning.model_spec import MicroBatch, ModelSpec, plan_for_model

RATES = MachineRates(
    nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=2e9, nvme_direct_io=True,
    host_to_device_bytes_per_s=1e10, device_to_host_bytes_per_s=1e10,
    adamw_elements_per_s=1e9, sgd_elements_per_s=2e9,
)


def _forbid_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured the machine before refusing")

    monkeypatch.setattr(model_spec, "machine_rates", measured)
    monkeypatch.setattr(model_spec, "cached_decoder_times", measured)


def test_a_model_that_fits_nowhere_is_refused_before_anything_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_measuring(monkeypatch)
    cfg = RunConfig().with_overrides({"model.preset": "tiny", "tiers.host_budget_bytes": "1MiB"})
    with pytest.raises(PlanError, match="no placement fits .* raise tiers.host_budget_bytes"):
        plan_for_model(ModelSpec.from_preset("tiny"), cfg, MicroBatch(2, 32), torch.device("cpu"))


def test_a_model_that_fits_is_measured_and_planned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []

    def probe(*args: object, **kwargs: object):
        calls.append("probe")
        return model_spec.ComputeTimes(0.1, 0.2, 0.0), False

    monkeypatch.setattr(model_spec, "cached_decoder_times", probe)
    cfg = RunConfig().with_overrides({"model.preset": "tiny", "tiers.nvme_dir": str(tmp_path)})
    choice = plan_for_model(
        ModelSpec.from_preset("tiny"), cfg, MicroBatch(2, 32), torch.device("cpu"), rates=RATES,
        cache_path=tmp_path / "machine.json",
    )
    assert calls == ["probe"] and choice.num_fitting > 0
