"""Invariant 1: placement and prefetch change speed, never results.

fp32 on one rank, AdamW with clipping, weight-decay groups and gradient accumulation: after
several steps every parameter must be torch.equal to the same model trained by plain PyTorch
with torch.optim.AdamW(fused=True) (the engine runs that same fused kernel on per-parameter
views of its flat shards).

Each case runs on the CPU and on the simulated accelerator ("sim": a GPU-like device whose copies
finish late, only once waited for, and whose copy destinations hold NaN until they are done), so
every path a GPU takes through the copy path is checked for its ordering here: a use that did not
wait would compute with NaN.
"""

from __future__ import annotations

import copy
import time
from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload_trainer as ot
from io_engine.errors import IntegrityError
from offload_trainer.runtime.device.host import SimulatedAccelerator
from offload_trainer.runtime.optimizer import torch_param_groups

VOCAB = 50


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, residual MLP blocks, head; optionally tied and activation-checkpointed."""

    def __init__(self, dim: int = 16, n_layers: int = 4, tie: bool = False, ckpt: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList([Block(dim) for _ in range(n_layers)])
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.ckpt = ckpt
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False) if self.ckpt else layer(h)
        return self.head(h)


def batches(num_steps: int, accum: int) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randint(0, VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g)) for _ in range(accum)]
        for _ in range(num_steps)
    ]


OPT = ot.OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, grad_clip_norm=0.5)


DEVICES = ["cpu", "sim"]


def accelerator(device: str, **sim: object) -> object:
    """The engine's device for a test: "cpu", or a simulated accelerator whose copies land 1 ms late
    and, lazy, only once something waits for them ([Note: Lazy copies] in copy_worker.py: a missing
    wait shows however long after the copy its use comes; at most 50 ms after their turn)."""
    if device == "sim":
        return SimulatedAccelerator(**{"h2d_delay_s": 0.001, "d2h_delay_s": 0.001, "lazy_s": 0.05, **sim})  # type: ignore[arg-type]
    return device


def train_both(
    model: nn.Module, cfg: ot.OffloadConfig, num_steps: int = 5, device: object = "cpu"
) -> Tuple[nn.Module, Dict[str, torch.Tensor], ot.Engine]:
    """Train a copy with plain PyTorch and the model with the engine on the same batches."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(torch_param_groups(ref, cfg.optimizer), lr=cfg.optimizer.lr, betas=cfg.optimizer.betas, fused=True)
    engine = ot.initialize(model, cfg, device=device)
    loss_fn = nn.CrossEntropyLoss()
    accum = cfg.grad_accum_steps
    try:
        for step in batches(num_steps, accum):
            for x, y in step:
                ref_loss = loss_fn(ref(x).reshape(-1, VOCAB), y.reshape(-1)) / accum
                ref_loss.backward()
                loss = loss_fn(engine(x).reshape(-1, VOCAB), y.reshape(-1)) / accum
                engine.backward(loss)
                assert torch.equal(ref_loss, loss)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.optimizer.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            engine.step()
        return ref, engine.full_state_dict(), engine
    finally:
        engine.close()


def assert_params_equal(ref: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    names = [n for n, _ in ref.named_parameters(remove_duplicate=False)]
    assert sorted(names) == sorted(state)
    bad = [n for n, p in ref.named_parameters(remove_duplicate=False) if not torch.equal(p.detach(), state[n])]
    assert not bad, f"parameters differ from plain PyTorch: {bad}"


PLACEMENTS = {
    "all-device": dict(params="device", grads="device", optimizer="device"),
    "all-host": dict(params="host", grads="host", optimizer="host"),
    "all-nvme": dict(params="nvme", grads="nvme", optimizer="nvme"),
    "mixed": dict(
        params={"host": 0.5, "nvme": 0.5}, grads={"device": 0.3, "nvme": 0.7}, optimizer={"host": 0.2, "nvme": 0.8}
    ),
    # A group's state split between the device and the other tiers: on an accelerator its update runs
    # on the host, its device homes copied off and written back on the copy path.
    "split": dict(
        params={"device": 0.5, "nvme": 0.5}, grads={"device": 0.5, "host": 0.5}, optimizer={"device": 0.3, "host": 0.7}
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["plain", "tied", "checkpointed"])
@pytest.mark.parametrize("lookahead", [0, 1, 4])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_fp32_matches_plain_pytorch_bitwise(tmp_path, placement: str, lookahead: int, variant: str, device: str) -> None:
    torch.manual_seed(0)
    model = TinyLM(tie=variant == "tied", ckpt=variant == "checkpointed")
    cfg = ot.OffloadConfig(
        tiers=dict(PLACEMENTS[placement], nvme_dir=str(tmp_path)),
        prefetch={"lookahead_groups": lookahead},
        optimizer=OPT,
        grad_accum_steps=2,
    )
    ref, state, _ = train_both(model, cfg, device=accelerator(device))
    assert_params_equal(ref, state)


def test_sgd_with_momentum_matches_plain_pytorch(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    opt_cfg = ot.OptimizerConfig(kind="sgd", lr=0.05, momentum=0.9, weight_decay=0.01)
    cfg = ot.OffloadConfig(tiers=dict(PLACEMENTS["mixed"], nvme_dir=str(tmp_path)), optimizer=opt_cfg)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(torch_param_groups(ref, opt_cfg), lr=0.05, momentum=0.9, fused=True)
    loss_fn = nn.CrossEntropyLoss()
    with ot.initialize(model, cfg) as engine:
        for step in batches(4, 1):
            x, y = step[0]
            loss_fn(ref(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            engine.backward(loss_fn(engine(x).reshape(-1, VOCAB), y.reshape(-1)))
            engine.step()
        assert_params_equal(ref, engine.full_state_dict())


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_parameters_are_paged_but_never_updated(tmp_path, device: str) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    for p in model.layers[1].parameters():
        p.requires_grad_(False)
    model.emb.weight.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = ot.OffloadConfig(tiers=dict(PLACEMENTS["all-nvme"], nvme_dir=str(tmp_path)), optimizer=OPT)
    ref, state, engine = train_both(model, cfg, num_steps=3, device=accelerator(device))
    assert_params_equal(ref, state)
    assert torch.equal(state["emb.weight"], before["emb.weight"])
    assert all(torch.equal(state[n], before[n]) for n in before if n.startswith("layers.1."))
    frozen_group = next(g for g in engine.groups if g.plan.name == "layers.1")
    assert frozen_group.grad_home is None and not frozen_group.optimizer_homes


@pytest.mark.parametrize("placement", ["all-device", "all-host", "all-nvme", "mixed"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_group_with_frozen_and_trainable_parameters_matches(tmp_path, placement: str, device: str) -> None:
    """LoRA's shape: frozen weights beside trainable ones in one group, whose gradient and optimizer
    homes hold only the trainable part (the frozen ones get no view of them)."""
    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.layers:
        layer.fc1.weight.requires_grad_(False)
        layer.norm.bias.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    cfg = ot.OffloadConfig(tiers=dict(PLACEMENTS[placement], nvme_dir=str(tmp_path)), optimizer=OPT, grad_accum_steps=2)
    ref, state, _ = train_both(model, cfg, num_steps=2, device=accelerator(device))
    assert_params_equal(ref, state)
    assert all(torch.equal(state[n], t) for n, t in before.items())


def test_callable_lr_schedule_and_byte_capped_prefetch_match(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    schedule = lambda step: 1e-2 / (1 + step)  # noqa: E731
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(torch_param_groups(ref, OPT), lr=1e-2, betas=OPT.betas, fused=True)
    cfg = ot.OffloadConfig(
        tiers=dict(PLACEMENTS["all-nvme"], nvme_dir=str(tmp_path)),
        prefetch={"lookahead_groups": 4, "lookahead_bytes": 40_000},
        optimizer=OPT,
    )
    loss_fn = nn.CrossEntropyLoss()
    with ot.initialize(model, cfg, lr_schedule=schedule) as engine:
        for step, batch in enumerate(batches(4, 1)):
            x, y = batch[0]
            for group in opt.param_groups:
                group["lr"] = schedule(step)
            loss_fn(ref(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            engine.backward(loss_fn(engine(x).reshape(-1, VOCAB), y.reshape(-1)))
            engine.step()
        assert_params_equal(ref, engine.full_state_dict())


def test_accumulating_nvme_gradients_waits_for_their_own_writes(tmp_path, monkeypatch) -> None:
    """Every write lands 250 ms late, longer than a micro-batch takes here: reading a gradient
    extent back for the next micro-batch must wait for the previous micro-batch's write to it
    (a stale read changes the result)."""
    import io_engine.transfer as transfer

    real_pwritev = transfer.os.pwritev

    def slow_pwritev(fd, buffers, offset):  # type: ignore[no-untyped-def]
        time.sleep(0.25)
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(transfer.os, "pwritev", slow_pwritev)
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(
        # Everything on NVMe: 12 staging buffers for 4 groups, so no shortage of buffers forces
        # the writes to finish first and hides the hazard.
        tiers=dict(PLACEMENTS["all-nvme"], nvme_dir=str(tmp_path)),
        optimizer=OPT,
        grad_accum_steps=3,
    )
    ref, state, _ = train_both(TinyLM(n_layers=2), cfg, num_steps=1)
    assert_params_equal(ref, state)


# -- the copy path's ordering, shown on the simulated accelerator ---------------------------------


@pytest.mark.parametrize(
    "skipped, placement",
    [
        ("param load", "all-host"),  # the compute reads a device slot before its copy from the host landed
        ("gradient copy", "split"),  # gradients merged into their host home before their copy off the device
        ("optimizer read", "split"),  # a device home updated on the host before its copy off the device
    ],
)
def test_removing_one_wait_breaks_parity(tmp_path, skipped: str, placement: str) -> None:
    """The same training as above, with one named wait of the simulated accelerator turned off (a
    test-only switch): the destination of that copy still holds NaN, so the numbers go wrong, or
    (when the early read reaches a swap file before its data landed) the chunk's checksum stops the
    step: either way the missing wait is loud."""
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(
        tiers=dict(PLACEMENTS[placement], nvme_dir=str(tmp_path)), prefetch={"lookahead_groups": 1}, optimizer=OPT
    )
    ref, state, _ = train_both(TinyLM(), cfg, num_steps=2, device=accelerator("sim"))
    assert_params_equal(ref, state)  # with every wait in place: bitwise
    torch.manual_seed(0)
    with pytest.raises((AssertionError, IntegrityError)):
        ref, state, _ = train_both(TinyLM(), cfg, num_steps=2, device=accelerator("sim", skip_waits=[skipped]))
        assert_params_equal(ref, state)


def test_a_checkpoint_loaded_between_micro_batches_drops_the_gradients_left_staged(tmp_path) -> None:
    """[Note: Merges left for later] in gradients.py: on an accelerator a backward before the step's
    last leaves the staged gradients whose copies are still in flight unmerged (here all of them:
    the copies are lazy). A checkpoint loaded then starts the step over, as it did when every
    backward merged at once (the next first gradient overwrites the homes): what was left staged is
    dropped, not merged into the step that follows. So an engine that ran one more backward before
    the load ends bitwise where one that did not ends."""
    torch.manual_seed(0)
    model = TinyLM(n_layers=1)
    steps = batches(2, 2)
    states = []
    for extra in (False, True):
        cfg = ot.OffloadConfig(
            tiers=dict(PLACEMENTS["all-host"], nvme_dir=str(tmp_path / f"swap-{extra}")), optimizer=OPT,
            grad_accum_steps=2,
        )
        with ot.initialize(copy.deepcopy(model), cfg, device=accelerator("sim")) as engine:
            engine.save_checkpoint(tmp_path / f"start-{extra}")
            if extra:
                x, y = steps[1][0]
                engine.backward(nn.functional.cross_entropy(engine(x).reshape(-1, VOCAB), y.reshape(-1)) / 2)
                engine.load_checkpoint(tmp_path / f"start-{extra}")
            for x, y in steps[0]:
                engine.backward(nn.functional.cross_entropy(engine(x).reshape(-1, VOCAB), y.reshape(-1)) / 2)
            assert engine.step()
            states.append(engine.full_state_dict())
    bad = [n for n in states[0] if not torch.equal(states[0][n], states[1][n])]
    assert not bad, f"the backward before the load reached the step after it: {bad}"


def _slow(out: torch.Tensor, compute_s: float) -> torch.Tensor:
    """`out`, after sleeping `compute_s`, whose gradient also takes `compute_s` (injected compute)."""
    time.sleep(compute_s)
    if out.requires_grad:
        out.register_hook(lambda grad: time.sleep(compute_s))
    return out


class SlowLM(TinyLM):
    """TinyLM where the embedding, every block and the head each compute for `compute_s` in forward
    and in backward (injected delays standing for compute)."""

    compute_s = 0.03

    def __init__(self) -> None:
        super().__init__(n_layers=6)
        for module in [self.emb, *self.layers, self.head]:
            module.register_forward_hook(lambda _m, _args, out: _slow(out, self.compute_s))


def _copy_wait_per_step(tmp_path, lookahead: int, copy_delay_s: float) -> Tuple[float, int]:
    torch.manual_seed(0)
    model = SlowLM()
    cfg = ot.OffloadConfig(
        tiers={"params": "host", "grads": "host", "optimizer": "host", "nvme_dir": str(tmp_path)},
        prefetch={"lookahead_groups": lookahead},
        optimizer=OPT,
    )
    sim = SimulatedAccelerator(h2d_delay_s=copy_delay_s, d2h_delay_s=0.0)
    waits = []
    with ot.initialize(model, cfg, device=sim) as engine:
        for x, y in [b[0] for b in batches(3, 1)]:
            engine.backward(nn.functional.cross_entropy(engine(x).reshape(-1, VOCAB), y.reshape(-1)))
            engine.step()
            waits.append(engine.stats().copy_wait_s)
        loads = engine.stats().prefetch_hits + engine.stats().prefetch_misses
    return min(waits[1:]), loads  # after the recording step, which prefetches nothing


def test_prefetched_copies_hide_behind_compute(tmp_path) -> None:
    """Every host-to-device copy lands 20 ms late (injected) and every group's module computes for
    30 ms in forward and in backward:
    with lookahead the copies of the next groups run while the current one computes, so the wait the
    training thread sees (the engine's copy_wait_s counter) is far below delay x loads; without
    lookahead it is about delay x loads."""
    delay = 0.02
    exposed_0, loads = _copy_wait_per_step(tmp_path / "a", lookahead=0, copy_delay_s=delay)
    exposed_2, _ = _copy_wait_per_step(tmp_path / "b", lookahead=2, copy_delay_s=delay)
    assert exposed_0 >= 0.8 * delay * loads, (exposed_0, loads)
    assert exposed_2 <= 0.25 * delay * loads, (exposed_2, exposed_0, loads)


def test_step_counts_on_the_device_follow_a_checkpoint_loaded_into_a_running_engine(tmp_path) -> None:
    """Every state on the (simulated) device: each group is updated there, with its step counts kept
    on the device too ([Note: Step counts on the device] in runtime/optimizer.py). A checkpoint
    loaded after more steps sets the counts back: the next steps' bias corrections must be the
    checkpoint's, as for an engine that starts from it."""
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(tiers=dict(PLACEMENTS["all-device"], nvme_dir=str(tmp_path)), optimizer=OPT)
    data = [b[0] for b in batches(6, 1)]
    loss_fn = nn.CrossEntropyLoss()

    def train(engine: ot.Engine, steps: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in steps:
            engine.backward(loss_fn(engine(x).reshape(-1, VOCAB), y.reshape(-1)))
            engine.step()

    model = TinyLM()
    fresh = copy.deepcopy(model)
    with ot.initialize(model, cfg, device=accelerator("sim")) as engine:
        train(engine, data[:2])
        engine.save_checkpoint(tmp_path / "ckpt")
        train(engine, data[2:4])
        engine.load_checkpoint(tmp_path / "ckpt")
        train(engine, data[4:])
        again = engine.full_state_dict()
    with ot.initialize(fresh, cfg, device=accelerator("sim")) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        train(engine, data[4:])
        resumed = engine.full_state_dict()
    assert all(torch.equal(again[k], resumed[k]) for k in resumed)
