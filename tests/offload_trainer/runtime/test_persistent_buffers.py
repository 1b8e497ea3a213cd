"""The model's persistent buffers (what model.state_dict() holds besides parameters: BatchNorm's
running statistics) go with the engine's checkpoints and exports: training resumed from a
checkpoint equals training straight through, buffers included; an export loads into a fresh
model with load_state_dict(strict=True), and back through engine.load_safetensors. Buffers
registered persistent=False stay out of both, as they stay out of model.state_dict()."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offload_trainer as ot
from offload_trainer.errors import CheckpointError
from offload_trainer.runtime.optimizer import torch_param_groups

OPT = ot.OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip_norm=1.0)


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def batches(n: int) -> List[Any]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(n)]


def config(tmp_path: Path) -> ot.OffloadConfig:
    return ot.OffloadConfig(tiers={"params": "nvme", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path)}, optimizer=OPT)


def train_steps(engine: ot.Engine, data: List[Any]) -> None:
    for x, y in data:
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()


def test_resume_keeps_running_statistics(tmp_path: Path) -> None:
    data = batches(3)
    torch.manual_seed(0)
    ref = BatchNormNet()
    opt = torch.optim.AdamW(torch_param_groups(ref, OPT), lr=OPT.lr, betas=OPT.betas, fused=True)
    for x, y in data:
        F.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
        opt.step()
        opt.zero_grad()
    torch.manual_seed(0)
    with ot.initialize(BatchNormNet(), config(tmp_path)) as engine:
        train_steps(engine, data[:2])
        engine.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(1)  # other initial values: all of them come from the checkpoint
    resumed = BatchNormNet()
    with ot.initialize(resumed, config(tmp_path)) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        train_steps(engine, data[2:])
        state = engine.full_state_dict()
    assert [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])] == []
    buffers = dict(resumed.named_buffers())
    assert [n for n, b in ref.named_buffers() if n != "scratch" and not torch.equal(b, buffers[n])] == []
    assert int(buffers["bn.num_batches_tracked"]) == 3


def test_checkpoint_of_other_buffers_is_refused(tmp_path: Path) -> None:
    with ot.initialize(BatchNormNet(), config(tmp_path)) as engine:
        train_steps(engine, batches(1))
        engine.save_checkpoint(tmp_path / "ckpt")
    other = BatchNormNet()
    other.bn.register_buffer("extra", torch.zeros(2))
    with ot.initialize(other, config(tmp_path)) as engine:
        with pytest.raises(CheckpointError, match="checkpoint of another model: its buffers"):
            engine.load_checkpoint(tmp_path / "ckpt")


def test_export_holds_buffers_and_loads_back(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = BatchNormNet()
    with ot.initialize(model, config(tmp_path)) as engine:
        train_steps(engine, batches(2))
        path = engine.export_safetensors(tmp_path / "w.safetensors")
        params = engine.full_state_dict()
        buffers = {n: b.clone() for n, b in model.named_buffers()}
    stored = safetensors_torch.load_file(str(path))
    assert "scratch" not in stored and stored["bn.num_batches_tracked"].dtype == torch.int64
    fresh = BatchNormNet()
    fresh.load_state_dict(stored, strict=True)
    assert all(torch.equal(fresh.state_dict()[n], v) for n, v in {**params, **buffers}.items() if n != "scratch")
    again = BatchNormNet()
    with ot.initialize(again, config(tmp_path)) as engine:
        engine.load_safetensors([path])
        assert all(torch.equal(engine.full_state_dict()[n], v) for n, v in params.items())
    assert torch.equal(again.bn.running_var, buffers["bn.running_var"])
