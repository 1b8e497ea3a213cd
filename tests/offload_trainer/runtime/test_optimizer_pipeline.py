"""The optimizer step hidden behind the next forward ([Note: Hiding the optimizer step]).

The updates run on the pipeline's worker thread while the next forward computes; results stay
bitwise those of plain PyTorch (fp32, one rank) with clipping active and inactive, accumulation, a
skipped non-finite step and a checkpoint taken while updates are still running. The overlap is
shown with injected delays (each group's update made slow by a test hook) and asserted on the
engine's counters (optimizer_exposed_s, optimizer_total_s), never on the wall clock. So is the
read-ahead of the first groups' states for the next pass (every NVMe read made slow; counters
optimizer_groups_read_ahead, optimizer_bytes_read_ahead, optimizer_exposed_s).
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import nn

import offload_trainer as ot
from io_engine import IOEngine
from offload_trainer.runtime.device.host import SimulatedAccelerator
from offload_trainer.runtime.device.pending import HostEvent
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.optimizer import StreamingOptimizer, torch_param_groups
from offload_trainer.runtime.optimizer_pipeline import OptimizerPipeline

VOCAB = 40


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.tanh(self.norm(x)))


class SmallLM(nn.Module):
    def __init__(self, n_layers: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList([Block(dim) for _ in range(n_layers)])
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


PLACEMENTS = {
    "all-host": dict(params="host", grads="host", optimizer="host"),
    "all-nvme": dict(params="nvme", grads="nvme", optimizer="nvme"),
    # As bench_offload's gpt2-124m: every state the update reads ahead is on NVMe, its gradient is not.
    "nvme-but-grads": dict(params="nvme", grads="host", optimizer="nvme"),
}


def batches(num_steps: int, accum: int, seed: int = 1) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [(torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g)) for _ in range(accum)]
        for _ in range(num_steps)
    ]


def loss_of(model: object, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))  # type: ignore[operator]


def config(
    tmp_path: Path, placement: str, clip: Optional[float], accum: int = 1, lookahead: int = 1, groups_ahead: int = 2
) -> ot.OffloadConfig:
    return ot.OffloadConfig(
        tiers=dict(PLACEMENTS[placement], nvme_dir=str(tmp_path / "swap")),
        prefetch={"lookahead_groups": lookahead, "optimizer_groups_ahead": groups_ahead},
        optimizer=ot.OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, grad_clip_norm=clip),
        grad_accum_steps=accum,
    )


class Reference:
    """The same model trained by plain PyTorch: fused AdamW, clip_grad_norm_."""

    def __init__(self, model: nn.Module, cfg: ot.OffloadConfig) -> None:
        self.model = copy.deepcopy(model)
        o = cfg.optimizer
        self.opt = torch.optim.AdamW(torch_param_groups(self.model, o), lr=o.lr, betas=o.betas, fused=True)
        self.clip = o.grad_clip_norm
        self.accum = cfg.grad_accum_steps

    def step(self, batch: List[Tuple[torch.Tensor, torch.Tensor]], poison: bool = False) -> float:
        for x, y in batch:
            loss = loss_of(self.model, x, y) / self.accum
            (loss * float("nan") if poison else loss).backward()
        norm = float("nan")
        if self.clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip))
        if not poison:
            self.opt.step()
        self.opt.zero_grad()
        return norm


def engine_step(engine: ot.Engine, batch: List[Tuple[torch.Tensor, torch.Tensor]], poison: bool = False) -> None:
    for x, y in batch:
        loss = loss_of(engine, x, y) / len(batch)
        engine.backward(loss * float("nan") if poison else loss)
    assert engine.step()


def assert_params_equal(ref: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    bad = [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
    assert not bad, f"parameters differ from plain PyTorch: {bad}"


def slow_updates(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """Test hook: every group's update takes `delay_s` longer (an injected delay standing for a
    slow CPU optimizer or its NVMe IO)."""
    real = StreamingOptimizer._update

    def slow(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(delay_s)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(StreamingOptimizer, "_update", slow)


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("clip", [0.05, 1e6], ids=["clipping", "not-clipping"])
@pytest.mark.parametrize("placement", ["all-host", "all-nvme"])
def test_hidden_updates_match_plain_pytorch_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, placement: str, clip: float, accum: int
) -> None:
    slow_updates(monkeypatch, 0.002)  # so that updates are surely still running when the forward starts
    torch.manual_seed(0)
    model = SmallLM()
    cfg = config(tmp_path, placement, clip, accum)
    ref = Reference(model, cfg)
    with ot.initialize(model, cfg) as engine:
        for batch in batches(4, accum):
            norm = ref.step(batch)
            engine_step(engine, batch)
            assert (norm > clip) == (clip < 1), "the case does not clip as its name says"
        assert_params_equal(ref.model, engine.full_state_dict())


def test_a_non_finite_step_skips_and_the_next_steps_stay_exact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SmallLM()
    cfg = config(tmp_path, "all-nvme", 0.5)
    ref = Reference(model, cfg)
    with ot.initialize(model, cfg) as engine:
        for k, batch in enumerate(batches(5, 1)):
            poison = k == 2
            ref.step(batch, poison=poison)
            engine_step(engine, batch, poison=poison)
            assert engine.stats().skipped == poison and engine.stats().nonfinite == poison
        assert_params_equal(ref.model, engine.full_state_dict())


def test_a_checkpoint_taken_while_updates_run_holds_them_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Updates take 20 ms a group, so save_checkpoint() right after step() finds them running: it
    must wait for all of them. Resumed, training continues bitwise as if never interrupted."""
    slow_updates(monkeypatch, 0.02)
    torch.manual_seed(0)
    model = SmallLM()
    cfg = config(tmp_path, "all-nvme", 0.5, lookahead=0)
    data = batches(4, 1)
    ref = Reference(model, cfg)
    fresh = copy.deepcopy(model)
    with ot.initialize(model, cfg) as engine:
        for batch in data[:2]:
            ref.step(batch)
            engine_step(engine, batch)
        assert any(not engine.pipeline.is_done(g.index) for g in engine.groups), "updates were not running"
        engine.save_checkpoint(tmp_path / "ckpt")
        for batch in data[2:]:
            ref.step(batch)
            engine_step(engine, batch)
        straight = engine.full_state_dict()
    assert_params_equal(ref.model, straight)
    cfg2 = config(tmp_path / "b", "all-nvme", 0.5, lookahead=0)
    with ot.initialize(fresh, cfg2) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        for batch in data[2:]:
            engine_step(engine, batch)
        resumed = engine.full_state_dict()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def _slow_forward(model: nn.Module, compute_s: float) -> None:
    """Every block, the embedding and the head compute for `compute_s` in forward (injected)."""
    for module in [model.emb, *model.layers, model.head]:  # type: ignore[union-attr]
        module.register_forward_hook(lambda _m, _a, _o: time.sleep(compute_s))


def test_exposed_optimizer_time_is_a_small_part_of_its_duration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each group's update takes 15 ms (injected) and each group's forward 40 ms: the updates run
    behind the next forward, so the training thread waits only for the first groups' updates
    (the engine's optimizer_exposed_s), a small part of the updates' own time (optimizer_total_s)."""
    delay_s = 0.015
    slow_updates(monkeypatch, delay_s)
    torch.manual_seed(0)
    model = SmallLM(n_layers=10)
    _slow_forward(model, 0.04)
    cfg = config(tmp_path, "all-host", 0.5, lookahead=1)
    exposed: List[float] = []
    total: List[float] = []
    with ot.initialize(model, cfg) as engine:
        num_groups = sum(1 for g in engine.groups if g.local_trainable_numel)
        for batch in batches(4, 1):
            engine_step(engine, batch)
            exposed.append(engine.stats().optimizer_exposed_s)
            total.append(engine.stats().optimizer_total_s)
    # From the second step on, a step's counters hold the previous step's update pass.
    for e, t in zip(exposed[1:], total[1:]):
        assert t >= num_groups * delay_s, (t, num_groups)
        # About two groups' updates of twelve are waited for: those of the first group and of
        # the one prefetched with it (lookahead 1).
        assert e <= 0.35 * t, (exposed, total)


def test_a_pass_wakes_the_waiting_thread_only_for_what_it_waits_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: Whom a group's update wakes]: every group's update (each 5 ms late, injected) woke the
    training thread waiting in wait_all twice, once per change of the group's state, 24 times on this
    12-group model; it is woken by the end of the pass alone. A wait for one group (wait_group) is
    woken by that group's changes only. Results stay bitwise plain PyTorch's."""
    slow_updates(monkeypatch, 0.005)
    torch.manual_seed(0)
    model = SmallLM(n_layers=10)
    cfg = config(tmp_path, "all-host", 0.5)
    ref = Reference(copy.deepcopy(model), cfg)
    with ot.initialize(model, cfg) as engine:
        pipeline = engine.pipeline
        wakeups: List[int] = []
        real_wait = pipeline._cond.wait

        def counted_wait(timeout: Optional[float] = None) -> bool:
            woke = real_wait(timeout)
            wakeups.append(1)
            return woke

        monkeypatch.setattr(pipeline._cond, "wait", counted_wait)
        last = engine._update_order()[-1]
        for k, batch in enumerate(batches(4, 1)):
            ref.step(batch)
            engine_step(engine, batch)
            wakeups.clear()
            if k % 2:
                engine.wait_for_updates()
                assert len(wakeups) <= 1, wakeups  # the pass's end (none if it ended before the wait)
            else:
                pipeline.wait_group(last)  # the pass's last group: its two changes, and maybe the end
                assert len(wakeups) <= 3, wakeups
        assert_params_equal(ref.model, engine.full_state_dict())


def slow_nvme_reads(
    monkeypatch: pytest.MonkeyPatch, delay_s: float, groups: Optional[Callable[[], Sequence[str]]] = None
) -> None:
    """Test hook: every NVMe read (each block of it, on the IO engine's workers) lands `delay_s` late;
    with `groups` (the names of the groups meant, asked at each read), only the reads of their homes."""
    real = IOEngine._run_block

    def slow(self, block, *args, **kwargs):  # type: ignore[no-untyped-def]
        label = getattr(block.check, "label", None) or ""
        if block.is_read and (groups is None or label.startswith(tuple(f"group {n!r}" for n in groups()))):
            time.sleep(delay_s)
        return real(self, block, *args, **kwargs)

    monkeypatch.setattr(IOEngine, "_run_block", slow)


def _slow_backward(model: nn.Module, compute_s: float) -> None:
    """Every block and the head compute for `compute_s` in backward (injected)."""
    for module in [*model.layers, model.head]:  # type: ignore[union-attr]
        module.register_full_backward_hook(lambda _m, _gi, _go: time.sleep(compute_s))


def waits_for_the_pass(
    engine: ot.Engine, data: List[List[Tuple[torch.Tensor, torch.Tensor]]], ref: Optional[Reference] = None
) -> List[Tuple[float, float, StepStats]]:
    """Train on `data`, one micro-batch a step. Per step but the last, what the training thread
    waited for between the start of its step() and the end of the next forward, where its update
    pass runs (the engine's counters): (exposed optimizer time, exposed IO time, the stats of the
    step holding that forward). Between a backward and the next step() the pass before and its
    reads ahead are waited for, off the counts: on a loaded machine that pass's tail could
    otherwise still run at the next step(), whose waits then held a read for a reason these tests
    are not about (CI saw 105 ms)."""
    out: List[Tuple[float, float, StepStats]] = []
    in_step: Optional[Tuple[float, float]] = None
    for batch in data:
        (x, y), = batch
        loss = loss_of(engine, x, y)
        if in_step is not None:
            running = engine._running
            out.append((in_step[0] + running.optimizer_exposed_s, in_step[1] + running.io_wait_s, running))
        engine.backward(loss)
        engine.wait_for_updates()  # the pass and its reads ahead are issued ...
        for loaded in engine.pipeline._ahead.loads.values():
            for read in loaded.reads:
                read.wait()  # ... and landed
        before = (engine._running.optimizer_exposed_s, engine._running.io_wait_s)
        assert engine.step()
        stats = engine.stats()
        if ref is not None:
            ref.step(batch)  # not between step() and the forward: the pass would run behind it
        if out:
            out[-1] = (*out[-1][:2], stats)  # the step that held the forward, now whole
        # The forward's waits count in the next step's counters (reset now).
        in_step = (stats.optimizer_exposed_s - before[0], stats.io_wait_s - before[1])
    return out


@pytest.mark.parametrize("groups_ahead", [0, 2])
def test_states_read_ahead_take_the_reads_out_of_the_wait_for_the_first_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, groups_ahead: int
) -> None:
    """Every NVMe read of the first two groups the forward needs lands 100 ms late (injected). A pass
    that reads its groups' states only once it starts makes the next forward wait at least one read
    for the first group it needs (the optimizer_exposed_s of step() and that forward >= 100 ms); with
    optimizer_groups_ahead=2 the pass before read the first two groups' states again once done, and
    they wait for their updates only, not for any read (< 100 ms). Each module's forward takes 400 ms
    (injected), so that the later groups' reads in the pass land behind the forward; they are not
    delayed, so that on a loaded machine one landing late cannot stand in for the first groups'
    (a run at load 12 waited 100.7 ms). Results stay bitwise those of plain PyTorch."""
    delay_s = 0.1
    torch.manual_seed(0)
    model = SmallLM(n_layers=2)
    cfg = config(tmp_path, "nvme-but-grads", 0.5, lookahead=1, groups_ahead=groups_ahead)
    ref = Reference(model, cfg)
    _slow_forward(model, 0.4)
    with ot.initialize(model, cfg) as engine:
        slow_nvme_reads(monkeypatch, delay_s, lambda: [engine.groups[gi].plan.name for gi in engine._update_order()[:2]])
        waits = waits_for_the_pass(engine, batches(4, 1), ref)
        first = [engine.groups[gi] for gi in engine._update_order()[:2]]
        homes = [h for g in first for h in (g.param_home, *g.optimizer_homes.values())]
        ahead_bytes = sum(h.nbytes for h in homes)
        # waits[k]: step k's pass, in step k+1's counters, which also hold pass k's own counts
        # (with what it read ahead for pass k+1).
        for k, (exposed, _, stats) in enumerate(waits):
            assert stats.optimizer_groups_read_ahead == groups_ahead
            assert stats.optimizer_bytes_read_ahead == (ahead_bytes if groups_ahead else 0)
            if k >= 1:  # the pass started on states read ahead (or not): the first pass has none
                if groups_ahead:
                    assert exposed < delay_s, waits
                else:
                    assert exposed >= delay_s, waits
        assert_params_equal(ref.model, engine.full_state_dict())


def test_loading_a_checkpoint_drops_the_states_read_ahead(tmp_path: Path) -> None:
    """States read ahead for the next pass are the old ones once a checkpoint is loaded into the
    running engine: it must drop them, so that training from there matches a fresh engine's."""
    torch.manual_seed(0)
    model = SmallLM()
    fresh = copy.deepcopy(model)
    cfg = config(tmp_path, "nvme-but-grads", 0.5)
    data = batches(5, 1)
    with ot.initialize(model, cfg) as engine:
        engine_step(engine, data[0])
        engine.save_checkpoint(tmp_path / "ckpt")
        for batch in data[1:3]:
            engine_step(engine, batch)
        engine.wait_for_updates()
        assert engine.stats().optimizer_groups_read_ahead == 2, "nothing was read ahead"
        engine.load_checkpoint(tmp_path / "ckpt")
        for batch in data[1:]:
            engine_step(engine, batch)
        reloaded = engine.full_state_dict()
    with ot.initialize(fresh, config(tmp_path / "b", "nvme-but-grads", 0.5)) as engine:
        for batch in data:
            engine_step(engine, batch)
        straight = engine.full_state_dict()
    assert all(torch.equal(straight[k], reloaded[k]) for k in straight)


def slow_state_writes(monkeypatch: pytest.MonkeyPatch, group_name: str, delay_s: float) -> List[float]:
    """Test hook: every NVMe write of group `group_name`'s moments (each block of it, on the IO
    engine's workers) lands `delay_s` late; its parameter's writes do not. Returns the list the
    delayed writes append to as they start: the earliest time.perf_counter() each can land."""
    real = IOEngine._run_block
    lands: List[float] = []

    def slow(self, block, *args, **kwargs):  # type: ignore[no-untyped-def]
        label = getattr(block.check, "label", None) or ""
        if not block.is_read and label.startswith(f"group '{group_name}'") and "exp_avg" in label:
            lands.append(time.perf_counter() + delay_s)
            time.sleep(delay_s)
        return real(self, block, *args, **kwargs)

    monkeypatch.setattr(IOEngine, "_run_block", slow)
    return lands


@pytest.mark.parametrize("param_first", [True, False], ids=["param-written-first", "one-request"])
def test_the_next_forward_waits_for_the_parameter_write_not_the_moments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, param_first: bool
) -> None:
    """The first group the next forward loads has its moments' NVMe writes land 500 ms late
    (injected). Written in a request of their own after the parameter's ([Note: The parameter
    written first]), they keep the forward's load of that group waiting for the parameter only
    (the load's wait, timed around the scheduler's before_load, well under the delay); in the
    group's one request (the split turned off), the load waits for them too. Results stay
    bitwise those of plain PyTorch either way. (Loads that read the home, as a load does where
    the pass began the group before the load asked: the loads filled by the pass itself are off
    here, see the test after this one.)"""
    delay_s = 0.5
    torch.manual_seed(0)
    model = SmallLM(n_layers=2)
    ref_model = copy.deepcopy(model)
    cfg = config(tmp_path, "all-nvme", 0.5, lookahead=1, groups_ahead=0)
    ref = Reference(ref_model, cfg)
    with ot.initialize(model, cfg) as engine:
        engine.scheduler.fill_from_update = lambda gi, shard, after: None
        engine.optimizer.param_write_first_bytes = 0 if param_first else 1 << 62
        first = engine.groups[engine._update_order()[0]]
        lands = slow_state_writes(monkeypatch, first.plan.name, delay_s)
        waits: List[float] = []
        early: List[float] = []  # per load of the first group: how long before its moments could land it ended
        before_load = engine.scheduler.before_load

        def timed_before_load(gi: int) -> None:
            start = time.perf_counter()
            before_load(gi)
            if gi == first.index:
                end = time.perf_counter()
                waits.append(end - start)
                # The previous pass's moment writes of the group were issued before this load ended
                # (this step's pass starts after its forward): the latest issued bounds them.
                early.append(max(lands, default=float("-inf")) - end)

        engine.scheduler.before_load = timed_before_load
        requests: List[int] = []
        for k, batch in enumerate(batches(3, 1)):
            ref.step(batch)
            waits.clear()
            early.clear()
            engine_step(engine, batch)
            requests.append(engine.stats().optimizer_nvme_requests)
            if k == 0:
                continue  # the first forward loads what no pass updated
            # This step's forward loaded the first group right after the previous step's pass
            # updated it (the first of this step's loads of it is the one that may wait).
            if param_first:
                assert waits[0] < 0.5 * delay_s, waits
            else:
                # The load ended after the moments landed (whether it, or step() before it, waited
                # for them: on a loaded machine the forward may begin after they land). Where a load
                # did not wait for them it ends up to delay_s before they can have landed.
                assert early[0] <= 0.0, (early, waits)
        groups = sum(1 for g in engine.groups if g.local_trainable_numel)
        # A read and a write request per group, and one more write where the parameter goes first.
        assert requests[-1] == (3 if param_first else 2) * groups, requests
        assert_params_equal(ref.model, engine.full_state_dict())


def slow_param_io(monkeypatch: pytest.MonkeyPatch, group_name: str, delay_s: float) -> None:
    """Test hook: every NVMe write and read of group `group_name`'s parameter home (each block of it,
    on the IO engine's workers) lands `delay_s` late."""
    real = IOEngine._run_block

    def slow(self, block, *args, **kwargs):  # type: ignore[no-untyped-def]
        if (getattr(block.check, "label", None) or "") == f"group '{group_name}' param":
            time.sleep(delay_s)
        return real(self, block, *args, **kwargs)

    monkeypatch.setattr(IOEngine, "_run_block", slow)


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("from_update", [True, False], ids=["from-the-update", "read-back"])
def test_the_next_forward_takes_the_first_group_from_its_update_not_from_nvme(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, from_update: bool
) -> None:
    """[Note: The next forward's load from the update]: every NVMe write and read of the parameter
    home of the first group the next forward loads lands 300 ms late (injected). Loaded from the
    update pass itself, that forward waits for the group's update only: what the training thread
    waits for from step() to the end of the next forward (the engine's optimizer_exposed_s and
    io_wait_s) stays under a third of the delay, and the load's bytes count as filled by the pass,
    not read. Read back from the home (fills off), it waits for the write (>= the delay, exposed
    optimizer time) and then for the read. Each module's forward takes 400 ms (injected), so that
    the later groups' updates run behind it. On the CPU and on the simulated accelerator, whose
    copies land late (their destination NaN until then); results stay bitwise plain PyTorch's."""
    delay_s = 0.3
    torch.manual_seed(0)
    model = SmallLM(n_layers=2)
    cfg = config(tmp_path, "nvme-but-grads", 0.5, lookahead=1, groups_ahead=2)
    ref = Reference(model, cfg)
    _slow_forward(model, 0.4)
    accel = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001, lazy_s=0.05) if device == "sim" else device
    with ot.initialize(model, cfg, device=accel) as engine:
        if not from_update:
            engine.scheduler.fill_from_update = lambda gi, shard, after: None
        data = batches(4, 1)
        waits_for_the_pass(engine, data[:1], ref)  # records the order: the first group is known
        first = engine.groups[engine._update_order()[0]]
        slow_param_io(monkeypatch, first.plan.name, delay_s)
        waits = waits_for_the_pass(engine, data[1:], ref)
        assert len(waits) == 2
        for exposed, io_wait, stats in waits:
            if from_update:
                assert exposed + io_wait < delay_s / 3, waits
                assert stats.param_bytes_from_update >= first.param_home.nbytes, stats
            else:
                assert exposed >= delay_s, waits
                assert stats.param_bytes_from_update == 0, stats
        assert_params_equal(ref.model, engine.full_state_dict())


class _InterruptedWrite(HostEvent):
    """A write still in flight whose first wait is interrupted (Ctrl-C lands in it)."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False

    def wait(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt()
        super().wait()


class _NoOptimizer:
    def drop(self, ahead: object) -> None:
        pass


@pytest.mark.parametrize("write", ["param", "group"])
@pytest.mark.parametrize("wait", ["wait_params", "wait_group", "wait_all"])
def test_a_wait_interrupted_leaves_the_write_to_the_next_wait(write: str, wait: str) -> None:
    """[Note: Writes leave the list once over]: a Ctrl-C in a wait for an update's write (the next
    forward's load, a checkpoint) left the write off the list, so the next wait returned at once
    and a load read the home before the write landed (old values trained on, silently). The
    write stays listed until it is over: the next wait waits for it."""
    pipeline = OptimizerPipeline(_NoOptimizer(), 2, StepStats())  # type: ignore[arg-type]
    try:
        pending = _InterruptedWrite()
        group = SimpleNamespace(index=1)
        if write == "param":  # the parameter's own request, the moments' beside it (landed)
            moments = HostEvent()
            moments.set()
            pipeline._on_params_written(group, [pending])  # type: ignore[arg-type]
            pipeline._on_written(group, [moments])  # type: ignore[arg-type]
        else:
            pipeline._on_written(group, [pending])  # type: ignore[arg-type]
        call = getattr(pipeline, wait)
        args = () if wait == "wait_all" else (1,)
        with pytest.raises(KeyboardInterrupt):
            call(*args)
        threading.Timer(0.2, pending.set).start()
        call(*args)
        assert pending.done(), f"{wait} returned before the interrupted write landed"
        pipeline.wait_all()
        assert pipeline.is_done(1)
    finally:
        pipeline.close()


class _FillingOptimizer:
    """A pass over its groups in order, without states: group i's "update" writes i + 1 into the
    load it fills, if one asked ([Note: The next forward's load from the update]); it waits for
    `gate` before group 1, and raises `fail_at`'s error at that group if set."""

    def __init__(self, fail_at: Optional[int] = None) -> None:
        self.gate = threading.Event()
        self.fail_at = fail_at

    def update(self, prepared, lrs, stats, on_written, ahead, on_params_written, fill_for):  # type: ignore[no-untyped-def]
        for group in prepared.groups:
            if group.index == 1:
                assert self.gate.wait(10)
            if group.index == self.fail_at:
                raise OSError(5, "injected EIO")
            target = fill_for(group)
            if target is not None:
                copy = HostEvent()
                target.shard.fill_(group.index + 1.0)
                copy.set()
                target.add(copy)
                target.issued()
            on_written(group, [])

    def read_ahead(self, order, max_groups, reserve, stats):  # type: ignore[no-untyped-def]
        from offload_trainer.runtime.optimizer import ReadAhead
        return ReadAhead()

    def drop(self, ahead: object) -> None:
        pass


def _filling_pipeline(fail_at: Optional[int] = None) -> Tuple[OptimizerPipeline, _FillingOptimizer, SimpleNamespace]:
    optimizer = _FillingOptimizer(fail_at)
    pipeline = OptimizerPipeline(optimizer, 3, StepStats())  # type: ignore[arg-type]
    prepared = SimpleNamespace(groups=[SimpleNamespace(index=i) for i in range(3)])
    return pipeline, optimizer, prepared


def test_a_load_filled_by_a_held_pass_starts_it_and_one_withdrawn_is_never_written() -> None:
    """A pass submitted held (step() submits so, and starts it after the next forward's first loads
    asked for their fills) starts at the first wait for it: the fill's own wait too, or a load in
    step() would wait for it forever. A load cancelled before the pass began its group withdraws
    its fill: done at once (its slot free after its last users), and the pass never writes it."""
    pipeline, optimizer, prepared = _filling_pipeline()
    try:
        pipeline.submit(prepared, {}, held=True)  # type: ignore[arg-type]
        shards = [torch.zeros(4) for _ in range(3)]
        fills = [pipeline.fill_params(i, shards[i], []) for i in range(3)]
        assert all(fills) and not any(f.done() for f in fills)  # type: ignore[union-attr]
        assert pipeline.fill_params(0, torch.zeros(4), []) is None, "one fill per group"
        fills[2].cancel()  # type: ignore[union-attr]
        assert fills[2].done()  # type: ignore[union-attr]
        fills[0].wait()  # type: ignore[union-attr]  # starts the held pass
        assert torch.equal(shards[0], torch.full((4,), 1.0))
        assert pipeline.fill_params(0, torch.zeros(4), []) is None, "the pass has begun (done) group 0"
        optimizer.gate.set()
        fills[1].wait()  # type: ignore[union-attr]
        pipeline.wait_all()
        assert torch.equal(shards[1], torch.full((4,), 2.0))
        assert torch.equal(shards[2], torch.zeros(4)), "a withdrawn fill was written"
    finally:
        optimizer.gate.set()
        pipeline.close()


def test_the_loads_of_a_pass_that_failed_raise_its_error_once_and_never_hang() -> None:
    """The pass fails at group 1 (injected EIO) with loads of groups 1 and 2 waiting to be filled:
    both are over; the first wait raises the pass's own error, the other an error naming its group
    (the pass's failure is raised once, [Note: A pass that failed part-way]), and wait_all after
    them has nothing left to raise."""
    pipeline, optimizer, prepared = _filling_pipeline(fail_at=1)
    try:
        pipeline.submit(prepared, {})  # type: ignore[arg-type]
        fills = [pipeline.fill_params(i, torch.zeros(4), []) for i in (1, 2)]
        optimizer.gate.set()
        with pytest.raises(OSError, match="injected EIO"):
            fills[0].wait()  # type: ignore[union-attr]
        with pytest.raises(RuntimeError, match="group 2's parameters were to be filled"):
            fills[1].wait()  # type: ignore[union-attr]
        assert all(f.done() for f in fills)  # type: ignore[union-attr]
        pipeline.wait_all()
        assert pipeline.failed_pass is not None and "injected EIO" in pipeline.failed_pass
    finally:
        pipeline.close()
