"""Two ranks (gloo, torchrun) train to the one-rank result on the cases test_engine_two_ranks.py
leaves out: shards of uneven size (no tensor's numel divisible by the world size), a frozen
parameter, gradient accumulation, and trainable parameters the forward never uses, in every
block (so that both gradient buckets wait for one at once), under AdamW and SGD with momentum. The
tied embedding and head are one group whose first gradient (head.bias) comes first and whose
last (the tied weight) comes last: its bucket is reduced early, and the tied weight's gradient
reduced in a second bucket of that group and added.

Tolerances as in test_engine_two_ranks.py (its docstring says why): SGD parameters and every
step's global gradient norm within 1e-6 relative, AdamW parameters within 1e-4 relative
(norm-wise per tensor). A parameter no rank's forward used has no gradient, and is skipped by
the update as torch.optim skips it on one rank: it keeps its initial value bit for bit (its
reduced gradient is zeros, which weight decay would otherwise apply to it).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Optional

import pytest
import torch
from torch import nn

import offload_trainer as ot
from offload_trainer.runtime.device.host import SimulatedAccelerator

REPO = Path(__file__).resolve().parents[3]
VOCAB, DIM = 37, 11
OPTIMIZERS = {
    "adamw": {"lr": 1e-2, "weight_decay": 0.1, "grad_clip_norm": 0.5},
    "sgd": {"kind": "sgd", "lr": 1e-1, "momentum": 0.9, "weight_decay": 0.1, "grad_clip_norm": 0.5},
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM + 3)
        self.back = nn.Linear(DIM + 3, DIM)
        self.unused = nn.Linear(DIM, 5)  # trainable, never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.back(torch.tanh(self.fc(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.emb.weight  # one group with head.bias, whose gradient comes first
        self.layers[1].fc.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def train(world: int, rank: int, tiers: Optional[dict] = None, device: object = "cpu") -> Dict[str, dict]:
    """Three steps of two micro-batches under each optimizer; this rank's rows of each global batch.
    `device`: "cpu", or "sim" for a simulated accelerator (a new one per run)."""
    out = {}
    for name, optimizer in OPTIMIZERS.items():
        torch.manual_seed(0)
        model = Model()
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        cfg = ot.OffloadConfig(
            tiers=tiers or {"params": "host", "grads": "host", "optimizer": "host"}, optimizer=optimizer, grad_accum_steps=2
        )
        g = torch.Generator().manual_seed(1)
        norms = []
        accel = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001, lazy_s=0.05) if device == "sim" else device
        with ot.initialize(model, cfg, device=accel) as engine:
            reduces = []  # reduce-scatters issued, counted (on two ranks)
            issue = engine.collectives.start_reduce_scatter_mean
            engine.collectives.start_reduce_scatter_mean = lambda *a, **k: reduces.append(1) or issue(*a, **k)
            for _ in range(3):
                for _ in range(2):
                    x = torch.randint(0, VOCAB, (4, 6), generator=g)
                    y = torch.randint(0, VOCAB, (4, 6), generator=g)
                    logits = engine(x.chunk(world)[rank])
                    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.chunk(world)[rank].reshape(-1))
                    engine.backward(loss / 2)
                engine.step()
                norms.append(engine.stats().grad_norm)
            out[name] = {"state": engine.full_state_dict(), "norms": norms, "initial": initial, "reduces": len(reduces)}
    return out


WORKER = textwrap.dedent(
    """
    import importlib.util, os, sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, {repo!r})
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("case", {test!r})
    case = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(case)
    dist.init_process_group("gloo")
    out = {call}
    if dist.get_rank() == 0:
        torch.save(out, os.path.join({out!r}, "two.pt"))
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple:
    tmp = tmp_path_factory.mktemp("two_ranks_numerics")
    return train(1, 0), _two_ranks(tmp, "case.train(dist.get_world_size(), dist.get_rank())")


def _two_ranks(tmp: Path, call: str) -> dict:
    """What rank 0 of two (torchrun) returns from `call` (a Python expression of the worker's)."""
    script = tmp / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO), test=__file__, out=str(tmp), call=call))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return torch.load(tmp / "two.pt")


def _relative(one: dict, two: dict) -> dict:
    assert one.keys() == two.keys()
    return {n: float((one[n] - two[n]).norm() / one[n].norm().clamp_min(1e-12)) for n in one}


@pytest.mark.parametrize("optimizer,tolerance", [("sgd", 1e-6), ("adamw", 1e-4)])
def test_two_ranks_match_one_with_uneven_shards_frozen_and_unused_parameters(runs, optimizer: str, tolerance: float) -> None:
    one, two = runs[0][optimizer], runs[1][optimizer]
    for a, b in zip(one["norms"], two["norms"]):
        assert abs(a - b) <= 1e-6 * a, (one["norms"], two["norms"])
    # 4 groups, the tied one reduced twice: 5 reduce-scatters per micro-batch, 2 micro-batches, 3 steps.
    assert two["reduces"] == 5 * 2 * 3
    rel = _relative(one["state"], two["state"])
    assert max(rel.values()) <= tolerance, sorted(rel.items(), key=lambda kv: -kv[1])[:3]
    for run in (one, two):
        untouched = [n for n in run["state"] if "unused" in n or n == "layers.1.fc.weight"]
        assert len(untouched) == 7
        moved = [n for n in untouched if not torch.equal(run["state"][n], run["initial"][n])]
        assert not moved, f"parameters without a gradient were updated: {moved}"


# Every tier in every state kind, split within groups: on the simulated accelerator this takes each
# multi-rank path a GPU takes through the copy path (a device home's shard copied on the device
# and all-gathered, an NVMe one read into staging, copied on and all-gathered after its copy, a
# reduced gradient copied off the device into host staging before it is merged or written).
EVERY_TIER = {
    "params": {"device": 0.4, "host": 0.2, "nvme": 0.4},
    "grads": {"device": 0.3, "host": 0.4, "nvme": 0.3},
    "optimizer": {"device": 0.3, "host": 0.3, "nvme": 0.4},
}


def train_on_both_devices(world: int, rank: int, nvme_dir: str) -> Dict[str, dict]:
    """train() on the CPU and on the simulated accelerator, with every tier in use."""
    return {
        device: train(world, rank, dict(EVERY_TIER, nvme_dir=f"{nvme_dir}/{device}-{rank}"), device)
        for device in ("cpu", "sim")
    }


@pytest.mark.slow  # slow (about 20 s: torchrun, four trainings a rank); the copy path's multi-rank ordering
def test_two_ranks_on_the_simulated_accelerator_match_the_cpu_bitwise(tmp_path) -> None:
    """The same two-rank training on the CPU and on the simulated accelerator (copies late, their
    destinations NaN until done) is bitwise alike: a multi-rank path that used a copy's destination
    before the copy landed (an all-gather of a slot whose shard is still being copied, a reduced
    gradient merged before its copy off the device) would compute with NaN or stale values."""
    out = _two_ranks(tmp_path, f"case.train_on_both_devices(dist.get_world_size(), dist.get_rank(), {str(tmp_path)!r})")
    for optimizer in OPTIMIZERS:
        cpu, sim = out["cpu"][optimizer], out["sim"][optimizer]
        assert cpu["norms"] == sim["norms"]
        bad = [n for n in cpu["state"] if not torch.equal(cpu["state"][n], sim["state"][n])]
        assert not bad, f"differ between the CPU and the simulated accelerator: {bad}"
