"""accelerator_for(): the Accelerator of a device name, or the one given."""

from __future__ import annotations

from typing import Union

import torch

from offload_trainer.runtime.device.accelerator import Accelerator
from offload_trainer.runtime.device.host import CpuAccelerator


def accelerator_for(device: Union[torch.device, str, Accelerator, None]) -> Accelerator:
    """The accelerator of `device`: an Accelerator as is, "cuda[:n]", "cpu", or None (the GPU if any)."""
    if isinstance(device, Accelerator):
        return device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # torch's message lists some twenty device types
        raise ValueError(
            f"device {device!r} is not a device: use 'cpu', 'cuda' ('cuda:N' for one GPU) or a SimulatedAccelerator"
        ) from None
    if device.type == "cpu":
        return CpuAccelerator()
    if device.type == "cuda":
        from offload_trainer.runtime.device.cuda import CudaAccelerator

        return CudaAccelerator(device)
    raise ValueError(f"device {str(device)!r} is not supported: use 'cpu', 'cuda' or a SimulatedAccelerator")
