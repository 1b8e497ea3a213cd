"""app/data_identity.py: a resume whose data is not the data the checkpoint's position counts in is
refused in one line naming what changed (exit 2, out_dir untouched), and so is one whose steps see another
number of sequences; a resume that changes only what neither depends on (how a step is split into
micro-batches, where the corpus lies) goes on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from offload_trainer.app.cli import main


def snapshot(out: Path) -> dict:
    return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture
def saved_run(tiny_run_args, tmp_path):
    """A finished 2-step run (checkpoints at 1 and 2), and a function resuming it to step 3 with more flags."""
    assert main(tiny_run_args()) == 0

    def resume(*flags: str) -> int:
        return main(tiny_run_args("--resume", "latest", "--train.steps", "3", *flags))

    return resume


@pytest.mark.parametrize("flags, named", [
    (("--data.seq_len", "16"), "data.seq_len=32 then, 16 now"),
    (("--data.eval_fraction", "0.2"), "data.eval_fraction=0.05 then, 0.2 now"),
    (("--seed", "3"), "saved with seed=0, this run has seed=3"),
])
def test_a_resume_with_settings_that_change_the_data_order_is_refused(saved_run, tmp_path, capsys, flags, named) -> None:
    before = snapshot(tmp_path / "out")
    capsys.readouterr()
    assert saved_run(*flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and f"resume with {' '.join(flags[:1])} " in err[0], err
    assert snapshot(tmp_path / "out") == before


def test_a_resume_over_a_corpus_whose_files_changed_is_refused(saved_run, tmp_path, capsys) -> None:
    (tmp_path / "corpus" / "b.py").write_text("x = 1\n" * 50)  # a file added to the corpus
    capsys.readouterr()
    assert saved_run() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was saved over other data" in err[0] and "files of data.path" in err[0], err


@pytest.mark.parametrize("where", [0.3, 0.6])
def test_a_resume_over_a_corpus_edited_between_its_ends_is_refused(saved_run, tmp_path, capsys, where: float) -> None:
    """One character changed inside the corpus: as many tokens and sequences, the first and last alike,
    other tokens in between. A CRC32 of the ends alone let the resume go on over the edited data.
    (The edited copy lies elsewhere: tiny_run_args writes corpus/ again, and a moved corpus may resume.)"""
    shutil.copytree(tmp_path / "corpus", tmp_path / "edited")
    path = tmp_path / "edited" / "a.py"
    text = path.read_text()
    at = int(len(text) * where)
    path.write_text(text[:at] + ("Y" if text[at] != "Y" else "Z") + text[at + 1 :])
    before = snapshot(tmp_path / "out")
    capsys.readouterr()
    assert saved_run("--data.path", str(tmp_path / "edited")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "as many training sequences, but other tokens" in err[0], err
    assert snapshot(tmp_path / "out") == before


def test_a_checkpoint_without_the_whole_crc_is_checked_by_its_ends(tmp_path) -> None:
    """Checkpoints saved before train_crc32 was kept resume as before (compared by their ends)."""
    from offload_trainer.app.data import ByteTokenizer, PackedDataset
    from offload_trainer.app.data_identity import check_same_data, data_identity
    from offload_trainer.app.run_config import RunConfig

    data = PackedDataset(["some text to pack " * 30], ByteTokenizer(), seq_len=8)
    now = data_identity(RunConfig(), data)
    older = {k: v for k, v in now.items() if k != "train_crc32"}
    check_same_data(older, now, tmp_path)
    with pytest.raises(ValueError, match="other tokens"):
        check_same_data(now, {**now, "train_crc32": now["train_crc32"] ^ 1}, tmp_path)


def test_a_resume_with_smaller_micro_batches_or_a_moved_corpus_goes_on(saved_run, tmp_path, capsys) -> None:
    """As many sequences per step (4 x 1 saved, 2 x 2 now), split otherwise to fit memory: the same run."""
    shutil.copytree(tmp_path / "corpus", tmp_path / "moved")
    capsys.readouterr()
    assert saved_run("--data.batch_size", "2", "--grad_accum_steps", "2", "--data.path", str(tmp_path / "moved")) == 0
    assert (tmp_path / "out" / "ckpt-000003").is_dir()
    assert "loss: first step of the run " in capsys.readouterr().out


def test_a_resume_whose_steps_see_other_numbers_of_sequences_is_refused(saved_run, tmp_path, capsys) -> None:
    """It went on without a word (README allowed "the batch size" to change): every step after it saw
    another number of sequences under the schedule of the run it claimed to continue."""
    before = snapshot(tmp_path / "out")
    capsys.readouterr()
    assert saved_run("--data.batch_size", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert ("data.batch_size=4 x grad_accum_steps=1 = 4 sequences per optimizer step, this run has "
            "data.batch_size=2 x grad_accum_steps=1 = 2") in err[0]
    assert "resume with --data.batch_size 4 --grad_accum_steps 1 (or --data.batch_size 2 --grad_accum_steps 2" in err[0]
    assert snapshot(tmp_path / "out") == before


def test_grad_accum_steps_count_in_the_sequences_per_step(tmp_path) -> None:
    from offload_trainer.app.data import ByteTokenizer, PackedDataset
    from offload_trainer.app.data_identity import check_same_data, data_identity
    from offload_trainer.app.run_config import RunConfig

    data = PackedDataset(["some text to pack " * 30], ByteTokenizer(), seq_len=8)
    saved = data_identity(RunConfig(data={"batch_size": 4}), data)
    check_same_data(saved, data_identity(RunConfig(data={"batch_size": 2}, grad_accum_steps=2), data), tmp_path)
    with pytest.raises(ValueError, match="this run has data.batch_size=4 x grad_accum_steps=3 = 12"):
        check_same_data(saved, data_identity(RunConfig(data={"batch_size": 4}, grad_accum_steps=3), data), tmp_path)
