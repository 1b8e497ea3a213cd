"""Small models of random structure, trained through the engine bitwise equal to plain PyTorch.

Each seed builds a model from random parts: nesting, a ModuleList that repeats a module, weights
shared between modules and tied to the embedding (or read by the root for its logits), checkpointed
regions, modules that read a child's weights without calling it (their own `F.linear(x,
self.proj.weight)`, nn.MultiheadAttention), and routed experts whose use changes with the data;
then a random grouping, placement, lookahead and device (the CPU or the simulated accelerator),
with the device budget at the plan's minimum most of the time. A step that needs more device slots
than the minimum at once (a checkpointed region wider than it) may be refused with the number: the
run is then repeated with the budget it names (a refusal comes at the first step, or at a later one
where routing makes a checkpointed region use more groups than before). Three steps of AdamW with clipping and weight decay,
then every parameter must equal plain PyTorch's.

    pytest tests/offload_trainer/runtime/test_random_structures.py            # the fixed seeds
    pytest -m slow tests/offload_trainer/runtime/test_random_structures.py    # the sweep
"""

from __future__ import annotations

import copy
import random
import re
from dataclasses import dataclass
from typing import List, Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import offload_trainer as ot
from offload_trainer.config import GroupingConfig, Tier
from offload_trainer.runtime.device.host import SimulatedAccelerator
from offload_trainer.runtime.layout.memory_plan import plan_memory
from offload_trainer.runtime.layout.partition import plan_partition
from offload_trainer.runtime.optimizer import torch_param_groups

VOCAB = 20
DIM = 8
OPT = ot.OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip_norm=1.0)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Reader(nn.Module):
    """Its own gain, and a child whose weights it reads without calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(DIM))
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(F.linear(x, self.proj.weight, self.proj.bias)) * self.gain


class BareReader(nn.Module):
    """No parameter of its own: reads a grandchild's weight, and calls the child that holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 0.5 * F.linear(x, self.inner.fc2.weight @ self.inner.fc1.weight)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mha = nn.MultiheadAttention(DIM, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.mha(h, h, h, need_weights=False)[0]


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x))


class Routed(nn.Module):
    """Each token goes to one expert, chosen by the data: which experts run changes from step to step."""

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.randn(DIM, n_experts))
        self.experts = nn.ModuleList(Expert() for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = (x @ self.router).argmax(-1)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            rows = chosen == e
            out = out.index_put((rows,), self.experts[e](x[rows]))
        return x + out


class Nest(nn.Module):
    """A wrapper around another unit, with or without a norm of its own."""

    def __init__(self, inner: nn.Module, norm: bool) -> None:
        super().__init__()
        self.inner = inner
        self.norm = nn.LayerNorm(DIM) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.norm(x) if self.norm is not None else x)


class RandomLM(nn.Module):
    def __init__(self, units: List[nn.Module], regions: List[Tuple[int, int, bool]], head: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.units = nn.ModuleList(units)
        self.regions = regions
        self.head_kind = head
        self.head = nn.Linear(DIM, VOCAB) if head != "read" else None
        if head == "tied":
            assert self.head is not None
            self.head.weight = self.emb.weight

    def _run(self, start: int, end: int, h: torch.Tensor) -> torch.Tensor:
        for unit in self.units[start:end]:
            h = unit(h)
        return h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for start, end, ckpt in self.regions:
            h = checkpoint(self._run, start, end, h, use_reentrant=False) if ckpt else self._run(start, end, h)
        if self.head is None:
            return F.linear(h, self.emb.weight)
        return self.head(h)


def _unit(rng: random.Random, depth: int = 0) -> nn.Module:
    kind = rng.choice(["mlp", "mlp", "reader", "bare", "attn", "routed", "nest"] if depth < 2 else ["mlp", "reader"])
    if kind == "mlp":
        return Mlp()
    if kind == "reader":
        return Reader()
    if kind == "bare":
        return BareReader()
    if kind == "attn":
        return Attn()
    if kind == "routed":
        return Routed(rng.randint(2, 4))
    return Nest(_unit(rng, depth + 1), norm=rng.random() < 0.5)


@dataclass
class Case:
    model: nn.Module
    cfg: ot.OffloadConfig
    simulated: bool
    data_seed: int

    def __str__(self) -> str:
        t = self.cfg.tiers
        return (
            f"units={[type(u).__name__ for u in self.model.units]} regions={self.model.regions} "
            f"head={self.model.head_kind} grouping={self.cfg.grouping} params={t.params} grads={t.grads} "
            f"optimizer={t.optimizer} budget={t.device_budget_bytes} lookahead={self.cfg.prefetch.lookahead_groups} "
            f"simulated={self.simulated}"
        )


PLACEMENTS = ["host", "host", "device", "nvme", "host:0.5,nvme:0.5", "device:0.5,host:0.5"]


def make_case(seed: int, nvme_dir: str) -> Case:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    units: List[nn.Module] = [_unit(rng) for _ in range(rng.randint(2, 5))]
    if rng.random() < 0.4:  # a module listed twice
        units.insert(rng.randint(0, len(units)), units[rng.randrange(len(units))])
    mlps = [m for u in units for m in u.modules() if isinstance(m, Mlp)]
    if len(mlps) >= 2 and rng.random() < 0.5:  # a weight shared between two modules
        a, b = rng.sample(mlps, 2)
        b.fc1.weight = a.fc1.weight
    regions = []
    start = 0
    while start < len(units):
        end = rng.randint(start + 1, len(units))
        regions.append((start, end, rng.random() < 0.4))
        start = end
    model = RandomLM(units, regions, rng.choice(["linear", "tied", "read"]))

    present = sorted({type(m).__name__ for m in model.modules()} & {"Mlp", "Expert", "Reader", "Attn", "Nest", "BareReader"})
    choice = rng.random()
    if choice < 0.35:
        grouping = GroupingConfig()
    elif choice < 0.5:
        grouping = GroupingConfig(max_group_bytes=rng.choice([1, 2048, 8192]))
    else:
        grouping = GroupingConfig(module_classes=tuple(rng.sample(present, rng.randint(1, len(present)))))
    lookahead = rng.randint(0, 4)
    simulated = rng.random() < 0.4
    tiers = {
        "params": rng.choice(PLACEMENTS),
        "grads": rng.choice(PLACEMENTS),
        "optimizer": rng.choice(PLACEMENTS),
        "nvme_dir": nvme_dir,
    }
    cfg = ot.OffloadConfig(tiers=tiers, grouping=grouping, prefetch={"lookahead_groups": lookahead}, optimizer=OPT)
    if rng.random() < 0.75:  # the device budget at the plan's minimum
        partition = plan_partition(model, grouping)
        minimum = plan_memory(partition, cfg, 0, torch.float32, device_is_host=not simulated).min_bytes[Tier.DEVICE]
        if minimum:
            cfg = ot.OffloadConfig(
                tiers={**tiers, "device_budget_bytes": minimum}, grouping=grouping,
                prefetch={"lookahead_groups": lookahead}, optimizer=OPT,
            )
    return Case(model, cfg, simulated, seed)


def train_bitwise(case: Case) -> None:
    """Train the case's model three steps through the engine and with plain PyTorch; compare bitwise. A
    refusal that names the device budget the step needs is retried with that budget."""
    cfg = case.cfg
    for _attempt in range(16):  # each refusal names one more slot than the region has used so far
        model = copy.deepcopy(case.model)
        ref = copy.deepcopy(case.model)
        opt = torch.optim.AdamW(torch_param_groups(ref, OPT), lr=OPT.lr, betas=OPT.betas, fused=True)
        g = torch.Generator().manual_seed(case.data_seed)
        device = SimulatedAccelerator(h2d_delay_s=0.0005, d2h_delay_s=0.0005) if case.simulated else "cpu"
        engine = ot.Engine(model, cfg, device=device)
        try:
            for step in range(3):
                x = torch.randint(0, VOCAB, (2, 4), generator=g)
                y = torch.randint(0, VOCAB, (8,), generator=g)
                F.cross_entropy(ref(x).flatten(0, 1), y).backward()
                torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
                opt.step()
                opt.zero_grad()
                try:
                    engine.backward(F.cross_entropy(engine(x).flatten(0, 1), y))
                except ot.PlanError as refusal:
                    need = re.search(r"raise tiers.device_budget_bytes from \d+ to at least (\d+)", str(refusal))
                    # At the first step; later where routing grows a checkpointed region's groups.
                    assert need is not None, f"{case}: step {step}: {refusal}"
                    cfg = ot.OffloadConfig(
                        tiers={**cfg.tiers.__dict__, "device_budget_bytes": int(need.group(1))},
                        grouping=cfg.grouping, prefetch=cfg.prefetch, optimizer=OPT,
                    )
                    break
                engine.step()
            else:
                state = engine.full_state_dict()
                bad = [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
                assert not bad, f"{case}: differ from plain PyTorch: {bad}"
                return
        finally:
            engine.close()
    raise AssertionError(f"{case}: refused again and again")


CI_SEEDS = list(range(24)) + [1130]
"""1130 (from the slow sweep): a group of the head and the embedding with an NVMe gradient home, its
head's entry flushed early ([Note: A merge's second buffer] in gradients.py) and the embedding's after
it; the second flush wrote its buffer's stale head regions over the head's gradients."""


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_random_structure_trains_bitwise(seed: int, tmp_path) -> None:
    train_bitwise(make_case(seed, str(tmp_path)))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1000, 1240))
def test_random_structure_sweep(seed: int, tmp_path) -> None:
    train_bitwise(make_case(seed, str(tmp_path)))
