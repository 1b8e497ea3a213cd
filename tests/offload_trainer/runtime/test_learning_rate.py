"""Learning rates through a checkpoint: a torch.optim.lr_scheduler scheduler driving
engine.lr_optimizer, resumed from engine.save_checkpoint, sets the rates plain PyTorch's resumed
from optimizer.state_dict() + scheduler.state_dict() sets, and the weights stay bitwise equal.

ExponentialLR and CosineAnnealingLR compute each rate from the param group's current one
(chainable), so a resume that started from the peak rate, not the saved one, went on from the
wrong rate for the rest of the run. The scheduler may be attached before or after
load_checkpoint. (The config's own schedule resumed: tests/offload_trainer/app/test_trainer.py.)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, List

import pytest
import torch

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM
from offload_trainer.runtime.optimizer import torch_param_groups

SCHEDULERS = {
    "exponential": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=1e-4),
}
STEPS, SAVED_AT = 5, 3


def config(tmp_path: Path, **optimizer: object) -> ot.OffloadConfig:
    return ot.OffloadConfig(
        tiers={"params": "host", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path / "swap")},
        optimizer={"lr": 3e-3, "grad_clip_norm": 1.0, "weight_decay": 0.1, **optimizer},
    )


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))


def plain_pytorch(cfg: ot.OffloadConfig, make: Callable) -> tuple:
    """Uninterrupted plain PyTorch: the rates of each step and the final weights."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    o = cfg.optimizer
    opt = torch.optim.AdamW(torch_param_groups(model, o), lr=o.lr, betas=o.betas, eps=o.eps, fused=True)
    sched = make(opt)
    rates: List[List[float]] = []
    for step in range(STEPS):
        rates.append([g["lr"] for g in opt.param_groups])
        x = tokens(step)
        model(x, x.roll(-1, 1))[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
    return rates, {n: p.detach() for n, p in model.named_parameters()}


def run_steps(engine: ot.Engine, sched: object, steps: range, rates: List[List[float]]) -> None:
    for step in steps:
        rates.append([g["lr"] for g in engine.param_groups])
        x = tokens(step)
        engine.backward(engine(x, x.roll(-1, 1))[1])
        assert engine.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("attach", ["before_load", "after_load"])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_a_scheduler_resumed_from_a_checkpoint_continues_its_rates(tmp_path: Path, name: str, attach: str) -> None:
    make = SCHEDULERS[name]
    cfg = config(tmp_path)
    ref_rates, ref_weights = plain_pytorch(cfg, make)
    rates: List[List[float]] = []
    torch.manual_seed(0)
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg) as engine:
        sched = make(engine.lr_optimizer)
        run_steps(engine, sched, range(SAVED_AT), rates)
        engine.save_checkpoint(tmp_path / "ckpt")
        sched_state = copy.deepcopy(sched.state_dict())
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg) as engine:
        if attach == "before_load":
            sched = make(engine.lr_optimizer)
            engine.load_checkpoint(tmp_path / "ckpt")
        else:
            engine.load_checkpoint(tmp_path / "ckpt")
            sched = make(engine.lr_optimizer)
        sched.load_state_dict(sched_state)
        run_steps(engine, sched, range(SAVED_AT, STEPS), rates)
        assert rates == ref_rates
        state = engine.full_state_dict()
        bad = [n for n, p in ref_weights.items() if not torch.equal(p, state[n])]
        assert not bad, f"parameters differ from plain PyTorch after the resume: {bad}"


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_weight_decay_changed_in_param_groups_applies_as_in_torch(tmp_path: Path, kind: str) -> None:
    """A weight-decay schedule written into engine.param_groups, as into a torch optimizer's, applies
    to each group's parameters from the next update (it stopped the update thread with a KeyError),
    and goes through a checkpoint with the learning rates."""
    cfg = config(tmp_path, kind=kind, momentum=0.9)
    o = cfg.optimizer
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    ref = copy.deepcopy(model)
    groups = torch_param_groups(ref, o)
    opt = (
        torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True)
        if kind == "adamw"
        else torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, fused=True)
    )

    def schedule(step: int, param_groups: list) -> None:
        for n, group in enumerate(param_groups):
            group["weight_decay"] = 0.5 / (step + 1) if n == 0 else 0.01 * step  # the no-decay group decays too

    with ot.initialize(model, cfg) as engine:
        for step in range(STEPS):
            schedule(step, opt.param_groups)
            schedule(step, engine.param_groups)
            x = tokens(step)
            ref(x, x.roll(-1, 1))[1].backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            engine.backward(engine(x, x.roll(-1, 1))[1])
            engine.step()
            if step == SAVED_AT - 1:
                engine.save_checkpoint(tmp_path / "ckpt")
                saved_groups = [dict(g) for g in engine.param_groups]
        state = engine.full_state_dict()
    bad = [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
    assert not bad, f"parameters differ from plain PyTorch: {bad}"
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert [g["weight_decay"] for g in engine.param_groups] == [g["weight_decay"] for g in saved_groups]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_rates_the_loop_writes_are_kept_and_saved() -> None:
    """LearningRates.follows_schedule: the engine's schedule sets the rates until the loop writes one
    (then they are the loop's, for good, and saved so), or a torch scheduler drives them."""
    from offload_trainer.runtime.learning_rate import LearningRates

    rates = LearningRates(1e-3, [0.1, 0.0])
    assert rates.follows_schedule()
    rates.set_all(2e-3)  # the engine's schedule, step after step
    assert rates.follows_schedule() and not rates.state_dict()["written_by_loop"]
    rates.param_groups[1]["lr"] = 5e-4  # nanoGPT's loop
    assert not rates.follows_schedule()
    rates.param_groups[1]["lr"] = 2e-3  # written back to the schedule's value: still the loop's
    assert not rates.follows_schedule()
    saved = rates.state_dict()
    assert saved["written_by_loop"]
    resumed = LearningRates(1e-3, [0.1, 0.0])
    resumed.load_state_dict(saved)
    assert not resumed.follows_schedule()
    resumed.load_state_dict({k: v for k, v in saved.items() if k != "written_by_loop"})  # one from before: the schedule's
    assert resumed.follows_schedule()
    driven = LearningRates(1e-3, [0.1])
    torch.optim.lr_scheduler.ExponentialLR(driven, gamma=0.5).step()
    assert not driven.follows_schedule() and not driven.state_dict()["written_by_loop"]
