"""Gradient homes lent from the heap on the CPU ([Note: Gradient homes lent from the heap] in
runtime/gradients.py): a home the compute adds into in place is, per parameter, the gradient autograd
allocated (as plain PyTorch's `.grad`), from its first gradient of a step until the group's update has
read it, so that backward's freed activations can hold it and the next forward's activations can reuse
it. The arena holds no such home, the budget counts it all the same, the optimizer keeps no view of
it, and results stay bitwise plain PyTorch's.
"""

from __future__ import annotations

import copy
from typing import Dict

import pytest
import torch
from torch import nn

import offload_trainer as ot
from offload_trainer.config import Tier
from offload_trainer.runtime.optimizer import torch_param_groups
from tests.offload_trainer.runtime.test_engine_parity import (
    OPT, VOCAB, TinyLM, accelerator, assert_params_equal, batches,
)


def _config(tmp_path, grads: str, accum: int = 1) -> ot.OffloadConfig:
    # The bench's 124M placement (gradients in host memory), or gradients on the device tier.
    return ot.OffloadConfig(
        tiers=dict(params="nvme", grads=grads, optimizer="nvme", nvme_dir=str(tmp_path)),
        optimizer=OPT,
        grad_accum_steps=accum,
    )


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


@pytest.mark.parametrize("grads", ["host", "device"])
@pytest.mark.parametrize("tie", [False, True])
def test_lent_homes_train_bitwise_and_go_back_after_their_update(tmp_path, grads: str, tie: bool) -> None:
    torch.manual_seed(0)
    model = TinyLM(dim=64, n_layers=2, tie=tie)
    ref = copy.deepcopy(model)
    cfg = _config(tmp_path, grads, accum=2)
    opt = torch.optim.AdamW(torch_param_groups(ref, cfg.optimizer), lr=OPT.lr, betas=OPT.betas, fused=True)
    loss_fn = nn.CrossEntropyLoss()
    engine = ot.initialize(model, cfg, device="cpu")
    try:
        assert engine.memory_plan.grad_homes_lent
        homes = [g.grad_home for g in engine.groups if g.grad_home is not None]
        assert homes and all(h.lent and h.tensor is None and h.pieces is None for h in homes)  # nothing before a gradient
        for k, step in enumerate(batches(4, 2)):
            for m, (x, y) in enumerate(step):
                ref_loss = loss_fn(ref(x).reshape(-1, VOCAB), y.reshape(-1)) / 2
                ref_loss.backward()
                loss = loss_fn(engine(x).reshape(-1, VOCAB), y.reshape(-1)) / 2
                if m == 0 and k > 0:
                    # The step's first forward loaded every group after its update: every home given back,
                    # and nothing of the engine still refers to its memory (it is the allocator's again).
                    assert all(h.pieces is None for h in homes)
                    assert storages and all(_use_count(s) == 1 for s in storages)
                if m == 1:
                    # The second micro-batch's forward leaves the first one's gradients in their homes.
                    assert all(h.pieces is not None for h in homes)
                engine.backward(loss)
                assert torch.equal(ref_loss, loss)
            storages = [t.untyped_storage() for h in homes for t in h.pieces if t is not None]
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            engine.step()
            # The optimizer keeps no view of a lent home (new every step: the views would keep it).
            assert not [key for key in engine.optimizer._views if key[2] == "grad"]
        assert_params_equal(ref, engine.full_state_dict())
    finally:
        engine.close()


def test_lent_homes_are_in_no_arena_but_in_the_budget(tmp_path) -> None:
    """The host arena is smaller by the grad homes' bytes than the same plan's on the simulated
    accelerator (whose homes are carved from it), and the host tier's account counts them alike."""
    arena: Dict[str, int] = {}
    counted: Dict[str, int] = {}
    for device in ("cpu", "sim"):
        torch.manual_seed(0)
        engine = ot.initialize(TinyLM(dim=64, n_layers=2), _config(tmp_path / device, "host"), device=accelerator(device))
        try:
            mp = engine.memory_plan
            grad_bytes = sum(g.grad_home.nbytes for g in engine.groups if g.grad_home is not None)
            assert grad_bytes > 0
            assert mp.grad_homes_lent == (device == "cpu")
            arena[device] = sum(mp.arena_bytes[Tier.HOST]) + (grad_bytes if device == "cpu" else 0)
            counted[device] = engine.tiers.accounts[Tier.HOST].resident_bytes
            assert counted[device] >= grad_bytes
        finally:
            engine.close()
    # The simulated accelerator stages gradients for its host homes (more staging): compare homes alone.
    assert arena["cpu"] <= arena["sim"]
    sim_staging = counted["sim"] - arena["sim"]
    assert counted["cpu"] == arena["cpu"] and sim_staging == 0


def test_a_group_without_a_gradient_this_step_is_updated_from_none(tmp_path) -> None:
    """A group whose home was given back at its load and that got no gradient in that step (a module
    called under no_grad) has no tensor at its update, and is left as plain PyTorch leaves it."""

    class Skips(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)
            self.use_b = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            if self.use_b:
                return self.b(x)
            with torch.no_grad():  # called (its group loaded, its home given back), but no gradient
                self.b(x)
            return x

    torch.manual_seed(0)
    model = Skips()
    ref = copy.deepcopy(model)
    cfg = ot.OffloadConfig(
        tiers=dict(params="nvme", grads="host", optimizer="nvme", nvme_dir=str(tmp_path)),
        optimizer=OPT,
        grouping=dict(module_classes=["Linear"]),
    )
    opt = torch.optim.AdamW(torch_param_groups(ref, cfg.optimizer), lr=OPT.lr, betas=OPT.betas, fused=True)
    engine = ot.initialize(model, cfg, device="cpu")
    g = torch.Generator().manual_seed(3)
    try:
        for k in range(4):
            model.use_b = ref.use_b = k % 2 == 0
            x = torch.randn(8, 64, generator=g)
            ref(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            engine.backward(engine(x).square().mean())
            engine.step()
        assert_params_equal(ref, engine.full_state_dict())
    finally:
        engine.close()


def test_a_first_gradient_is_kept_not_copied(tmp_path) -> None:
    """A plain fp32 gradient becomes its lent home's piece as autograd made it: no copy of it is
    allocated (the memory a tensor hook on the parameter saw autograd hand to AccumulateGrad)."""
    torch.manual_seed(0)
    model = TinyLM(dim=64, n_layers=2)
    seen: Dict[str, int] = {}
    weight = model.layers[0].fc1.weight
    # Its address only: a reference kept here would make AccumulateGrad copy it into .grad.
    weight.register_hook(lambda g: seen.__setitem__("grad", g.data_ptr()))
    engine = ot.initialize(model, _config(tmp_path, "host"), device="cpu")
    try:
        ((x, y),) = batches(1, 1)[0]
        engine.backward(nn.functional.cross_entropy(engine(x).reshape(-1, VOCAB), y.reshape(-1)))
        group, i = engine._param_refs[id(weight)]
        piece = group.grad_home.pieces[i]
        assert piece is not None and piece.data_ptr() == seen["grad"]
        engine.step()
    finally:
        engine.close()
