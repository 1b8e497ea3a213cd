"""Host tiers are pinned (cudaHostRegister) only when the engine's device is a GPU: an engine on the
CPU or the simulated accelerator, on a machine that has a GPU, never copies to it, and pinned memory
can be neither discarded (tiers.release_idle_memory) nor pinned without initialising CUDA.

A machine with a GPU is stood in for: CUDA "available", torch.cuda.cudart() recording registrations.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch

from io_engine import IOConfig, IOEngine
from offload_trainer.config import Tier
from offload_trainer.runtime.device.host import CpuAccelerator, SimulatedAccelerator
from offload_trainer.runtime.groups.tiers import MemoryTiers


class RecordingCudart:
    def __init__(self) -> None:
        self.registered: Dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.registered.pop(ptr, None)
        return 0


class OnAGpu:
    """What MemoryTiers reads of a CUDA accelerator."""

    torch_device = torch.device("cuda", 0)
    is_host = False


@pytest.fixture
def cudart(monkeypatch) -> RecordingCudart:
    fake = RecordingCudart()
    monkeypatch.setattr("io_engine.buffers.cuda_pinning_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


@pytest.mark.parametrize("device", ["cpu", "simulated", "cuda"])
def test_host_memory_is_pinned_for_a_gpu_only(cudart: RecordingCudart, device: str) -> None:
    accel = {"cpu": CpuAccelerator, "simulated": SimulatedAccelerator, "cuda": OnAGpu}[device]()
    io = IOEngine(IOConfig(num_threads=1))
    tiers = MemoryTiers(accel, None, None, io, None)  # type: ignore[arg-type]
    try:
        tiers.reserve(Tier.HOST, 1 << 16)
        tiers.allocate(Tier.HOST, 1024, torch.float32, "home")
        tiers.allocate(Tier.HOST, 1024, torch.float32, "a buffer of its own", own_arena=True)
        assert len(cudart.registered) == (2 if device == "cuda" else 0)
    finally:
        tiers.close()
        io.close()
        if hasattr(accel, "close"):
            accel.close()
    assert not cudart.registered
