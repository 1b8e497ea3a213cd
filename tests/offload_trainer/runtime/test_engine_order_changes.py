"""Invariant 4: order is learned, and never trusted blindly.

A mixture-of-experts model whose experts are groups of their own changes the order (and set) of
groups between steps as routing changes; eval forwards and a different number of micro-batches
change it too. Training must still match plain PyTorch bit for bit, with prefetch on, and the
engine's stats must show the re-recordings.
"""

from __future__ import annotations

import copy

import pytest
import torch

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM, MoEConfig, MoEDecoderLM
from offload_trainer.runtime.device.host import SimulatedAccelerator
from offload_trainer.runtime.optimizer import torch_param_groups

OPT = ot.OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip_norm=1.0)


def reference_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(torch_param_groups(model, OPT), lr=OPT.lr, betas=OPT.betas, fused=True)


def assert_same_params(ref: torch.nn.Module, engine: ot.Engine) -> None:
    state = engine.full_state_dict()
    bad = [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
    assert not bad, f"differ from plain PyTorch: {bad}"


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("lookahead", [1, 3])
def test_moe_routing_changes_order_and_still_matches(tmp_path, lookahead: int, device: str) -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(n_experts=4, n_layers=2)
    model = MoEDecoderLM(cfg)
    ref = copy.deepcopy(model)
    opt = reference_optimizer(ref)
    engine_cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path)},
        grouping={"module_classes": ["SwiGLU"]},
        prefetch={"lookahead_groups": lookahead},
        optimizer=OPT,
    )
    g = torch.Generator().manual_seed(3)
    re_records = []
    accelerator = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001) if device == "sim" else "cpu"
    with ot.initialize(model, engine_cfg, device=accelerator) as engine:
        expert_groups = [grp for grp in engine.groups if ".experts." in grp.plan.name]
        assert len(expert_groups) == cfg.n_layers * cfg.n_experts
        for step in range(6):
            # Constant-token batches route every token to one expert per layer, a different one per step.
            token = int(torch.randint(0, cfg.vocab_size, (1,), generator=g))
            x = torch.full((2, 8), token, dtype=torch.long)
            y = torch.randint(0, cfg.vocab_size, (2, 8), generator=g)
            ref(x, y)[1].backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            engine.backward(engine(x, y)[1])
            engine.step()
            re_records.append(engine.stats().re_records)
        assert_same_params(ref, engine)
    assert re_records[-1] >= 1, f"routing changed the order but nothing was re-recorded: {re_records}"


def test_eval_forwards_and_changing_micro_batches_match(tmp_path) -> None:
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    ref = copy.deepcopy(model)
    opt = reference_optimizer(ref)
    engine_cfg = ot.OffloadConfig(
        tiers={"params": "nvme", "grads": "nvme", "optimizer": "host", "nvme_dir": str(tmp_path)},
        prefetch={"lookahead_groups": 2},
        optimizer=OPT,
        grad_accum_steps=2,
    )
    g = torch.Generator().manual_seed(5)
    with ot.initialize(model, engine_cfg) as engine:
        # step() updates at the accumulation boundary: after at least grad_accum_steps micro-batches.
        for step, micro_batches in enumerate([2, 2, 3, 4, 2]):
            for _ in range(micro_batches):
                x = torch.randint(0, 256, (2, 16), generator=g)
                y = torch.randint(0, 256, (2, 16), generator=g)
                ref(x, y)[1].backward()
                engine.backward(engine(x, y)[1])
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            engine.step()
            with torch.no_grad():
                x = torch.randint(0, 256, (1, 8), generator=g)
                assert torch.equal(ref(x), engine(x))
        assert_same_params(ref, engine)
        assert engine.stats().re_records >= 1
