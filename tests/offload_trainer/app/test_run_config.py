"""RunConfig's notes: what offload-train accepts but says, one line each, at the start of a run."""

from __future__ import annotations

from offload_trainer.app.run_config import RunConfig


def warmup(steps: int, warmup_steps: int) -> RunConfig:
    return RunConfig().with_overrides({
        "train.steps": str(steps), "optimizer.schedule": "warmup_cosine",
        "optimizer.warmup_steps": str(warmup_steps), "optimizer.total_steps": str(max(steps, warmup_steps) + 10),
    })


def test_a_warmup_longer_than_the_run_is_said_with_where_the_rate_ends() -> None:
    """A warmup longer than train.steps was accepted silently: the rate never reached optimizer.lr. Not
    refused (a resumed run may raise train.steps past it), but said, naming both settings."""
    cfg = warmup(steps=4, warmup_steps=10)
    note = cfg.warmup_note()
    assert note is not None and "\n" not in note
    assert "optimizer.warmup_steps=10 is longer than train.steps=4" in note
    # Step 4's rate is lr * 4 / 10 (OptimizerConfig.lr_at(3)): 40% of the peak.
    assert cfg.optimizer.lr_at(cfg.train.steps - 1) == cfg.optimizer.lr * 0.4 and "ends at 40% of optimizer.lr" in note
    assert warmup(steps=10, warmup_steps=10).warmup_note() is None  # the last step trains at the peak
    assert warmup(steps=10, warmup_steps=0).warmup_note() is None
    assert RunConfig().with_overrides({"train.steps": "1"}).warmup_note() is None  # constant: no warmup


def test_offload_train_says_the_warmup_outlasts_the_run(tiny_run_args, capsys, monkeypatch) -> None:
    """Said at the start, before the corpus is read (the run is stopped there: the note is all this checks)."""
    from offload_trainer.app import trainer
    from offload_trainer.app.cli import main

    def stop(*args: object) -> None:
        raise ValueError("stopped where the corpus is read")

    monkeypatch.setattr(trainer, "build_data", stop)
    argv = tiny_run_args(
        "--train.steps", "1", "--optimizer.schedule", "warmup_cosine", "--optimizer.warmup_steps", "5",
        "--optimizer.total_steps", "10",
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("offload-train: optimizer.warmup_steps=5 is longer than train.steps=1") == 1, err
    assert main(tiny_run_args("--train.steps", "5", "--optimizer.schedule", "warmup_cosine",
                              "--optimizer.warmup_steps", "5", "--optimizer.total_steps", "10")) == 2
    assert "warmup_steps" not in capsys.readouterr().err
