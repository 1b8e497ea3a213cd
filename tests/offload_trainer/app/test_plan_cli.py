"""offload-plan answers first: the fit check needs no timing and is the first line; --no-measure
times nothing even for a 70b model; a refusal is printed once; per-micro-batch and per-step times
are labelled; --hf-config with --write-config writes a config that names that model; the config's
own placement is shown beside the planned one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload_trainer.app import plan_cli
from offload_trainer.app.run_config import DEFAULT_RUN, RunConfig
from offload_trainer.planning import machine, model_spec


def _no_measuring(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every measurement offload-plan could make raises, and is recorded."""
    called: list = []

    def refuse(name: str):  # type: ignore[no-untyped-def]
        def measure(*args, **kwargs):  # type: ignore[no-untyped-def]
            called.append(name)
            raise AssertionError(f"{name} was called: something was measured")

        return measure

    for module, name in ((model_spec, "planning_inputs"), (model_spec, "machine_rates"), (model_spec, "compute_times"),
                         (model_spec, "cached_decoder_times"), (machine, "machine_rates"), (plan_cli, "plan_for_model")):
        monkeypatch.setattr(module, name, refuse(name))
    return called


@pytest.mark.slow  # ~8.5 s planning 70b twice; --no-measure runs by default in test_std_streams, test_bad_inputs
def test_no_measure_answers_for_70b_without_timing_anything(tmp_path: Path, monkeypatch, capsys) -> None:
    called = _no_measuring(monkeypatch)
    code = plan_cli.main([
        "--model.preset", "70b", "--tiers.nvme_dir", str(tmp_path), "--world-size", "64", "--data.batch_size", "64",
        "--no-measure", "--json",
        "--tiers.host_budget_bytes", "256GiB",  # a larger machine's: unset, it is this machine's memory
    ])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert called == []
    lines = out.strip().splitlines()
    assert lines[0].startswith("offload-plan: fit check (nothing measured): fits")
    assert "predicted seconds" not in out and "not measured" in out
    plan = json.loads(lines[-1])
    assert plan["measured"] is False and "predicted_step_s" not in plan
    # The same 70b on one rank does not fit a small host and no NVMe: one refusal, still nothing timed.
    code = plan_cli.main(["--model.preset", "70b", "--tiers.host_budget_bytes", "4GiB", "--no-measure"])
    out, err = capsys.readouterr()
    assert code == 2 and called == []
    assert len(err.strip().splitlines()) == 1 and err.count("no placement fits") == 1, err
    assert out == ""


def test_the_default_prints_the_fit_check_before_it_measures(tmp_path: Path, monkeypatch, capsys) -> None:
    seen: list = []

    def measuring(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(capsys.readouterr().out)
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_cli, "plan_for_model", measuring)
    code = plan_cli.main(["--model.preset", "tiny", "--tiers.nvme_dir", str(tmp_path)])
    assert code == 130
    assert seen and seen[0].startswith("offload-plan: fit check (nothing measured): fits"), seen


def test_times_are_labelled_per_micro_batch_and_per_step_and_yours_is_compared(tmp_path: Path, capsys) -> None:
    code = plan_cli.main([
        "--model.preset", "tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--grad_accum_steps", "2",
        "--tiers.nvme_dir", str(tmp_path / "swap"), "--tiers.params", "nvme", "--json",
    ])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "forward and backward: per micro-batch, 2 per step; optimizer: per step" in out
    assert "your config's placement against the plan" in out and "  yours " in out and "  planned " in out
    plan = json.loads(out.strip().splitlines()[-1])
    assert plan["phases"]["forward"]["per"] == "micro-batch" and plan["phases"]["optimizer"]["per"] == "step"
    assert plan["yours"]["placement"]["params"]["nvme"] == 1.0 and plan["yours"]["fits"] is True
    assert "device budget leaves room" not in out, "no device budget was set"


def test_hf_config_with_write_config_writes_a_config_that_names_the_model(tmp_path: Path, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    config.save_pretrained(tmp_path / "hf")
    written = tmp_path / "planned.toml"
    code = plan_cli.main([
        "--hf-config", str(tmp_path / "hf" / "config.json"), "--data.batch_size", "2", "--data.seq_len", "16",
        "--tiers.nvme_dir", str(tmp_path / "swap"), "--write-config", str(written), "--no-measure",
    ])
    out, err = capsys.readouterr()
    assert code == 0, err
    cfg = RunConfig.from_file(written, defaults=DEFAULT_RUN)
    assert cfg.model.hf_path == str((tmp_path / "hf").resolve())
    assert cfg.placement.value == "auto", "nothing measured: offload-train plans at start"


def test_write_config_makes_relative_paths_absolute(tmp_path: Path, monkeypatch, capsys) -> None:
    """`offload-plan --data.path corpus --write-config conf/p.toml` wrote data.path = "corpus": read by
    offload-train started anywhere else it named another corpus or none; so every path setting."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    code = plan_cli.main([
        "--model.preset", "tiny", "--data.seq_len", "32", "--data.path", "corpus", "--data.cache_dir", "../cache",
        "--tiers.nvme_dir", "swap", "--train.out_dir", "runs/a", "--write-config", "conf/p.toml", "--no-measure",
    ])
    out, err = capsys.readouterr()
    assert code == 0, err
    monkeypatch.chdir(tmp_path / "conf")
    cfg = RunConfig.from_file("p.toml", defaults=DEFAULT_RUN)
    assert (cfg.data.path, cfg.data.cache_dir, cfg.tiers.nvme_dir, cfg.train.out_dir) == (
        str(tmp_path / "corpus"), str(tmp_path / ".." / "cache"), str(tmp_path / "swap"), str(tmp_path / "runs" / "a")
    )


def test_a_refusal_is_printed_once_before_anything_is_measured(tmp_path: Path, monkeypatch, capsys) -> None:
    called = _no_measuring(monkeypatch)
    code = plan_cli.main(["--model.preset", "tiny", "--tiers.host_budget_bytes", "1KiB", "--tiers.nvme_dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2 and called == [] and out == ""
    assert len(err.strip().splitlines()) == 1 and err.count("no placement fits") == 1, err


@pytest.mark.slow  # 13 s: plans a Hugging Face model wrapped by PEFT; LoRA training stays in the default run
def test_a_lora_config_is_planned_with_the_base_frozen(tmp_path: Path, monkeypatch, capsys) -> None:
    """With [lora] the engine keeps no gradients or optimizer states for the frozen base: a 1b LoRA run fits
    budgets that the full fine-tune overflows onto NVMe (the LoRA run was planned as the full one)."""
    called = _no_measuring(monkeypatch)
    argv = ["--model.preset", "1b", "--tiers.nvme_dir", str(tmp_path), "--tiers.host_budget_bytes", "8GiB",
            "--tiers.device_budget_bytes", "16GiB", "--no-measure", "--json", "--lora.target_modules", "q_proj,v_proj"]
    assert plan_cli.main([*argv, "--lora.rank", "16"]) == 0
    out, err = capsys.readouterr()
    lora = json.loads(out.strip().splitlines()[-1])
    assert "with LoRA adapters (rank 16)" in out and err == ""
    assert lora["need_bytes"]["nvme"] == 0 and lora["placement"]["optimizer"]["nvme"] == 0.0
    assert plan_cli.main([*argv, "--lora.rank", "0"]) == 0
    full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert full["need_bytes"]["nvme"] > 2 * 2**30  # the AdamW moments of 1.1 B parameters that the host cannot hold
    assert called == []


def test_each_rank_is_planned_with_its_share_of_the_micro_batch(capsys) -> None:
    """data.batch_size is the global micro-batch, each of N ranks runs 1/N of it (offload-train); the plan
    for --world-size N gave every rank the whole batch's activations, and planned a batch size that
    offload-train then refused (not a multiple of the ranks)."""
    plans = {}
    for world, batch in ((4, "8"), (1, "2")):
        argv = ["--model.preset", "tiny", "--data.seq_len", "32", "--data.batch_size", batch, "--no-measure", "--json"]
        assert plan_cli.main([*argv, "--world-size", str(world)]) == 0
        out = capsys.readouterr().out
        plans[world] = json.loads(out.strip().splitlines()[-1])
        assert "micro-batch 2 x 32 tokens" in out
    assert plans[4]["activation_bytes"] == plans[1]["activation_bytes"]
    assert plan_cli.main(["--model.preset", "tiny", "--data.batch_size", "4", "--world-size", "3", "--no-measure"]) == 2
    assert "data.batch_size=4 must be a multiple of the 3 ranks" in capsys.readouterr().err


def test_a_host_budget_above_the_memory_available_is_planned_with_a_note(tmp_path: Path, monkeypatch, capsys) -> None:
    """A set budget is the user's (it may be another machine's): planned, but no longer without a word when the
    plan keeps more in host memory than this machine has available (the run was killed while faulting it in)."""
    from offload_trainer.planning import planner

    monkeypatch.setattr(planner, "memory_available_bytes", lambda: 3 << 20)
    base = ["--model.preset", "tiny", "--tiers.nvme_dir", str(tmp_path), "--no-measure", "--tiers.params", "host"]
    assert plan_cli.main([*base, "--tiers.host_budget_bytes", "1TiB"]) == 0
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("offload-plan: warning: tiers.host_budget_bytes=1 TiB let the plan keep"), err
    assert "more than the 3 MiB this machine has available now: a run here would be killed for memory" in err
    # when there is none: tests/offload_trainer/planning/test_planner.py


@pytest.mark.parametrize("num_threads, usable, expected", [("1", 8, 1), (None, 1, 1)], ids=["train.num_threads", "quota"])
def test_the_plan_is_timed_with_the_threads_offload_train_uses(
    monkeypatch: pytest.MonkeyPatch, num_threads: "str | None", usable: int, expected: int
) -> None:
    """offload-plan timed compute with torch's default threads: not train.num_threads, nor torch's default
    held to a container's CPU quota, which offload-train runs with; so it predicted another machine."""
    import torch

    from offload_trainer.app import torch_threads

    seen: list = []

    def plan_for_model(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        raise ValueError("stop here")

    monkeypatch.setattr(plan_cli, "plan_for_model", plan_for_model)
    monkeypatch.setattr(torch_threads, "usable_cpus", lambda: usable)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        argv = ["--model.preset", "tiny"] + (["--train.num_threads", num_threads] if num_threads else [])
        assert plan_cli.main(argv) == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [expected]
