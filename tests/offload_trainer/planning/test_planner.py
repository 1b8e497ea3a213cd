"""The planner and its cost model: bytes predicted against bytes the engine moves, choices within
budgets, refusals that name the smallest fix, and placement="auto" at initialize."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import offload_trainer as ot
from offload_trainer.app import plan_cli
from offload_trainer.app.run_config import DEFAULT_RUN, RunConfig
from offload_trainer.config import Placement, Tier
from offload_trainer.planning.cost_model import ComputeTimes, predict_step
from offload_trainer.planning.machine import MachineRates
from offload_trainer.runtime.layout.memory_plan import plan_memory
from offload_trainer.planning.model_spec import MicroBatch, ModelSpec, activations, predict_config
from offload_trainer.models import DecoderConfig, DecoderLM
from offload_trainer.planning.planner import Machine, over_budget, plan_placement

RATES = MachineRates(
    nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=2e9, nvme_direct_io=True,
    host_to_device_bytes_per_s=1e10, device_to_host_bytes_per_s=1e10,
    adamw_elements_per_s=1e9, sgd_elements_per_s=2e9,
)
COMPUTE = ComputeTimes(forward_s=0.1, backward_s=0.2, update_s=0.01)
MICRO_BATCH = MicroBatch(batch_size=2, seq_len=32)
MiB = 2**20


def _cfg(tmp_path: Path, **tiers: object) -> ot.OffloadConfig:
    return ot.OffloadConfig(tiers={"nvme_dir": str(tmp_path / "swap"), **tiers})


def _spec(preset: str = "tiny", **overrides: object) -> ModelSpec:
    return ModelSpec.from_preset(preset, **overrides)


def _machine(tmp_path: Path, device: int | None = None, host: int | None = None, nvme_free: int | None = 10**12) -> Machine:
    return Machine(device, host, str(tmp_path / "swap") if nvme_free is not None else None, nvme_free, True, RATES)


# -- the cost model ------------------------------------------------------------------------------


def test_optimizer_phase_all_nvme_is_the_disk_time_by_hand(tmp_path: Path) -> None:
    spec = _spec()
    cfg = _cfg(tmp_path, params="nvme", grads="nvme", optimizer="nvme")
    part = spec.partition(cfg, 1)
    plan = plan_memory(part, cfg, 0, torch.float32, True)
    cost = predict_step(part, plan, RATES, COMPUTE, 0, 1)
    n = sum(plan.local_trainable_numel)
    shard = sum(g.shard_numel for g in part.groups) * 4
    # Reads: gradient, both moments and the fp32 parameter; writes: moments and parameter. The
    # parameter's whole shard moves (padding too), so that every chunk's checksum is recorded.
    reads, writes = n * 4 + n * 8 + shard, n * 8 + shard
    assert cost.optimizer.nvme_read_bytes == reads
    assert cost.optimizer.nvme_write_bytes == writes
    assert cost.optimizer.time_s == pytest.approx(max(0.01, reads / 1e9 + writes / 2e9))
    # Lookahead 0: forward waits for every fetch, so compute and IO add up.
    assert cost.forward.time_s == pytest.approx(0.1 + cost.forward.io_s)
    assert cost.forward.nvme_read_bytes == shard


def test_lookahead_hides_io_behind_compute(tmp_path: Path) -> None:
    spec = _spec()
    cfg = _cfg(tmp_path, params="nvme").with_overrides({"prefetch.lookahead_groups": 2})
    part = spec.partition(cfg, 1)
    plan = plan_memory(part, cfg, 0, torch.float32, True)
    slow = predict_step(part, plan, RATES, COMPUTE, 0, 1)
    fast = predict_step(part, plan, RATES, COMPUTE, 2, 1)
    assert fast.forward.time_s < slow.forward.time_s
    assert fast.forward.time_s >= max(0.1, fast.forward.io_s)


@pytest.mark.parametrize("lookahead", [0, 2])
def test_copies_from_host_memory_hide_behind_compute_with_lookahead(tmp_path: Path, lookahead: int) -> None:
    """Copies of memory-homed parameters run on the copy path (a copy worker on the CPU, a stream under
    CUDA) beside compute: with lookahead, all but the first group's copy hides, as NVMe reads do;
    without, they add to compute. Before the copy path they ran on the training thread and always
    added to compute; copies_overlap_compute=False still models that."""
    spec = _spec()
    cfg = _cfg(tmp_path, params="host").with_overrides({"prefetch.lookahead_groups": 2})
    part = spec.partition(cfg, 1)
    plan = plan_memory(part, cfg, 0, torch.float32, True)
    assert plan.uses_slots and plan.num_device_slots > 2  # room to fetch two groups ahead
    cost = predict_step(part, plan, RATES, COMPUTE, lookahead, 1)
    copy_bytes = sum(g.flat_numel for g in part.groups) * 4  # every group is copied into a slot
    assert cost.forward.copy_bytes == copy_bytes
    if lookahead:
        assert cost.forward.time_s == pytest.approx(0.1 + part.groups[0].flat_numel * 4 / 1e10)
    else:
        assert cost.forward.time_s == pytest.approx(0.1 + copy_bytes / 1e10)
    blocking = predict_step(part, plan, RATES, COMPUTE, lookahead, 1, copies_overlap_compute=False)
    assert blocking.forward.blocking_copy_s == pytest.approx(copy_bytes / 1e10)
    assert blocking.forward.time_s == pytest.approx(0.1 + copy_bytes / 1e10)
    # Backward re-fetches the groups no longer in their slots: the same rule.
    assert blocking.backward.nvme_read_bytes == 0
    assert blocking.backward.time_s == pytest.approx(0.2 + blocking.backward.copy_bytes / 1e10)


@pytest.mark.parametrize(
    "placement",
    [
        dict(params="nvme", grads="nvme", optimizer="nvme"),
        dict(params="host", grads="nvme", optimizer="host:0.5,nvme:0.5"),
        dict(params="nvme", grads="host", optimizer="nvme"),
    ],
)
@pytest.mark.parametrize("accum", [1, 2])
def test_predicted_nvme_bytes_are_what_the_engine_moves(tmp_path: Path, placement: dict, accum: int) -> None:
    """The cost model's bytes per step against the engine's own counters, after the recording step."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    cfg = ot.OffloadConfig(
        tiers={"nvme_dir": str(tmp_path / "swap"), **placement}, grad_accum_steps=accum,
        prefetch={"lookahead_groups": 1},
    )
    engine = ot.initialize(model, cfg)
    try:
        for _ in range(3):  # step 3 holds the second update pass: the first has no states read ahead for it
            for _ in range(accum):
                x = torch.randint(0, 256, (2, 16))
                engine.backward(F.cross_entropy(engine(x).flatten(0, 1), x.flatten()))
            engine.step()
        stats = engine.stats()
        cost = predict_step(engine.plan, engine.memory_plan, RATES, COMPUTE, 1, accum)
    finally:
        engine.close()
    phases = cost.phases().values()
    predicted_read = accum * (cost.forward.nvme_read_bytes + cost.backward.nvme_read_bytes) + cost.optimizer.nvme_read_bytes
    predicted_write = accum * cost.backward.nvme_write_bytes + cost.optimizer.nvme_write_bytes
    assert all(p.nvme_read_bytes >= 0 for p in phases)
    assert stats.bytes_written.get(Tier.NVME, 0) == predicted_write
    # A load the update pass filled from its staging buffers reads nothing from NVMe ([Note: The next
    # forward's load from the update]); which loads are filled depends on timing, so the model counts
    # every load's read and the engine's filled bytes are added back here.
    read = stats.bytes_read.get(Tier.NVME, 0) + stats.param_bytes_from_update
    if accum == 1:
        assert read == predicted_read
    else:
        # Between micro-batches a parameter shard may still be in a host staging buffer, and
        # the engine skips its read: the prediction is an upper bound, by at most the forwards
        # after the first.
        assert predicted_read - (accum - 1) * cost.forward.nvme_read_bytes <= read <= predicted_read


# -- choosing ------------------------------------------------------------------------------------


def _limits(part: object, cfg: ot.OffloadConfig, tmp_path: Path, device_budget: int | None = None) -> tuple[int, int, int]:
    """(least device any placement needs, then with that device budget (or `device_budget`): least
    host any placement needs, and host needed with nothing on NVMe)."""
    from offload_trainer.planning.planner import LOOKAHEADS, _grid

    grid = _grid(part, cfg, _machine(tmp_path, device=device_budget), COMPUTE, 0, LOOKAHEADS[-1])
    device = min(c.need_bytes[Tier.DEVICE] for c in grid) if device_budget is None else device_budget
    grid = [c for c in grid if c.need_bytes[Tier.DEVICE] <= device]
    host = min(c.need_bytes[Tier.HOST] for c in grid)
    in_memory = min(c.need_bytes[Tier.HOST] for c in grid if not c.need_bytes[Tier.NVME])
    return device, host, in_memory


# The wider model: host-homed and NVMe-homed parameters predict steps about 0.03 ms apart, either side of
# a millisecond boundary (copies from host memory add to compute, NVMe reads hide behind it), a tie
# that rounding to the millisecond used to split in favour of NVMe.
@pytest.mark.parametrize("overrides", [{}, dict(dim=128, ffn_dim=512, n_layers=4)], ids=["tiny", "wider"])
def test_without_budgets_nothing_goes_to_nvme(tmp_path: Path, overrides: dict) -> None:
    spec = _spec("tiny", **overrides)
    cfg = _cfg(tmp_path)
    choice = plan_placement(spec.partition(cfg, 1), cfg, _machine(tmp_path), COMPUTE, 0)
    assert choice.chosen.need_bytes[Tier.NVME] == 0
    assert "nothing goes to NVMe" in choice.reasons[0]


def test_a_host_budget_moves_the_cheapest_state_to_nvme_first(tmp_path: Path) -> None:
    spec = _spec("tiny", dim=128, ffn_dim=512, n_layers=4)
    cfg = _cfg(tmp_path)
    part = spec.partition(cfg, 1)
    device, least, in_memory = _limits(part, cfg, tmp_path)
    budget = (least + in_memory) // 2
    choice = plan_placement(part, cfg, _machine(tmp_path, device=device, host=budget), COMPUTE, 0)
    c = choice.chosen
    assert not over_budget(c, choice.machine)
    assert c.need_bytes[Tier.HOST] <= budget
    assert c.need_bytes[Tier.NVME] > 0
    # The kind the reasons name as cheapest on NVMe is the one that went there.
    why = next(r for r in choice.reasons if "go to NVMe first" in r)
    first = {"parameters": c.params, "gradients": c.grads, "optimizer states": c.optimizer}[
        why.split("; so ")[1].split(" go to NVMe first")[0]
    ]
    assert first.nvme > 0


def test_the_choice_is_the_fastest_fitting_point_of_the_grid(tmp_path: Path) -> None:
    spec = _spec("tiny", dim=128, ffn_dim=512, n_layers=4)
    cfg = _cfg(tmp_path)
    part = spec.partition(cfg, 1)
    device, least, in_memory = _limits(part, cfg, tmp_path)
    budget = (least + in_memory) // 2
    choice = plan_placement(part, cfg, _machine(tmp_path, device=device, host=budget), COMPUTE, 0)
    # Every other grid point that fits predicts no faster (at the same deepest lookahead).
    from offload_trainer.planning.planner import LOOKAHEADS, _grid

    fitting = [c for c in _grid(part, cfg, choice.machine, COMPUTE, 0, LOOKAHEADS[-1]) if not over_budget(c, choice.machine)]
    assert fitting
    assert choice.chosen.cost.step_s <= min(c.cost.step_s for c in fitting) * 1.005 + 1e-9


# -- refusals ------------------------------------------------------------------------------------


def test_refusal_without_nvme_dir_says_how_much_host_or_nvme_would_fit(tmp_path: Path) -> None:
    spec = _spec()
    cfg = ot.OffloadConfig()
    part = spec.partition(cfg, 1)
    device, least, in_memory = _limits(part, cfg, tmp_path)
    with pytest.raises(ot.PlanError) as e:
        plan_placement(part, cfg, _machine(tmp_path, device=device, host=(least + in_memory) // 2, nvme_free=None), COMPUTE, 0)
    msg = str(e.value)
    assert "raise tiers.host_budget_bytes to" in msg
    assert "set tiers.nvme_dir" in msg
    # The host figure is the least that fits: with it, a plan exists.
    needed = int(msg.split("raise tiers.host_budget_bytes to ")[1].split()[0])
    plan_placement(part, cfg, _machine(tmp_path, device=device, host=needed, nvme_free=None), COMPUTE, 0)
    with pytest.raises(ot.PlanError):
        plan_placement(part, cfg, _machine(tmp_path, device=device, host=needed - 1, nvme_free=None), COMPUTE, 0)


def test_refusal_when_nvme_is_too_small_names_the_space(tmp_path: Path) -> None:
    spec = _spec()
    cfg = _cfg(tmp_path)
    part = spec.partition(cfg, 1)
    device, least, in_memory = _limits(part, cfg, tmp_path)
    with pytest.raises(ot.PlanError, match=r"free .* more under .*swap") as e:
        plan_placement(part, cfg, _machine(tmp_path, device=device, host=(least + in_memory) // 2, nvme_free=4096), COMPUTE, 0)
    assert "shard the state over" not in str(e.value)  # no repartition given


def test_refusal_on_the_device_suggests_checkpointing_and_ranks(tmp_path: Path) -> None:
    spec = _spec()
    cfg = _cfg(tmp_path)
    part = spec.partition(cfg, 1)
    acts, acts_ckpt = 8 * MiB, MiB
    with pytest.raises(ot.PlanError) as e:
        plan_placement(part, cfg, _machine(tmp_path, device=4 * MiB), COMPUTE, acts, acts_ckpt)
    msg = str(e.value)
    assert "raise tiers.device_budget_bytes to" in msg
    assert "turn on activation checkpointing" in msg
    # More ranks: a host too small for one rank's share, no NVMe, a device budget that two ranks
    # need (every group's parameters are gathered into slots); half the state then fits.
    part2 = spec.partition(cfg, 2)
    device2, _, _ = _limits(part2, cfg, tmp_path)
    _, _, in_memory = _limits(part, cfg, tmp_path, device_budget=device2)
    with pytest.raises(ot.PlanError, match="shard the state over 2 ranks"):
        plan_placement(
            part, cfg, _machine(tmp_path, device=device2, host=in_memory - 1, nvme_free=None), COMPUTE, 0,
            repartition=lambda w: spec.partition(cfg, w),
        )


# -- placement="auto" and offload-plan -------------------------------------------------------------


def test_auto_placement_trains_within_its_budgets_like_manual(tmp_path: Path) -> None:
    def run(cfg: ot.OffloadConfig) -> tuple[dict, ot.Engine]:
        torch.manual_seed(0)
        engine = ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg, micro_batch=(2, 32))
        try:
            for _ in range(3):
                x = torch.randint(0, 256, (2, 32))
                engine.backward(F.cross_entropy(engine(x).flatten(0, 1), x.flatten()))
                engine.step()
            return engine.full_state_dict(), engine
        finally:
            engine.close()

    cfg = _cfg(tmp_path)
    device, least, in_memory = _limits(_spec().partition(cfg, 1), cfg, tmp_path)
    # A device budget with no room for parameters homed there (beyond the activations the planner
    # keeps for a data.batch_size x data.seq_len micro-batch), and a host budget that forces NVMe.
    acts = activations(_spec(), cfg, MICRO_BATCH, False, torch.device("cpu"))
    budgets = {"host_budget_bytes": (least + in_memory) // 2, "device_budget_bytes": device + acts + 64 * 1024}
    auto_cfg = _cfg(tmp_path, **budgets).with_overrides({"placement": "auto"})
    auto, engine = run(auto_cfg)
    choice = engine.placement_choice
    assert choice is not None and engine.config.tiers.params == choice.chosen.params
    assert engine.peak_bytes(Tier.HOST) <= budgets["host_budget_bytes"]
    assert engine.peak_bytes(Tier.DEVICE) <= budgets["device_budget_bytes"]
    assert choice.chosen.need_bytes[Tier.NVME] > 0  # the host budget forced some state out
    assert engine.config.tiers.device_budget_bytes == budgets["device_budget_bytes"] - choice.activation_bytes
    manual, _ = run(choice.engine_config(auto_cfg))
    assert all(torch.equal(auto[k], manual[k]) for k in manual)


def test_auto_placement_that_cannot_fit_is_refused_at_initialize(tmp_path: Path) -> None:
    cfg = ot.OffloadConfig(placement="auto", tiers={"host_budget_bytes": 1024})
    with pytest.raises(ot.PlanError, match='placement="auto": no placement fits'):
        ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg, micro_batch=(2, 32))


def test_auto_placement_past_the_memory_available_warns_at_initialize(tmp_path: Path, monkeypatch) -> None:
    """placement = "auto" under a set host budget larger than the memory available plans as told, with the note."""
    from offload_trainer.planning import planner

    monkeypatch.setattr(planner, "memory_available_bytes", lambda: 1 << 20)
    cfg = ot.OffloadConfig(placement="auto", tiers={"host_budget_bytes": 1 << 40})
    with pytest.warns(UserWarning, match=r'placement="auto": tiers.host_budget_bytes=1 TiB let the plan keep .* more '
                      r"than the 1 MiB this machine has available now"):
        engine = ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg, micro_batch=(2, 32))
    engine.close()


def test_predict_config_refuses_what_does_not_fit(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, host_budget_bytes=1024)
    with pytest.raises(ot.PlanError, match="does not fit"):
        predict_config(_spec(), cfg, MICRO_BATCH, torch.device("cpu"), RATES)


def test_offload_plan_prints_the_plan_and_writes_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "planned.toml"
    code = plan_cli.main([
        "--model.preset", "tiny", "--data.batch_size", "2", "--data.seq_len", "32",
        "--tiers.nvme_dir", str(tmp_path / "swap"), "--tiers.host_budget_bytes", "3MiB",
        "--world-size", "2", "--write-config", str(out), "--json",
    ])
    text = capsys.readouterr().out
    assert code == 0
    for section in ("ZeRO bytes per rank", "placement (lookahead", "bytes moved per step", "predicted seconds", "why"):
        assert section in text
    plan = json.loads(text.strip().splitlines()[-1])
    assert set(plan["zero_bytes_per_rank"]) == {"0", "1", "2", "3"}
    z = plan["zero_bytes_per_rank"]
    assert z["0"]["total"] > z["1"]["total"] > z["2"]["total"] > z["3"]["total"]
    cfg = RunConfig.from_file(out, defaults=DEFAULT_RUN)
    assert cfg.prefetch.lookahead_groups == plan["lookahead_groups"]
    assert cfg.tiers.grads == Placement.parse(plan["placement"]["grads"])


def test_offload_plan_refusal_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = plan_cli.main(["--model.preset", "tiny", "--tiers.host_budget_bytes", "1KiB", "--tiers.nvme_dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("offload-plan: no placement fits") and "Any one of these would make it fit" in err[-1]


def test_offload_plan_reads_a_hugging_face_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    config.save_pretrained(tmp_path / "hf")
    code = plan_cli.main([
        "--hf-config", str(tmp_path / "hf"), "--data.batch_size", "2", "--data.seq_len", "16",
        "--tiers.nvme_dir", str(tmp_path / "swap"), "--json",
    ])
    out = capsys.readouterr().out
    assert code == 0
    plan = json.loads(out.strip().splitlines()[-1])
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert plan["num_params"] == sum(p.numel() for p in model.parameters())
    assert plan["activation_bytes"] > 0


# -- an unset host budget is the machine's memory ------------------------------------------------


class _Memory:
    def __init__(self, available: int) -> None:
        self.available = available


def test_an_unset_host_budget_plans_with_the_memory_available(tmp_path: Path, monkeypatch) -> None:
    """With tiers.host_budget_bytes unset the planner took host memory as unlimited: a model whose
    state is larger than the machine's memory got an all-host placement (the fastest on paper), and
    the run was killed by the kernel while it built the engine. Unset, the budget is now HOST_SHARE of
    the memory available, this rank's share of it under torchrun; on a CPU without a device budget
    the device tier (activations, slots) counts against it too. A budget that is set stays as set."""
    import offload_trainer.planning.host_memory as host_memory

    spec = _spec("tiny", dim=128, ffn_dim=512, n_layers=4)
    cfg = _cfg(tmp_path)
    part = spec.partition(cfg, 1)
    acts = 3 * MiB
    unlimited = plan_placement(part, cfg, _machine(tmp_path), COMPUTE, acts)
    assert unlimited.chosen.need_bytes[Tier.NVME] == 0  # what "unlimited" chose
    in_memory = unlimited.chosen.need_bytes[Tier.HOST] + unlimited.chosen.need_bytes[Tier.DEVICE]
    available = int(in_memory * 0.9 / host_memory.HOST_SHARE)  # the machine lacks a tenth of it
    monkeypatch.setattr(host_memory.psutil, "virtual_memory", lambda: _Memory(available))
    monkeypatch.setattr(host_memory, "cgroup_memory_room_bytes", lambda: None)  # no container limit either
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    machine = Machine.from_config(cfg, torch.device("cpu"), RATES)
    assert machine.host_budget_from_memory and machine.host_budget_bytes == int(host_memory.HOST_SHARE * available)
    assert "80% of the memory available, tiers.host_budget_bytes unset" in machine.budget_words(Tier.HOST)
    choice = plan_placement(part, cfg, machine, COMPUTE, acts)
    c = choice.chosen
    assert c.need_bytes[Tier.NVME] > 0 and not over_budget(c, machine)
    assert c.need_bytes[Tier.HOST] + c.need_bytes[Tier.DEVICE] <= machine.host_budget_bytes
    # Four ranks on this node share it.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Machine.from_config(cfg, torch.device("cpu"), RATES).host_budget_bytes == int(host_memory.HOST_SHARE * available) // 4
    # Set, the budget is the user's: the machine's memory does not enter.
    explicit = _cfg(tmp_path, host_budget_bytes=10 * in_memory)
    machine = Machine.from_config(explicit, torch.device("cpu"), RATES)
    assert not machine.host_budget_from_memory and machine.host_budget_bytes == 10 * in_memory
    assert plan_placement(part, explicit, machine, COMPUTE, acts).chosen.need_bytes[Tier.NVME] == 0


def test_a_model_larger_than_the_memory_without_nvme_is_refused_naming_the_memory(tmp_path: Path, monkeypatch) -> None:
    import offload_trainer.planning.host_memory as host_memory

    spec = _spec("tiny", dim=128, ffn_dim=512, n_layers=4)
    cfg = ot.OffloadConfig()
    part = spec.partition(cfg, 1)
    monkeypatch.setattr(host_memory.psutil, "virtual_memory", lambda: _Memory(MiB))
    monkeypatch.setattr(host_memory, "cgroup_memory_room_bytes", lambda: None)  # no container limit either
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    machine = Machine.from_config(cfg, torch.device("cpu"), RATES)
    with pytest.raises(ot.PlanError, match=r"80% of the memory available, tiers.host_budget_bytes unset.*more host memory"):
        plan_placement(part, cfg, machine, COMPUTE, 0)


def test_an_unset_device_budget_on_a_gpu_plans_with_its_free_memory(tmp_path: Path, monkeypatch) -> None:
    """On a GPU an unset tiers.device_budget_bytes was unlimited to the planner: a model larger than the
    GPU was planned all on the device. It now plans with DEVICE_SHARE of the GPU's free memory, and the
    engine gets that budget less the activations, as a budget that is set. (The GPU is stood in for:
    the plan needs only its free bytes.)"""
    import offload_trainer.planning.host_memory as host_memory

    spec = _spec("tiny", dim=128, ffn_dim=512, n_layers=4)
    cfg = _cfg(tmp_path)
    part = spec.partition(cfg, 1)
    acts = 3 * MiB
    # Copies so slow that state on the GPU is the fastest placement.
    rates = dataclasses.replace(RATES, host_to_device_bytes_per_s=1e6, device_to_host_bytes_per_s=1e6)
    monkeypatch.setattr(host_memory.psutil, "virtual_memory", lambda: _Memory(64 * 2**30))
    monkeypatch.setattr(host_memory, "cgroup_memory_room_bytes", lambda: None)  # no container limit either
    gpu = torch.device("cuda", 0)
    unlimited = plan_placement(part, cfg, Machine(None, 2**40, str(tmp_path / "swap"), 10**12, False, rates), COMPUTE, acts)
    on_device = unlimited.chosen.need_bytes[Tier.DEVICE]
    assert unlimited.chosen.params.device == 1.0, unlimited.chosen  # "unlimited": all on the GPU
    free = int((acts + (on_device - acts) // 3) / host_memory.DEVICE_SHARE)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    machine = Machine.from_config(cfg, gpu, rates)
    assert machine.device_budget_from_memory and machine.device_budget_bytes == int(host_memory.DEVICE_SHARE * free)
    assert "of the GPU's free memory, tiers.device_budget_bytes unset" in machine.budget_words(Tier.DEVICE)
    choice = plan_placement(part, cfg, machine, COMPUTE, acts)
    assert choice.chosen.need_bytes[Tier.DEVICE] <= machine.device_budget_bytes < on_device
    assert choice.chosen.params.device < 1.0
    engine_cfg = choice.engine_config(cfg)
    assert engine_cfg.tiers.device_budget_bytes == machine.device_budget_bytes - acts
    assert choice.apply(cfg).tiers.device_budget_bytes is None  # config.json keeps the user's (unset) budget
    # Set, it is the user's.
    explicit = _cfg(tmp_path, device_budget_bytes=2**40)
    assert not Machine.from_config(explicit, gpu, rates).device_budget_from_memory


def test_swap_files_on_a_memory_file_system_count_as_host_memory(tmp_path: Path) -> None:
    """nvme_dir on tmpfs (/dev/shm, a container's memory-backed volume): its swap files are host memory.
    Planned with the machine's memory, the 1b preset got 14.3 GiB of host homes plus 2.6 GiB of swap files
    under /dev/shm against a budget of 15.7 GiB. Now a plan that fits only with such swap files is
    refused, and the refusal names the fix: a directory on a disk."""
    spec = _spec()
    cfg = _cfg(tmp_path)
    part = spec.partition(cfg, 1)
    acts = activations(spec, cfg, MICRO_BATCH, False, torch.device("cpu"))
    on_disk = dataclasses.replace(_machine(tmp_path, host=int(3.2 * MiB)), host_budget_from_memory=True)
    choice = plan_placement(part, cfg, on_disk, COMPUTE, acts)
    assert choice.chosen.need_bytes[Tier.NVME] > 0  # the host budget alone cannot hold the state
    in_memory = dataclasses.replace(on_disk, nvme_memory_file_system="tmpfs")
    assert in_memory.resident_host_bytes(choice.chosen.need_bytes) > in_memory.host_budget_bytes
    with pytest.raises(ot.PlanError, match=r"set tiers.nvme_dir to a directory on a disk \(.*swap is on tmpfs, whose"):
        plan_placement(part, cfg, in_memory, COMPUTE, acts)
    # A set host budget is the engine's host tier alone; the note counts the swap files in memory.
    user_set = dataclasses.replace(in_memory, host_budget_bytes=2 * MiB, host_budget_from_memory=False,
                                   host_memory_available_bytes=int(4 * MiB))
    note = plan_placement(part, cfg, user_set, COMPUTE, acts).memory_note
    assert note is not None and "swap is on tmpfs: memory) included" in note


def test_a_machine_knows_its_nvme_dir_on_tmpfs(tmp_path: Path) -> None:
    if "/dev/shm tmpfs" not in Path("/proc/mounts").read_text(encoding="utf-8"):
        pytest.skip("no tmpfs at /dev/shm here")
    memory = Machine.from_config(ot.OffloadConfig(tiers={"nvme_dir": "/dev/shm/not-made-yet/swap"}), torch.device("cpu"), RATES)
    assert memory.nvme_memory_file_system == "tmpfs"


def test_a_plan_past_the_memory_available_under_a_set_host_budget_has_a_note(tmp_path: Path) -> None:
    """Only a set budget can let a plan past the memory available; the note names both numbers (offload-plan
    prints it as a warning: tests/offload_trainer/app/test_plan_cli.py)."""
    spec = _spec()
    cfg = _cfg(tmp_path, params="host", grads="host", optimizer="host")
    part = spec.partition(cfg, 1)
    acts = activations(spec, cfg, MICRO_BATCH, False, torch.device("cpu"))
    machine = dataclasses.replace(_machine(tmp_path, host=2**40), host_memory_available_bytes=MiB)
    choice = plan_placement(part, cfg, machine, COMPUTE, acts)
    note = choice.memory_note
    assert note is not None and note.startswith("tiers.host_budget_bytes=1 TiB let the plan keep ")
    assert "more than the 1 MiB this machine has available now" in note
    roomy = dataclasses.replace(machine, host_memory_available_bytes=2**40)
    assert dataclasses.replace(choice, machine=roomy).memory_note is None
    unset = dataclasses.replace(machine, host_budget_from_memory=True)  # planned with the memory: never past it
    assert dataclasses.replace(choice, machine=unset).memory_note is None


def test_the_nvme_room_counts_the_swap_files_of_dead_runs_as_free(tmp_path: Path, monkeypatch) -> None:
    """A run SIGKILLed leaves its swap directory, which the resumed run's engine reclaims before it makes
    its own. The planner counted it as used: a resume under placement = "auto" on a disk sized for one
    run's swap files was refused ("free 1.86 MiB more under nvme_dir"), for the room its own killed
    attempt held, and the refusal left that directory there for good."""
    import subprocess
    import sys

    import io_engine.file_store
    from io_engine.swap_dirs import LOCK_NAME

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / "swap" / f"offload-swap-{gone.pid}-lck1"  # a SIGKILLed store's: a lock file no one holds
    dead.mkdir(parents=True, mode=0o700)
    (dead / LOCK_NAME).write_bytes(b"")
    (dead / "swap-0000.bin").write_bytes(b"s" * 3 * MiB)
    held = sum(p.lstat().st_blocks * 512 for p in dead.iterdir())
    monkeypatch.setattr(io_engine.file_store, "free_bytes", lambda path: MiB)  # the disk full but for 1 MiB
    assert Machine.from_config(_cfg(tmp_path), torch.device("cpu"), RATES).nvme_free_bytes == MiB + held
    assert dead.is_dir()  # planning removes nothing: the engine's store reclaims it
