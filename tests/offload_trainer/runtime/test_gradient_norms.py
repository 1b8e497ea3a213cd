"""The gradient norms clipping uses: taken per group with one _foreach_norm (runtime/gradients.py),
they must give exactly the total norm torch.nn.utils.clip_grad_norm_ returns, also when a
parameter's gradient came only from an earlier micro-batch of the step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload_trainer as ot
from offload_trainer.runtime.device.host import SimulatedAccelerator
from offload_trainer.runtime.optimizer import torch_param_groups


class Branchy(nn.Module):
    """A trunk always used and a branch used only when asked (data-dependent use)."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(dim, 3 * dim), nn.GELU(), nn.Linear(3 * dim, dim))
        self.branch = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.trunk(x)
        if use_branch:
            h = h + self.branch(h)
        return self.head(h).square().mean()


OPT = ot.OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip_norm=0.05)


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_norm_is_clip_grad_norms_total_when_a_branch_skips_the_last_micro_batch(tmp_path, device: str, tier: str) -> None:
    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(torch_param_groups(ref, OPT), lr=OPT.lr, betas=OPT.betas, fused=True)
    cfg = ot.OffloadConfig(
        tiers=dict(params=tier, grads=tier, optimizer=tier, nvme_dir=str(tmp_path)), optimizer=OPT, grad_accum_steps=2
    )
    accel = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001) if device == "sim" else device
    engine = ot.initialize(model, cfg, device=accel)
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(3):
            for micro, use_branch in enumerate([True, False]):  # the branch only in the first micro-batch
                x = torch.randn(5, 24, generator=g)
                (ref(x, use_branch) / 2).backward()
                engine.backward(engine(x, use_branch) / 2)
            total = torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            assert engine.step()
            assert engine.stats().grad_norm == float(total), f"step {step}"
        state = engine.full_state_dict()
    finally:
        engine.close()
    for name, p in ref.named_parameters():
        assert torch.equal(p.detach(), state[name]), name
