"""Collectives refuses a process group that cannot carry host tensors (NCCL alone): the engine's
agreements and the gradient norm's sum are CPU tensors, which such a group fails on deep inside a
step; "cpu:gloo,cuda:nccl" carries both. torch.distributed is stood in for (no NCCL here)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from offload_trainer.runtime.collectives import Collectives, carries_host_tensors
from offload_trainer.runtime.metrics import StepStats


@pytest.mark.parametrize(
    "backend,carries",
    [("gloo", True), ("nccl", False), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl,cpu:gloo", True), ("cuda:nccl", False)],
)
def test_which_backends_carry_host_tensors(backend: str, carries: bool) -> None:
    assert carries_host_tensors(backend) is carries


def fake_group(monkeypatch, backend: str, world_size: int = 2) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)


def test_a_group_of_nccl_alone_is_refused_with_the_fix(monkeypatch) -> None:
    fake_group(monkeypatch, "nccl")
    with pytest.raises(ValueError, match=r"'nccl'.*init_process_group\('cpu:gloo,cuda:nccl'\)"):
        Collectives(StepStats())


def test_nccl_beside_gloo_and_one_rank_of_nccl_are_taken(monkeypatch) -> None:
    fake_group(monkeypatch, "cpu:gloo,cuda:nccl")
    assert Collectives(StepStats()).world_size == 2
    fake_group(monkeypatch, "nccl", world_size=1)  # one rank: no collective is ever run
    assert Collectives(StepStats()).world_size == 1
