"""app/ranks.py's join_ranks under CUDA: each rank on its own GPU, and a process group that carries
host tensors too (the engine's agreements, the norm's sum, the loss), not NCCL alone.

Without a GPU, torch.cuda's device calls and torch.distributed's init are stood in for: what is
checked is what join_ranks asks of them.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from offload_trainer.app import ranks as ranks_module
from offload_trainer.app.ranks import join_ranks, local_cuda_index, process_group_backend


def test_the_backend_carries_host_tensors_under_cuda_too() -> None:
    assert process_group_backend(cuda=False) == "gloo"
    assert process_group_backend(cuda=True) == "cpu:gloo,cuda:nccl"


def test_each_local_rank_gets_its_own_gpu_or_the_only_one_it_sees() -> None:
    assert [local_cuda_index(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert local_cuda_index(3, 1) == 0  # CUDA_VISIBLE_DEVICES set per process
    with pytest.raises(ValueError, match="LOCAL_RANK=4 but this node has 4 GPUs.*--nproc-per-node"):
        local_cuda_index(4, 4)


@pytest.fixture
def fake_cuda_ranks(monkeypatch) -> Dict[str, List[Any]]:
    """torchrun's environment for rank 3 (local rank 1) of 4 on a node with 2 GPUs, and a
    torch.distributed whose init is recorded."""
    calls: Dict[str, List[Any]] = {"set_device": [], "init": []}
    joined = []
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # no heartbeat thread
    # ... and no store, which the stand-in init below does not need: its address goes unchecked here
    # (test_bad_inputs' rendezvous rows check it).
    monkeypatch.setattr(ranks_module, "_check_rendezvous_address", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls["set_device"].append(index))

    def init_process_group(backend, **kwargs) -> None:
        calls["init"].append(backend)
        joined.append(True)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(joined))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    return calls


def test_join_ranks_puts_the_rank_on_its_gpu_before_joining_a_group_with_gloo_beside_nccl(fake_cuda_ranks) -> None:
    ranks = join_ranks(timeout_s=30)
    assert (ranks.rank, ranks.world_size) == (3, 4)
    assert fake_cuda_ranks == {"set_device": [1], "init": ["cpu:gloo,cuda:nccl"]}
