"""offload-train: a short run trains and checkpoints; a run killed with SIGKILL resumes to bitwise
the same state as an uninterrupted one; bad input ends with one message, exit code 2, no
traceback, and the last good checkpoint intact."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from tests.command_lines import argv_with

REPO = Path(__file__).resolve().parents[3]


def corpus(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    text = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40
    for i in range(6):
        (d / f"doc{i}.py").write_text(f"# document {i}\n" + text)
    return d


def args(tmp_path: Path, steps: int, extra: List[str] = ()) -> List[str]:
    return argv_with([
        "--model.preset", "tiny", "--data.path", str(corpus_dir(tmp_path)), "--data.seq_len", "32",
        "--data.batch_size", "4", "--train.steps", str(steps), "--train.checkpoint_every", "2",
        "--train.eval_batches", "2", "--train.out_dir", str(tmp_path / "run"),
        "--tiers.nvme_dir", str(tmp_path / "swap"), "--no-progress",
    ], *extra)


def corpus_dir(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    return d if d.exists() else corpus(tmp_path)


def offload_train(argv: List[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "offload_trainer", *argv], cwd=REPO, capture_output=True, text=True, timeout=300, **kw
    )


def final_records(run_dir: Path, step: int) -> list:
    manifest = json.loads((run_dir / f"ckpt-{step:06d}" / "manifest.json").read_text())
    return [(r["group"], r["kind"], r["crc32"]) for part in manifest["ranks"] for r in part["records"]]


def test_a_short_run_trains_checkpoints_and_logs(tmp_path) -> None:
    done = offload_train(args(tmp_path, 6, ["--json", "--train.trace_step", "3"]))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6 and summary["eval_loss"] == summary["eval_loss"]
    assert summary["last_loss"] < summary["first_loss"]
    run_dir = tmp_path / "run"
    assert (run_dir / "latest").read_text() == "ckpt-000006"
    assert sorted(p.name for p in run_dir.glob("ckpt-*")) == ["ckpt-000002", "ckpt-000004", "ckpt-000006"]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == 6
    from safetensors.torch import load_file

    weights = load_file(str(run_dir / "model.safetensors"))
    assert summary["export"] == str(run_dir / "model.safetensors") and "lm_head.weight" in weights
    assert json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    assert not list((tmp_path / "swap").glob("offload-swap-*")), "swap files left behind"


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path) -> None:
    straight = tmp_path / "straight"
    straight.mkdir()
    corpus(straight)
    assert offload_train(args(straight, 6)).returncode == 0

    killed = tmp_path / "killed"
    killed.mkdir()
    corpus(killed)
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "offload_trainer", *args(killed, 6)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
    )
    latest = killed / "run" / "latest"
    deadline = time.monotonic() + 240
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # between checkpoints: right after the first one is in place
    proc.wait()
    log.close()
    assert latest.exists(), "no checkpoint was written before the kill:\n" + (tmp_path / "killed.log").read_text()[-3000:]
    resumed = offload_train(args(killed, 6, ["--resume", "latest"]))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert final_records(killed / "run", 6) == final_records(straight / "run", 6)


@pytest.mark.parametrize(
    "extra,message",
    [
        # One installed-script run by default (~2.7 s each); test_bad_inputs.py's table holds these cases too.
        pytest.param(["--optimzer.lr", "0.1"], "optimizer", marks=pytest.mark.slow),
        pytest.param(["--optimizer.lr", "fast"], "optimizer.lr", marks=pytest.mark.slow),
        (["--data.path", "/nonexistent/corpus"], "/nonexistent/corpus"),
        pytest.param(["--resume", "/nonexistent/ckpt"], "/nonexistent/ckpt does not exist", marks=pytest.mark.slow),
    ],
)
def test_bad_input_is_one_message_without_traceback(tmp_path, extra, message) -> None:
    done = offload_train(args(tmp_path, 2, extra))
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow  # 11 s: two runs; runtime/test_checkpoint.py refuses damaged and foreign checkpoints by default
def test_corrupted_or_foreign_checkpoint_is_refused_and_kept(tmp_path) -> None:
    assert offload_train(args(tmp_path, 2)).returncode == 0
    ckpt = tmp_path / "run" / "ckpt-000002"
    foreign = offload_train(args(tmp_path, 4, ["--resume", "latest", "--model.preset", "small"]))
    assert foreign.returncode == 2 and "another model" in foreign.stderr and "Traceback" not in foreign.stderr
    data = bytearray((ckpt / "rank00000.bin").read_bytes())
    data[100] ^= 0x01
    (ckpt / "rank00000.bin").write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    corrupted = offload_train(args(tmp_path, 4, ["--resume", "latest"]))
    assert corrupted.returncode == 2 and "checksum" in corrupted.stderr and "Traceback" not in corrupted.stderr
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert (tmp_path / "run" / "latest").read_text() == "ckpt-000002"


@pytest.mark.slow  # slow (27 s): test_resume_after_sigkill_matches_an_uninterrupted_run keeps a kill in the default run
def test_kills_at_random_moments_including_mid_checkpoint_resume_exactly(tmp_path) -> None:
    """Saves every step, so a good share of kills land inside a save; whatever the moment,
    `latest` names a loadable checkpoint and the resumed run ends bit-identical."""
    import random

    straight = tmp_path / "straight"
    straight.mkdir()
    corpus(straight)
    every_step = ["--train.checkpoint_every", "1"]
    assert offload_train(args(straight, 8, every_step)).returncode == 0

    killed = tmp_path / "killed"
    killed.mkdir()
    corpus(killed)
    rng = random.Random(0)
    latest = killed / "run" / "latest"
    for attempt in range(3):
        log_path = tmp_path / f"attempt{attempt}.log"
        log = open(log_path, "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "offload_trainer", *args(killed, 8, every_step + (["--resume", "latest"] if latest.exists() else []))],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        )
        before = latest.read_text() if latest.exists() else None
        deadline = time.monotonic() + 240
        while (not latest.exists() or latest.read_text() == before) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3))  # into the next steps and saves
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        log.close()
        assert latest.exists(), f"attempt {attempt} wrote no checkpoint:\n" + log_path.read_text()[-3000:]
        name = latest.read_text()
        assert (killed / "run" / name / "manifest.json").is_file(), f"latest names an incomplete {name}"
    resumed = offload_train(args(killed, 8, every_step + ["--resume", "latest"]))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert final_records(killed / "run", 8) == final_records(straight / "run", 8)
    assert not list((killed / "run").glob("*.tmp-*")), "a killed save's temporary was left behind"


@pytest.mark.slow  # slow (15 s): test_visible_runs starts torchrun, test_engine_two_ranks loads a two-rank checkpoint on one
def test_two_ranks_under_torchrun_then_resumed_on_one(tmp_path) -> None:
    argv = args(tmp_path, 4, ["--json"])
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "offload_trainer", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summaries = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1, "only rank 0 reports"
    run_dir = tmp_path / "run"
    manifest = json.loads((run_dir / "ckpt-000004" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert len([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]) == 4
    resumed = offload_train(args(tmp_path, 6, ["--resume", "latest", "--json"]))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and (run_dir / "latest").read_text() == "ckpt-000006"


def test_the_logged_learning_rate_is_the_one_the_step_applies_fresh_or_resumed(tmp_path) -> None:
    """metrics.jsonl's lr is read before each step: it must be that step's, not the step before's
    (the engine's param groups hold the last step's rate between steps; a resumed engine's, the next's),
    so that a resumed run logs what an uninterrupted one does."""
    import torch

    import offload_trainer as ot
    from offload_trainer.app.trainer import learning_rate
    from offload_trainer.models import DecoderConfig, DecoderLM

    cfg = ot.OffloadConfig(
        tiers={"params": "host", "grads": "host", "optimizer": "nvme", "nvme_dir": str(tmp_path / "swap")},
        optimizer={"schedule": "warmup_cosine", "warmup_steps": 2, "total_steps": 6},
    )
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg) as engine:
        for step in range(3):
            assert learning_rate(engine) == cfg.optimizer.lr_at(step)
            engine.backward(engine(tokens, tokens.roll(-1, 1))[1])
            engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert learning_rate(resumed) == cfg.optimizer.lr_at(3)
        torch.optim.lr_scheduler.LambdaLR(resumed.lr_optimizer, lambda s: 0.5)  # a torch scheduler drives it now
        assert learning_rate(resumed) == resumed.param_groups[0]["lr"] == 0.5 * cfg.optimizer.lr_at(3)


def test_how_to_continue_names_the_newest_complete_checkpoint_when_no_latest_does(tmp_path) -> None:
    """`latest` is taken away (made to name none) while the checkpoint it named is being replaced: a run
    stopped then is told which checkpoint to resume from, not to start over (which would remove them);
    resumed from another directory, that one. Without any `latest` (killed between its first checkpoint's
    rename and `latest`'s write), --resume latest resumes the newest complete checkpoint."""
    from offload_trainer.app.run_config import RunConfig
    from offload_trainer.app.trainer import Trainer

    run = tmp_path / "run"
    for name in ("ckpt-000002", "ckpt-000003", "ckpt-000004.tmp-1234"):
        (run / name).mkdir(parents=True)
        (run / name / "manifest.json").write_text("{}")
    (run / "ckpt-000005").mkdir()  # no manifest: not complete
    (run / "metrics.jsonl").write_text("")
    trainer = Trainer(RunConfig().with_overrides({"train.out_dir": str(run)}))
    assert "--resume latest (the newest checkpoint is ckpt-000003)" in trainer.how_to_continue()
    (run / "latest").write_text("")
    assert "--resume ckpt-000003" in trainer.how_to_continue()
    trainer.resumed_from = tmp_path / "other" / "ckpt-000001"
    assert f"--resume {tmp_path / 'other' / 'ckpt-000001'}" in trainer.how_to_continue()
    (run / "latest").write_text("ckpt-000002")
    assert "--resume latest" in trainer.how_to_continue()


def test_how_to_continue_under_resume_auto_before_the_first_checkpoint_says_to_run_it_again(tmp_path) -> None:
    """A preemptible job stopped (SIGTERM) before its first save under --resume auto: its own command
    starts it over (run_checks.started_before), so the line says so, not --train.overwrite true."""
    from offload_trainer.app.run_config import RunConfig
    from offload_trainer.app.trainer import RunPhase, Trainer

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    cfg = RunConfig().with_overrides({"train.out_dir": str(run)})
    assert "--train.overwrite true" in Trainer(cfg, resume="auto").how_to_continue()  # still starting: not ours
    trainer = Trainer(cfg, resume="auto")
    trainer.phase = RunPhase.TRAINING
    assert "run the same command again (--resume auto" in trainer.how_to_continue()
    trainer = Trainer(cfg)
    trainer.phase = RunPhase.TRAINING
    assert "--train.overwrite true" in trainer.how_to_continue()


@pytest.mark.slow  # measures the machine for the planner once, ~15 s
def test_auto_placement_table_counts_the_models_parameters(tiny_run_args, tmp_path: Path) -> None:
    """Under placement = "auto" the run prints (and saves as plan.txt) the planner's table; its ZeRO rows
    counted the parameters after initialize, when the model holds empty placeholders: all 0 B."""
    from offload_trainer.app import cli
    from offload_trainer.models import DecoderConfig, DecoderLM
    from offload_trainer.planning.report import format_bytes

    assert cli.main(tiny_run_args("--placement", "auto", "--train.steps", "1")) == 0
    table = (tmp_path / "out" / "plan.txt").read_text()
    row = next(line for line in table.splitlines() if line.strip().startswith("0 (data parallel)"))
    numel = sum(p.numel() for p in DecoderLM(DecoderConfig.preset("tiny")).parameters())  # tied ones once
    assert format_bytes(4 * numel) in row, (row, numel)


def test_a_resumed_runs_summary_says_its_first_loss_is_the_runs() -> None:
    """A resumed run printed "loss: first step 5.71" with the loss of the original run's step 1 (kept in
    the checkpoint so that its summary agrees with an uninterrupted run's), as if it were its own."""
    from offload_trainer.app.trainer import RunSummary, format_summary

    assert "loss: first step 5.0000, last step 4.0000;" in format_summary(RunSummary(first_loss=5.0, last_loss=4.0))
    resumed = format_summary(RunSummary(first_loss=5.0, last_loss=4.0, resumed_step=2))
    assert "loss: first step of the run 5.0000 (this process resumed it at step 2), last step 4.0000;" in resumed


def test_a_run_that_holds_nothing_out_says_no_eval_and_logs_json(tiny_run_args, tmp_path: Path, capsys) -> None:
    """data.eval_fraction = 0 (allowed: nothing held out) printed "evaluating on 1 held-out batches..."
    and wrote `"eval_loss": NaN` into metrics.jsonl, which is no JSON."""
    from offload_trainer.app.cli import main

    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    assert main(tiny_run_args("--data.eval_fraction", "0", "--json")) == 0
    out = capsys.readouterr().out
    assert "evaluating" not in out
    rows = [json.loads(line, parse_constant=strict) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval_loss"] is None
    # --json's summary printed `"eval_loss": NaN` (jq: "Invalid numeric literal"); null now, as in metrics.jsonl.
    summary = json.loads(out.splitlines()[-1], parse_constant=strict)
    assert summary["eval_loss"] is None and summary["eval_perplexity"] is None and summary["steps"] == 2
    # Each row says how far through the training sequences the run is, as the HF Trainer's `epoch`.
    assert 0 < rows[0]["epoch"] < rows[1]["epoch"] and rows[1]["epoch"] == 2 * rows[0]["epoch"]


def test_the_summary_gives_the_eval_perplexity() -> None:
    import math

    from offload_trainer.app.trainer import RunSummary, format_summary, summary_json

    summary = RunSummary(first_loss=5.0, last_loss=4.0, eval_loss=math.log(20.0))
    assert "eval loss 2.9957 (perplexity 20.00)" in format_summary(summary)
    assert summary_json(summary)["eval_perplexity"] == pytest.approx(20.0)
    assert "perplexity" not in format_summary(RunSummary())
    assert summary_json(RunSummary(eval_loss=1e6))["eval_perplexity"] is None  # past exp's range: inf, no JSON


def test_one_held_out_batch_is_said_in_the_singular(tiny_run_args, capsys) -> None:
    """The eval's line read "evaluating on 1 held-out batches..."."""
    from offload_trainer.app.cli import main

    assert main(tiny_run_args("--train.eval_batches", "1")) == 0
    out = capsys.readouterr().out
    assert "evaluating on 1 held-out batch...\n" in out and "batches" not in out


def test_a_resume_from_another_directory_takes_that_runs_metrics_not_out_dirs(tiny_run_args, tmp_path: Path) -> None:
    """Resumed from a checkpoint of run A into an out_dir that held run B, metrics.jsonl kept B's rows up to
    the resumed step: the file told B's first steps and A's later ones as one run."""
    from offload_trainer.app.cli import main

    def rows(out: str) -> list:
        return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    tensorboard = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

    def losses(out: str) -> dict:
        events = tensorboard.EventAccumulator(str(tmp_path / out / "tensorboard"))
        events.Reload()
        return {e.step: e.value for e in events.Scalars("train/loss")}

    logs = ("--train.loggers", "jsonl,tensorboard")
    assert main(tiny_run_args("--train.out_dir", str(tmp_path / "a"), *logs)) == 0
    assert main(tiny_run_args("--train.out_dir", str(tmp_path / "b"), "--optimizer.lr", "0.01", *logs)) == 0
    a = rows("a")
    assert a[0]["loss"] != rows("b")[1]["loss"]
    assert main(tiny_run_args("--train.out_dir", str(tmp_path / "b"), "--resume", str(tmp_path / "a" / "ckpt-000001"), *logs)) == 0
    b = rows("b")
    assert [r["step"] for r in b] == [1, 2] and b[0] == a[0]
    assert b[1]["loss"] == a[1]["loss"]  # the resumed run continues A bit for bit
    # TensorBoard: B's own events are purged, not kept up to the resumed step.
    assert losses("b") == {2: pytest.approx(a[1]["loss"])}
    # A checkpoint copied alone (no metrics.jsonl beside it): out_dir's other rows go, none are made up.
    alone = tmp_path / "alone"
    shutil.copytree(tmp_path / "a" / "ckpt-000001", alone / "ckpt-000001")
    assert main(tiny_run_args("--train.out_dir", str(tmp_path / "b"), "--resume", str(alone / "ckpt-000001"))) == 0
    assert [r["step"] for r in rows("b")] == [2]


def test_the_summarys_bytes_hold_the_last_steps_update_pass(tiny_run_args, tmp_path: Path, capsys) -> None:
    """A step's stats hold the update pass that ran behind it, so the run's totals missed the last step's
    own: a 1-step run with every state on NVMe summed "bytes written per tier: none". Each step's pass
    writes the same bytes, so two steps write twice what one does."""
    from offload_trainer.app.cli import main

    written = []
    for steps in (1, 2):
        out = tmp_path / f"out{steps}"
        extra = ("--tiers.params", "nvme", "--tiers.optimizer", "nvme", "--train.steps", str(steps), "--json",
                 "--train.out_dir", str(out))
        assert main(tiny_run_args(*extra)) == 0
        summary = json.loads(capsys.readouterr().out.splitlines()[-1])
        written.append(summary["bytes_written"].get("nvme", 0))
    assert written[0] > 0 and written[1] == 2 * written[0], written
