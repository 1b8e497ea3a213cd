"""Invariant 2 at start-up: home tiers are split by bytes, and a plan that cannot fit is refused.

assign_tiers is pure; the refusals go through offload_trainer.initialize on a tiny decoder, and
must fail before training state is created, with the numbers in the message (and, for a full
NVMe directory, before any swap file exists). Run: pytest tests/offload_trainer/runtime/test_plan_refusals.py
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import List

import pytest
import torch

import io_engine
import io_engine.file_store
import offload_trainer as ot
from offload_trainer.config import GroupingConfig, Placement, Tier
from offload_trainer.runtime.layout.memory_plan import assign_tiers
from offload_trainer.models import DecoderConfig, DecoderLM
from offload_trainer.runtime.layout.partition import plan_partition

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
TINY = DecoderConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=24, max_seq_len=16)


# -- assign_tiers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nbytes, placement, expected",
    [
        ([10, 10, 10, 10], {"host": 0.5, "nvme": 0.5}, [H, H, N, N]),
        ([10, 10, 10, 10], {"device": 0.25, "host": 0.25, "nvme": 0.5}, [D, H, N, N]),
        ([10, 10, 10, 10], {"device": 0.5, "nvme": 0.5}, [D, D, N, N]),
        # By bytes, not by count: the first group alone is half the bytes.
        ([40, 10, 10, 10, 10], {"host": 0.5, "nvme": 0.5}, [H, N, N, N, N]),
        ([30, 10, 10, 10, 20], {"host": 0.5, "nvme": 0.5}, [H, H, N, N, N]),
        # A group goes where its middle byte falls.
        ([10, 10, 10], {"host": 0.5, "nvme": 0.5}, [H, H, N]),
        ([10, 10, 10], {"device": 0.2, "host": 0.8}, [D, H, H]),
    ],
)
def test_fractions_split_by_bytes_in_group_order(nbytes: List[int], placement: dict, expected: List[Tier]) -> None:
    assert assign_tiers(nbytes, Placement.parse(placement)) == expected


@pytest.mark.parametrize("tier", list(Tier))
def test_single_tier_placement_puts_every_group_there(tier: Tier) -> None:
    nbytes = [4096, 1, 123456, 7, 4096 * 10 + 1]
    assert assign_tiers(nbytes, Placement.parse(tier)) == [tier] * len(nbytes)


def test_every_group_gets_a_tier() -> None:
    nbytes = [4096 * (i % 5 + 1) for i in range(23)]
    out = assign_tiers(nbytes, Placement(device=0.1, host=0.3, nvme=0.6))
    assert len(out) == len(nbytes) and all(isinstance(t, Tier) for t in out)
    assert out == sorted(out, key=lambda t: list(Tier).index(t)), "faster tiers come first"
    assert set(out) == {D, H, N}
    assert assign_tiers([], Placement()) == []


@pytest.mark.parametrize(
    "nbytes, placement",
    [
        ([0, 10], Placement(host=1.0)),
        ([10**7, 1], Placement(device=0.5, host=0.4999995, nvme=0.0)),
    ],
    ids=["zero_byte_group_first", "fractions_sum_just_below_one"],
)
def test_a_tier_with_fraction_zero_is_never_assigned(nbytes: List[int], placement: Placement) -> None:
    allowed = set(placement.tiers())
    assert set(assign_tiers(nbytes, placement)) <= allowed


# -- refusals through initialize --------------------------------------------------------------------


def tiny_model() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(TINY)


def largest_group_bytes(model: DecoderLM) -> int:
    """The largest group's flat fp32 parameters: what one device slot or staging buffer holds."""
    plan = plan_partition(model, GroupingConfig(), world_size=1, align_numel=1024)
    return max(g.flat_numel for g in plan.groups) * 4


def leftover_files(directory: Path) -> List[str]:
    return [os.path.join(d, name) for d, dirs, files in os.walk(directory) for name in dirs + files]


def io_threads() -> List[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("io_engine-")]


def test_device_budget_below_the_largest_group_is_refused_with_the_numbers() -> None:
    model = tiny_model()
    slot_bytes = largest_group_bytes(model)
    budget = slot_bytes - 1
    cfg = ot.OffloadConfig(tiers={"params": "host", "device_budget_bytes": budget})

    with pytest.raises(ot.PlanError) as info:
        ot.initialize(model, cfg)

    message = str(info.value)
    assert f"device_budget_bytes={budget}" in message
    assert str(slot_bytes) in message, f"the needed {slot_bytes} bytes are not in: {message}"
    assert isinstance(info.value, ValueError), "a plan that does not fit is the user's to change"
    assert not io_threads()


def test_device_budget_of_exactly_one_slot_is_accepted() -> None:
    model = tiny_model()
    cfg = ot.OffloadConfig(tiers={"params": "host", "device_budget_bytes": largest_group_bytes(model)})
    with ot.initialize(model, cfg) as engine:
        assert engine.device_slots is not None and engine.device_slots.num_buffers == 1


def test_host_budget_too_small_for_nvme_staging_is_refused_with_the_numbers(tmp_path: Path) -> None:
    model = tiny_model()
    staging_bytes = largest_group_bytes(model)
    # AdamW with every state kind on NVMe: param, grad and each moment of a group pass through
    # host staging, double-buffered, so 2 * (2 + moments) buffers of the largest group.
    num_kinds = 2 + len(ot.OptimizerKind.ADAMW.state_names(0.0))
    need = 2 * num_kinds * staging_bytes
    budget = 1000
    cfg = ot.OffloadConfig(
        tiers={
            "params": "nvme",
            "grads": "nvme",
            "optimizer": "nvme",
            "nvme_dir": str(tmp_path),
            "host_budget_bytes": budget,
        }
    )

    with pytest.raises(ot.PlanError) as info:
        ot.initialize(model, cfg)

    message = str(info.value)
    assert f"host_budget_bytes={budget}" in message
    assert str(staging_bytes) in message and str(need) in message, message
    assert leftover_files(tmp_path) == [], "a refused plan leaves no swap directory behind"
    assert not io_threads()


def test_host_budget_too_small_for_host_homes_alone_is_refused_with_the_numbers() -> None:
    """Every state kind on the host, so nothing passes through staging: the refusal's message took
    the largest staging buffer's size from an empty list and the user got an IndexError instead."""
    model = tiny_model()
    cfg = ot.OffloadConfig(tiers={"params": "host", "grads": "host", "optimizer": "host", "host_budget_bytes": 1000})
    with pytest.raises(ot.PlanError, match=r"host_budget_bytes=1000: state homed on the host takes \d+ bytes") as info:
        ot.initialize(model, cfg, device="cpu")
    assert "staging" not in str(info.value)


def test_nvme_dir_without_room_is_refused_before_any_swap_file_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model()
    monkeypatch.setattr(io_engine.file_store, "free_bytes", lambda path: 1000)
    cfg = ot.OffloadConfig(tiers={"params": "nvme", "nvme_dir": str(tmp_path)})
    created: List[str] = []
    real_open = io_engine.IOEngine.open

    def spy_open(self: io_engine.IOEngine, path: object, *args: object, **kwargs: object) -> object:
        created.append(os.fspath(path))  # type: ignore[arg-type]
        return real_open(self, path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(io_engine.IOEngine, "open", spy_open)

    with pytest.raises(io_engine.NotEnoughSpaceError) as info:
        ot.initialize(model, cfg)

    plan = plan_partition(model, GroupingConfig(), world_size=1, align_numel=1024)
    assert info.value.free_bytes == 1000
    assert info.value.needed_bytes >= sum(g.flat_bytes for g in plan.groups)
    assert str(info.value.needed_bytes) in str(info.value) and "1000" in str(info.value)
    assert created == [], f"swap files were created before the space check: {created}"
    assert leftover_files(tmp_path) == []
    assert not io_threads()
