"""bf16 and fp16 compute against plain PyTorch doing the same math, bit for bit.

The reference keeps the model in the compute dtype and an fp32 master copy of every parameter;
each micro-batch's low-precision gradients are cast to fp32 and summed (old + new, autograd's
order), clipped with clip_grad_norm_, and torch.optim.AdamW(fused=True) updates the master, whose
rounding is copied into the model: what runtime/precision.py documents the engine does. fp16 adds
torch.amp.GradScaler: the loss is scaled before backward, unscale_ before clipping, a step whose
gradients hold inf or nan is skipped and halves the scale, growth_interval good steps double it
(the engine's loss_scale_window). The scales here are powers of two, so unscaling is exact and
the engine's one multiply by clip * (1 / scale) equals GradScaler's two: bitwise throughout.
"""

from __future__ import annotations

import copy
from typing import List, Tuple

import pytest
import torch
from torch import nn

import offload_trainer as ot
from offload_trainer.runtime.optimizer import torch_param_groups

from tests.offload_trainer.runtime.test_engine_parity import VOCAB, TinyLM, batches

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ACCUM = 2


def reference(model: nn.Module, cfg: ot.OffloadConfig, steps: int) -> Tuple[List[torch.Tensor], List[float], dict]:
    """Plain PyTorch: the losses, the loss scale after each step (fp16) and the final fp32 master weights."""
    dtype = DTYPES[cfg.precision.compute_dtype.value]
    low = copy.deepcopy(model).to(dtype)
    master = {id(p): nn.Parameter(p.detach().clone()) for p in model.parameters()}
    groups = [
        {"params": [master[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]}
        for g in torch_param_groups(model, cfg.optimizer)
    ]
    o = cfg.optimizer
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True)
    p16 = cfg.precision
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=p16.initial_loss_scale, growth_interval=p16.loss_scale_window, enabled=dtype is torch.float16
    )
    pairs = list(zip(low.parameters(), (master[id(p)] for p in model.parameters())))
    loss_fn = nn.CrossEntropyLoss()
    losses, scales = [], []
    for step in batches(steps, ACCUM):
        for x, y in step:
            loss = loss_fn(low(x).reshape(-1, VOCAB), y.reshape(-1)) / ACCUM
            scaler.scale(loss).backward()
            losses.append(loss.detach())
            for p, m in pairs:  # the compute dtype's gradient, summed in fp32
                if p.grad is not None:
                    m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                p.grad = None
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([m for _, m in pairs], o.grad_clip_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale() if scaler.is_enabled() else 1.0)
        with torch.no_grad():
            for p, m in pairs:
                p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    return losses, scales, {n: m.detach() for n, (_, m) in zip(names, pairs)}


def engine_run(model: nn.Module, cfg: ot.OffloadConfig, steps: int) -> Tuple[List[torch.Tensor], List[float], dict]:
    loss_fn = nn.CrossEntropyLoss()
    losses, scales = [], []
    with ot.initialize(model, cfg) as engine:
        for step in batches(steps, ACCUM):
            for x, y in step:
                loss = loss_fn(engine(x).reshape(-1, VOCAB), y.reshape(-1)) / ACCUM
                engine.backward(loss)
                losses.append(loss.detach())
            engine.step()
            scales.append(engine.stats().loss_scale)
        return losses, scales, engine.full_state_dict()


@pytest.mark.parametrize(
    "precision",
    [
        {"compute_dtype": "bf16"},
        # 2^22 overflows fp16 at first: skipped steps halve it until it fits, then two good steps double it.
        {"compute_dtype": "fp16", "initial_loss_scale": 2.0**22, "loss_scale_window": 2},
    ],
    ids=["bf16", "fp16"],
)
def test_low_precision_matches_plain_pytorch_with_an_fp32_master(tmp_path, precision: dict) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "host", "optimizer": {"host": 0.5, "nvme": 0.5}, "nvme_dir": str(tmp_path)},
        optimizer={"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "grad_clip_norm": 0.5},
        precision=precision,
        grad_accum_steps=ACCUM,
    )
    steps = 10
    ref_losses, ref_scales, ref_master = reference(model, cfg, steps)
    losses, scales, state = engine_run(model, cfg, steps)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert scales == ref_scales
    if precision["compute_dtype"] == "fp16":
        assert scales[0] < 2.0**22 and any(b > a for a, b in zip(scales, scales[1:])), scales  # backoff and growth seen
    bad = [n for n in ref_master if not torch.equal(ref_master[n], state[n])]
    assert not bad, f"master weights differ from plain PyTorch's: {bad}"


class NormBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.register_buffer("shift", torch.linspace(-1, 1, dim))  # keeps its dtype: cast in forward
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.relu(self.bn(self.fc(x) + self.shift.to(x.dtype)))


class NormNet(nn.Module):
    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([NormBlock(dim) for _ in range(3)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).float().pow(2).mean()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_batchnorm_statistics_follow_the_compute_dtype_as_in_plain_pytorch(dtype: str) -> None:
    """BatchNorm's running statistics take the compute dtype, as model.to(dtype) makes them (torch's
    batch_norm refuses fp32 statistics with a bf16 weight); other buffers keep theirs."""
    torch.manual_seed(0)
    model = NormNet()
    low = copy.deepcopy(model).to(DTYPES[dtype])
    for block, own in zip(low.blocks, model.blocks):
        block.shift.data = own.shift.clone()  # as the engine keeps it: fp32
    master = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = torch.optim.SGD(master, lr=0.1, momentum=0.9, fused=True)
    cfg = ot.OffloadConfig(
        tiers={"params": "host", "grads": "host", "optimizer": "host"},
        optimizer={"kind": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0},
        precision={"compute_dtype": dtype, "initial_loss_scale": 1.0},
    )
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 12, generator=g).to(DTYPES[dtype]) for _ in range(3)]
    with ot.initialize(model, cfg) as engine:
        for x in xs:
            low(x).backward()
            for p, m in zip(low.parameters(), master):
                m.grad = p.grad.float()
                p.grad = None
            opt.step()
            with torch.no_grad():
                for p, m in zip(low.parameters(), master):
                    p.copy_(m)
            engine.backward(engine(x))
            engine.step()
            assert not engine.stats().skipped
        state = engine.full_state_dict()
        buffers = dict(model.named_buffers())
    names = [n for n, _ in model.named_parameters()]
    bad = [n for n, m in zip(names, master) if not torch.equal(m.detach(), state[n])]
    assert not bad, f"master weights differ from plain PyTorch's: {bad}"
    for name, ref in low.named_buffers():
        assert buffers[name].dtype == ref.dtype and torch.equal(buffers[name], ref), name
    assert buffers["blocks.0.bn.running_mean"].dtype == DTYPES[dtype]
    assert buffers["blocks.0.shift"].dtype == torch.float32
