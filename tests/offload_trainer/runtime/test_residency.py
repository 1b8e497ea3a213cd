"""Residency cannot deadlock: a wrong prediction costs time, and a step that needs more groups at once
than the plan foresaw gets the slots (or, under a budget, a refusal naming the number).

Each run is checked bitwise against plain PyTorch (fused AdamW), so a wrong parameter shows.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload_trainer as ot
from io_engine.engine import IOEngine
from offload_trainer.config import GroupingConfig
from offload_trainer.runtime.device.host import SimulatedAccelerator
from offload_trainer.runtime.layout.partition import plan_partition
from offload_trainer.runtime.optimizer import torch_param_groups

OPT = ot.OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip_norm=1.0)


def slot_bytes(model: nn.Module, grouping: GroupingConfig) -> int:
    plan = plan_partition(model, grouping, world_size=1)
    return max(g.flat_numel for g in plan.groups) * 4


def train_and_compare(model: nn.Module, cfg: ot.OffloadConfig, batches, device: object = "cpu") -> ot.Engine:
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(torch_param_groups(ref, OPT), lr=OPT.lr, betas=OPT.betas, fused=True)
    with ot.initialize(model, cfg, device=device) as engine:
        for x, y in batches:
            ref_loss = nn.functional.cross_entropy(ref(x), y)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
        state = engine.full_state_dict()
    bad = [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
    assert not bad, f"differ from plain PyTorch: {bad}"
    return engine


class Expert(nn.Module):
    compute_s = 0.0
    """Injected compute time before the forward reads the weights (a test sets it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.compute_s)
        return self.down(torch.relu(self.up(x)))


class RoutedLayer(nn.Module):
    """A router weight of its own, and experts called only on the tokens routed to them, so the layer's
    group stays in use while an expert is fetched."""

    def __init__(self, dim: int, n_experts: int) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.randn(dim, n_experts) / dim**0.5)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = (x @ self.router).argmax(-1)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            rows = chosen == e
            out = out.index_put((rows,), self.experts[e](x[rows]))
        return x + out


class RoutedLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, n_layers: int = 2, n_experts: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(RoutedLayer(dim, n_experts) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).flatten(0, 1)


def test_a_wrong_routing_prediction_costs_time_not_the_run(tmp_path) -> None:
    """One group per expert, two device slots (the plan's minimum: a layer and one expert), lookahead 4.
    Each step routes every token of a layer to one expert, a different one per step, so the order
    recorded on the previous step predicts the wrong expert: while the layer's group is in use, the
    other slot holds that expert's prefetch, still loading, when the right expert is acquired. The
    prefetch is cancelled instead of failing the step (it failed with "no device slot is free")."""
    torch.manual_seed(0)
    model = RoutedLM()
    grouping = GroupingConfig(module_classes=("Expert",))
    cfg = ot.OffloadConfig(
        tiers={"params": "host", "grads": "host", "optimizer": "host", "device_budget_bytes": 2 * slot_bytes(model, grouping)},
        grouping=grouping,
        prefetch={"lookahead_groups": 4},
        optimizer=OPT,
    )
    batches = []
    for token in (3, 11, 3, 20, 7):  # the same token everywhere: one expert per layer, data-dependent
        x = torch.full((2, 6), token, dtype=torch.long)
        batches.append((x, torch.randint(0, 32, (12,), generator=torch.Generator().manual_seed(token))))
    engine = train_and_compare(model, cfg, batches)
    assert engine.memory_plan.num_device_slots == 2
    assert engine.stats().prefetch_misses > 0  # the wrong predictions happened


HOST_FRACTION = 0.2
"""Of the parameters' bytes in host memory: the groups are the experts, then the rest, so layer 0's
experts 0 and 1 are in host memory and the others on NVMe; the steps below mispredict expert 2
of layer 0 where expert 1 is used."""


def test_a_cancelled_load_still_reading_is_not_overtaken_by_the_next_load_of_its_slot(tmp_path, monkeypatch) -> None:
    """The wrong predictions above on the simulated accelerator, the mispredicted expert's
    parameters on NVMe and the right one's in host memory, every NVMe read 30 ms late and every
    expert computing 60 ms before it reads its weights (injected): the cancelled prefetch still
    reads into its host staging buffer when its slot is taken for the right expert, and issues its
    copy into the slot only once the read lands, while the right expert computes. The right
    expert's copy into that slot waits for it (the slot's `after`, BufferPool.reuse_after);
    without that wait the cancelled copy lands last, over the weights in use."""
    real = IOEngine._run_block

    def slow(self, block, *args, **kwargs):  # type: ignore[no-untyped-def]
        if block.is_read:
            time.sleep(0.03)
        return real(self, block, *args, **kwargs)

    monkeypatch.setattr(IOEngine, "_run_block", slow)
    monkeypatch.setattr(Expert, "compute_s", 0.06)
    torch.manual_seed(0)
    model = RoutedLM()
    grouping = GroupingConfig(module_classes=("Expert",))
    cfg = ot.OffloadConfig(
        tiers={
            "params": {"host": HOST_FRACTION, "nvme": 1 - HOST_FRACTION}, "grads": "host", "optimizer": "host",
            "nvme_dir": str(tmp_path),
            "device_budget_bytes": 2 * slot_bytes(model, grouping),
        },
        grouping=grouping,
        prefetch={"lookahead_groups": 4},
        optimizer=OPT,
    )
    batches = []
    for token in (3, 11, 3, 20, 7):
        x = torch.full((2, 6), token, dtype=torch.long)
        batches.append((x, torch.randint(0, 32, (12,), generator=torch.Generator().manual_seed(token))))
    device = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001, lazy_s=0.05)
    engine = train_and_compare(model, cfg, batches, device)
    assert engine.stats().prefetch_misses > 0


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class RegionLM(nn.Module):
    """Embedding, then blocks checkpointed three at a time (one region recomputes three groups), head."""

    def __init__(self, vocab: int = 40, dim: int = 16, n_layers: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim) for _ in range(n_layers)])
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for i in range(0, len(self.layers), 3):
            region = self.layers[i : i + 3]
            h = checkpoint(lambda x, r=region: r[2](r[1](r[0](x))), h, use_reentrant=False)
        return self.head(h).flatten(0, 1)


def _region_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 40, (2, 8), generator=g), torch.randint(0, 40, (16,), generator=g)) for _ in range(3)]


def test_a_checkpointed_region_wider_than_the_slots_gets_its_slots(tmp_path) -> None:
    """Recomputing a region of three blocks keeps all three groups referenced at once, more than the two
    slots lookahead 0 plans for: with no device budget the engine adds the slots the step needs."""
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(
        tiers={"params": "host", "grads": "host", "optimizer": "host"}, prefetch={"lookahead_groups": 0}, optimizer=OPT
    )
    engine = train_and_compare(RegionLM(), cfg, _region_batches())
    assert engine.memory_plan.num_device_slots == 2
    assert engine.device_slots is not None and engine.device_slots.num_buffers > 2


def test_a_checkpointed_region_wider_than_the_budget_is_refused_with_the_number(tmp_path) -> None:
    torch.manual_seed(0)
    model = RegionLM()
    budget = 2 * slot_bytes(model, GroupingConfig())
    cfg = ot.OffloadConfig(
        tiers={"params": "host", "grads": "host", "optimizer": "host", "device_budget_bytes": budget},
        prefetch={"lookahead_groups": 0},
        optimizer=OPT,
    )
    x, y = _region_batches()[0]
    with ot.initialize(model, cfg) as engine:
        with pytest.raises(ot.PlanError) as info:
            engine.backward(nn.functional.cross_entropy(engine(x), y))
    message = str(info.value)
    # The region (the last three blocks, recomputed together), the number, and the fix.
    assert "group 'layers.5' needs a device slot" in message and "['layers.3', 'layers.4']" in message, message
    assert f"needs at least 3 slots (the next of {budget // 2} bytes)" in message
    assert f"raise tiers.device_budget_bytes from {budget} to at least" in message
