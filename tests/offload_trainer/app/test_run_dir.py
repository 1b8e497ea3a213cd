"""The pieces of offload-train's endings and its out_dir, each on its own: run_dir's upkeep, the
signal handling, the non-finite check, the one-line error messages."""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from offload_trainer.app import run_dir
from offload_trainer.app.cli import build_parser
from offload_trainer.app.run_config import RunConfig
from offload_trainer.app.signals import Terminated, ending_signals
from offload_trainer.app.trainer import RunPhase, Trainer
from offload_trainer.app.user_errors import PathRole, describe_os_error, naming_path
from offload_trainer.runtime.metrics import StepStats


def test_truncate_metrics_keeps_the_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path: Path) -> None:
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "lo')
    run_dir.truncate_metrics(tmp_path, 2)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_truncate_metrics_drops_a_line_no_json_reader_holds(tmp_path: Path) -> None:
    """A line nested past the recursion limit (RecursionError: a resume ended in a traceback) or holding an
    int of too many digits (a ValueError that is no JSONDecodeError) is dropped as a torn line is."""
    lines = [json.dumps({"step": s}) for s in (1, 2)] + ["[" * 100_000 + "]" * 100_000, '{"step": 1' + "0" * 5000 + "}"]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run_dir.truncate_metrics(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(lines[:2]) + "\n"


def test_remove_run_removes_the_run_only_and_never_follows_a_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    run = tmp_path / "run"
    (run / "ckpt-000002").mkdir(parents=True)
    (run / "ckpt-000002" / "manifest.json").write_text("{}")
    os.symlink(outside, run / "ckpt-000004")
    for name in ("latest", "config.json", "metrics.jsonl", "model.safetensors", "notes.txt"):
        (run / name).write_text(name)
    run_dir.remove_run(run)
    assert sorted(os.listdir(run)) == ["notes.txt"]
    assert (outside / "keep.txt").read_text() == "keep"


def test_a_removal_killed_half_way_leaves_a_temporary_never_a_checkpoint_that_looks_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.overwrite's removal of the replaced run, killed inside a checkpoint's removal (its shards
    gone, its manifest not yet): the checkpoint was left looking complete, `latest` was gone, and the
    next run's message said to resume from it. Every directory is renamed aside before it is removed."""
    import shutil

    run = tmp_path / "run"
    for step in (1, 2):
        (run / f"ckpt-00000{step}").mkdir(parents=True)
        (run / f"ckpt-00000{step}" / "manifest.json").write_text("{}")
        (run / f"ckpt-00000{step}" / "rank00000.bin").write_bytes(b"\0" * 64)
    (run / "latest").write_text("ckpt-000002")

    def killed(path, ignore_errors=False):  # the shards removed, then SIGKILL (what unwinds here instead)
        os.unlink(Path(path) / "rank00000.bin")
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        run_dir.remove_run(run)
    monkeypatch.undo()
    left = run_dir.checkpoints(run)
    assert all((run / name / "rank00000.bin").exists() for name in left), left
    assert left == ["ckpt-000002"] and len(run_dir.temporaries(run)) == 1
    run_dir.remove_entries(run, run_dir.temporaries(run))  # what the next run does
    assert sorted(os.listdir(run)) == ["ckpt-000002", "replacing"]


def test_a_directory_is_renamed_aside_durably_before_its_contents_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Power loss, not a kill: keep_last's (and train.overwrite's, and the cleanup's) removal renamed a
    checkpoint aside and removed its files with no fsync of out_dir between, so a file system free to
    reorder the two could come back with the checkpoint under its own name, manifest and all, and its
    shards gone. Each directory's rename, its own or the earlier one that made the temporary (a
    displaced checkpoint), is durable before anything inside it is removed."""
    import shutil

    from io_engine.atomic_file import fsync_dir as real_fsync_dir

    run = tmp_path / "run"
    for name in ("ckpt-000001", "ckpt-000002.tmp-0123456789abcdef"):
        (run / name).mkdir(parents=True)
        (run / name / "rank00000.bin").write_bytes(b"\0" * 64)
    (run / "config.json").write_text("{}")
    events: list = []
    real_rename, real_rmtree = os.rename, shutil.rmtree
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", Path(a).name)), real_rename(a, b))[1])
    monkeypatch.setattr(
        run_dir, "fsync_dir", lambda d: (events.append(("fsync", Path(d))), real_fsync_dir(d))[1], raising=False
    )
    monkeypatch.setattr(
        shutil, "rmtree", lambda d, ignore_errors=False: (events.append(("rmtree", Path(d).name[:10])), real_rmtree(d))[1]
    )
    run_dir.remove_entries(run, ["ckpt-000001", "ckpt-000002.tmp-0123456789abcdef", "config.json"])
    assert events == [
        ("rename", "ckpt-000001"), ("fsync", run), ("rmtree", "ckpt-00000"),
        ("fsync", run), ("rmtree", "ckpt-00000"),
    ]
    assert os.listdir(run) == []


def test_a_fresh_runs_out_dir_is_made_durable_before_anything_is_saved_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.out_dir and its missing parents are made (run's first start) with each new entry fsynced
    in its parent: every checkpoint, `latest` and metrics row fsynced inside a directory whose own
    entry was not could vanish with it on power loss."""
    import io_engine.atomic_file as atomic_file

    synced: list = []
    real = atomic_file.fsync_dir
    monkeypatch.setattr(atomic_file, "fsync_dir", lambda d: (synced.append(Path(d)), real(d))[1])
    out_dir = tmp_path / "runs" / "x"
    cfg = RunConfig().with_overrides({"train.out_dir": str(out_dir)})
    trainer = Trainer(cfg)
    try:
        trainer._prepare_out_dir(cfg, None, None)
    finally:
        trainer.out_dir_lock.release()
    assert synced[:2] == [tmp_path, tmp_path / "runs"], synced
    assert (out_dir / "config.json").is_file()


class _Killed(BaseException):
    """What a kill does at a file-system change, in-process: nothing after it happens."""


_KILL = {"at": 0, "changes": 0}
"""The file-system change (1, 2, ...) at which _kill_hook raises _Killed; 0: never."""
_CHANGES = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.symlink", "os.truncate"}


def _kill_hook(event: str, args: tuple) -> None:
    if not _KILL["at"]:
        return
    if event == "open":
        mode, flags = args[1], args[2]
        changes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    else:
        changes = event in _CHANGES
    if changes:
        _KILL["changes"] += 1
        if _KILL["changes"] >= _KILL["at"]:  # this one and every later one: the process is gone
            raise _Killed(event)


def killed_at_each_change(make, act):
    """For n = 1, 2, ...: make() a fresh state, then act() on it killed before its nth file-system
    change (an audit hook raising _Killed there and at every later change); yields n and whether the
    kill came (False once act() made fewer than n changes, the last one yielded)."""
    import sys

    if not _KILL.get("installed"):
        sys.addaudithook(_kill_hook)  # for the session: audit hooks cannot be removed
        _KILL["installed"] = 1
    for n in range(1, 1000):
        make()
        _KILL.update(at=n, changes=0)
        try:
            act()
            killed = False
        except _Killed:
            killed = True
        finally:
            _KILL["at"] = 0
        yield n, killed
        if not killed:
            return


def test_an_overwrite_killed_at_any_change_never_offers_the_replaced_run(tmp_path: Path) -> None:
    """train.overwrite's removal of the run before, killed before each of its file-system changes in
    turn: the old run is either whole (not touched yet) or marked as being replaced, and then no
    checkpoint of it is offered (--resume auto resumed it, the interrupted run's line named it) and
    only --train.overwrite true goes on, which removes the rest, export included (it was removed last
    and stayed beside the next run's checkpoints)."""
    import shutil

    from offload_trainer.app.run_checks import check_run_dir

    run = tmp_path / "run"
    cfg = RunConfig().with_overrides({"train": {"out_dir": str(run)}})
    overwrite = cfg.with_overrides({"train": {"overwrite": True}})
    everything = ["ckpt-000001", "ckpt-000002", "config.json", "hf", "latest", "metrics.jsonl", "model.safetensors",
                  "notes.txt"]

    def make() -> None:
        shutil.rmtree(run, ignore_errors=True)
        for step in (1, 2):
            (run / f"ckpt-00000{step}").mkdir(parents=True)
            (run / f"ckpt-00000{step}" / "rank00000.bin").write_bytes(b"\0" * 64)
            (run / f"ckpt-00000{step}" / "manifest.json").write_text("{}")
        (run / "hf").mkdir()
        (run / "hf" / "config.json").write_text("{}")
        for name in ("config.json", "metrics.jsonl", "model.safetensors", "notes.txt"):
            (run / name).write_text(name)
        run_dir.point_latest(run, "ckpt-000002")

    for n, killed in killed_at_each_change(make, lambda: run_dir.remove_run(run)):
        if not killed:
            break
        left = sorted(set(os.listdir(run)) - run_dir.temporaries(run))  # temporaries: the next run removes them
        if not run_dir.replacement_interrupted(run):
            assert left == everything, f"killed before change {n}: {left}"  # untouched: still the run, whole
            continue
        assert run_dir.complete_checkpoints(run) == [] and run_dir.latest_checkpoint(run) is None, (n, left)
        for resume in (None, "auto", "latest", str(run / "ckpt-000001")):
            with pytest.raises(ValueError, match="removal by --train.overwrite was interrupted.*--train.overwrite true"):
                check_run_dir(cfg, resume)
        trainer = Trainer(cfg)
        assert "--train.overwrite true" in trainer.how_to_continue() and "--resume" not in trainer.how_to_continue()
        assert check_run_dir(overwrite, None) is None
        run_dir.remove_run(run)  # the next run with --train.overwrite true
        run_dir.remove_entries(run, run_dir.temporaries(run))
        assert sorted(os.listdir(run)) == ["notes.txt"], (n, sorted(os.listdir(run)))
    assert n > 5 and sorted(os.listdir(run)) == ["notes.txt"]


def test_a_start_over_killed_at_any_change_is_started_over_again(tmp_path: Path) -> None:
    """--resume auto's removal of what the same run left before its first checkpoint, killed before each
    of its file-system changes in turn: the next retry (the same command) starts over again. Removed
    through remove_run, a kill left its REPLACING marker, and every retry was refused until someone
    passed --train.overwrite true."""
    import shutil

    from offload_trainer.app.run_checks import check_run_dir

    run = tmp_path / "run"
    cfg = RunConfig().with_overrides({"train": {"out_dir": str(run)}})
    trainers: list = []

    def make() -> None:
        for trainer in trainers:
            trainer.out_dir_lock.release()
        shutil.rmtree(run, ignore_errors=True)
        (run / "tensorboard").mkdir(parents=True)
        (run / "tensorboard" / "events.out").write_text("")
        for name in ("config.json", "metrics.jsonl", "plan.txt", "trace-rank1.json", "notes.txt"):
            (run / name).write_text(cfg.to_json() if name == "config.json" else name)
        trainers[:] = [Trainer(cfg, resume="auto")]

    for n, killed in killed_at_each_change(make, lambda: trainers[0]._prepare_out_dir(cfg, None, None)):
        assert check_run_dir(cfg, "auto") is None, f"killed before change {n}: {sorted(os.listdir(run))}"
    trainers[0].out_dir_lock.release()
    assert n > 5 and sorted(os.listdir(run)) == ["config.json", "notes.txt"]


def test_a_killed_exports_new_directory_counts_as_a_temporary_and_the_export_is_left_alone(tmp_path: Path) -> None:
    """An export directory is written whole beside its name (io_engine/atomic_dir.py): a kill leaves
    its new version (or the replaced one) as `hf.tmp-*` in out_dir, removed by the next run; the
    export itself, and anything behind a symlink, are left alone."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "theirs.bin.tmp-1").write_text("not ours")
    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    os.symlink(outside, run / "hf" / "linked")
    (run / "hf.tmp-0123456789abcdef").mkdir()
    (run / "hf.tmp-0123456789abcdef" / "model.safetensors.tmp-fedcba9876543210").write_bytes(b"\0" * 64)
    (run / ".hf.tmp-abc").mkdir()
    (run / ".hf.tmp-abc" / "config.json").write_text("{}")
    (run / "latest.tmp-0011").write_text("ckpt")
    left = run_dir.temporaries(run)
    assert left == {"hf.tmp-0123456789abcdef", ".hf.tmp-abc", "latest.tmp-0011"}
    run_dir.remove_entries(run, left)
    assert run_dir.temporaries(run) == set()
    assert sorted(os.listdir(run)) == ["hf"] and sorted(os.listdir(run / "hf")) == ["config.json", "linked"]
    assert (outside / "theirs.bin.tmp-1").read_text() == "not ours"


def test_copy_atomic_replaces_a_planted_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    src = tmp_path / "tokenizer.json"
    src.write_text("{}")
    os.symlink(victim, tmp_path / "out.json")
    run_dir.copy_atomic(src, tmp_path / "out.json")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "out.json").is_symlink() and (tmp_path / "out.json").read_text() == "{}"


def test_metrics_are_never_appended_through_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "metrics.jsonl")
    with pytest.raises(OSError) as info:
        run_dir.open_metrics(tmp_path)
    assert info.value.errno == errno.ELOOP and victim.read_text() == "precious"


def test_latest_names_only_a_complete_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "ckpt-000001").mkdir()
    run_dir.point_latest(tmp_path, "ckpt-000001")
    assert run_dir.latest_checkpoint(tmp_path) is None  # no manifest: an interrupted save
    (tmp_path / "ckpt-000001" / "manifest.json").write_text("{}")
    assert run_dir.latest_checkpoint(tmp_path) == "ckpt-000001"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_unwinds_as_terminated_and_a_second_one_waits_for_the_cleanup(signum: int) -> None:
    cleaned = []
    with pytest.raises(Terminated) as info:
        with ending_signals():
            try:
                os.kill(os.getpid(), signum)
                for _ in range(10**6):  # the handler runs between bytecodes
                    pass
            finally:
                os.kill(os.getpid(), signum)  # ignored: the cleanup below still runs
                for _ in range(10**5):
                    pass
                cleaned.append(True)
    assert cleaned == [True] and info.value.exit_status == 128 + signum
    assert signal.getsignal(signum) is not None  # the previous handler is back


def test_prefixes_of_flags_are_not_taken_for_the_flags() -> None:
    args, rest = build_parser().parse_known_args(["--resum", "latest", "--js"])
    assert args.resume is None and not args.json and rest == ["--resum", "latest", "--js"]


def test_the_moment_a_run_ended_names_the_save_or_load_under_way_not_a_step_yet_to_begin(tmp_path: Path) -> None:
    trainer = Trainer(RunConfig().with_overrides({"train.out_dir": str(tmp_path)}))
    assert trainer.moment() == "while starting"  # checks, model, data, engine: out_dir untouched
    trainer.phase, trainer.step = RunPhase.TRAINING, 0
    assert trainer.moment() == "before step 1"  # out_dir prepared, no step begun
    trainer.step, trainer.stepping = 2, True
    assert trainer.moment() == "during step 3"
    trainer.stepping = False  # step 3 counted: its eval, its log line, its save not yet begun
    assert trainer.moment() == "after step 2"
    trainer.stepping = True
    trainer.saving = "ckpt-000002"
    assert trainer.moment() == "while saving ckpt-000002"
    trainer.saving, trainer.step, trainer.loading = None, 0, "ckpt-000002"  # a resume's load: step 0 still
    assert trainer.moment() == "while loading ckpt-000002"
    trainer.loading, trainer.step, trainer.phase = None, 6, RunPhase.EXPORTING  # after the last step (6 of 6)
    assert trainer.moment() == "while exporting the weights"
    trainer.phase = RunPhase.FINISHING  # closing the engine, printing the summary: it said "during step 7"
    assert trainer.moment() == "after its last step"


@pytest.mark.parametrize("where", ["_evaluate", "_save"])
def test_a_signal_between_a_step_and_its_checkpoint_names_the_step_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """SIGTERM after the last step of a 2-step run (checkpoint every step), in its eval or as its save
    begins: the line said "during step 3" of a run of 2 steps, a step that was never to come. It says
    "after step 2", and the way on names ckpt-000001, the checkpoint that was written."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def add(a, b):\n    return a + b\n" * 80)
    cfg = RunConfig().with_overrides({
        "model.preset": "tiny", "data.path": str(corpus), "data.seq_len": "16", "data.batch_size": "2",
        "train.steps": "2", "train.checkpoint_every": "1", "train.eval_batches": "1", "train.export_dtype": "none",
        "train.out_dir": str(tmp_path / "run"), "tiers.nvme_dir": str(tmp_path / "swap"),
    })
    (tmp_path / "swap").mkdir()
    real = getattr(Trainer, where)

    def signalled(self: Trainer, engine, *args, **kwargs):
        if engine.global_step == 2:
            raise Terminated(signal.SIGTERM)  # what the handler raises, at the call's first bytecode
        return real(self, engine, *args, **kwargs)

    monkeypatch.setattr(Trainer, where, signalled)
    trainer = Trainer(cfg, progress=False, say=lambda line: None)
    with pytest.raises(Terminated):
        trainer.run()
    assert trainer.moment() == "after step 2"
    assert trainer.how_to_continue() == "resume with --resume latest (the newest checkpoint is ckpt-000001)"


def test_after_the_last_step_the_line_says_whether_the_export_is_written(tmp_path: Path) -> None:
    trainer = Trainer(RunConfig().with_overrides({"train.out_dir": str(tmp_path)}))
    (tmp_path / "ckpt-000006").mkdir()
    (tmp_path / "ckpt-000006" / "manifest.json").write_text("{}")
    run_dir.point_latest(tmp_path, "ckpt-000006")
    trainer.phase, trainer.export_target = RunPhase.EXPORTING, tmp_path / "hf"
    assert trainer.how_to_continue() == (
        f"every step is saved (ckpt-000006) but the export to {tmp_path / 'hf'} is not written (what was there "
        "is as it was): run with --resume latest to write it"
    )
    trainer.phase = RunPhase.FINISHING
    assert trainer.how_to_continue() == (
        f"every step is saved (ckpt-000006) and the export is in {tmp_path / 'hf'}: the run is complete"
    )
    trainer.export_target = None  # train.export_dtype = none
    assert trainer.how_to_continue() == "every step is saved (ckpt-000006): the run is complete"


def test_a_non_finite_loss_alone_counts_as_a_non_finite_step(tmp_path: Path) -> None:
    trainer = Trainer(RunConfig().with_overrides({"train.out_dir": str(tmp_path)}))
    trainer.ranks = SimpleNamespace(several=False)  # type: ignore[assignment]
    finite = StepStats()
    assert trainer._nonfinite(2.5, 2.5, finite) is None
    assert trainer._nonfinite(float("nan"), float("nan"), finite) == "the loss is nan"
    # Finite here, not on another rank: the mean over the ranks is not finite.
    assert trainer._nonfinite(2.5, float("nan"), finite) == "the loss is not finite on another rank"
    bad = StepStats()
    bad.nonfinite = True
    assert "the gradients hold inf or nan" in trainer._nonfinite(2.5, 2.5, bad)
    fp16 = Trainer(RunConfig().with_overrides({"train.out_dir": str(tmp_path), "precision.compute_dtype": "fp16"}))
    bad.loss_scale = 1.0
    assert "even at the minimum loss scale (precision.min_loss_scale=1)" in fp16._nonfinite(2.5, 2.5, bad)


def test_an_os_error_names_the_path_the_setting_and_the_fix(tmp_path: Path) -> None:
    roles = [PathRole(str(tmp_path / "run"), "train.out_dir")]
    with pytest.raises(OSError) as info:
        with naming_path(tmp_path / "run" / "ckpt-000001"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    message = describe_os_error(info.value, roles)
    assert str(tmp_path / "run" / "ckpt-000001") in message and "the disk is full" in message
    assert "train.out_dir" in message and "\n" not in message


def test_not_enough_space_gives_its_numbers_and_one_fix_naming_the_setting(tmp_path: Path) -> None:
    from io_engine.errors import NotEnoughSpaceError

    swap = tmp_path / "swap" / "offload-swap-1-x"
    message = describe_os_error(NotEnoughSpaceError(str(swap), 3 << 20, 1 << 20), [PathRole(str(tmp_path / "swap"), "tiers.nvme_dir")])
    assert message == (
        f"not enough space in {swap}: the swap files need 3145728 bytes (0.00 GiB) but the file system has 1048576 "
        "bytes (0.00 GiB) free; free 2097152 more bytes there, or set tiers.nvme_dir to a directory on a larger disk"
    )


def test_out_of_memory_under_an_address_space_limit_names_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `ulimit -v 800000` the tiny model, all on NVMe, failed mapping its IO engine's bounce buffers with
    "this machine's memory cannot hold what the placement keeps in memory; move state to NVMe": the state was
    there, and the limit was the process's address space (0.27 GiB resident, 1.7 GiB mapped)."""
    import resource

    no_memory = OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (800 << 20, resource.RLIM_INFINITY))
    message = describe_os_error(no_memory)
    assert "address-space limit (ulimit -v) of 800 MiB" in message and "MALLOC_ARENA_MAX=2" in message, message
    assert "move state to NVMe" not in message
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert "MALLOC_ARENA_MAX" not in describe_os_error(no_memory)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert "move state to NVMe" in describe_os_error(no_memory)


def test_a_failed_rename_into_place_names_the_destination_not_the_temporary(tmp_path: Path) -> None:
    """os.replace(temporary, target) fails naming both; the temporary is removed by then, so a line
    naming it sent the user looking for a file that is not there."""
    from io_engine.atomic_file import write_atomic

    (tmp_path / "config.json").mkdir()
    with pytest.raises(OSError) as info:
        write_atomic(tmp_path / "config.json", "{}")
    message = describe_os_error(info.value, [PathRole(str(tmp_path), "train.out_dir")])
    assert message.startswith(f"{tmp_path / 'config.json'}: ") and ".tmp-" not in message, message
    assert "train.out_dir" in message


@pytest.mark.parametrize("err", [errno.ENOENT, errno.ENOSPC, errno.EACCES])
def test_a_failure_on_our_temporary_names_the_file_it_stands_for(tmp_path: Path, err: int) -> None:
    """An atomic write that fails on its temporary (created beside the target, removed on failure):
    offload-plan --write-config /proc/x.toml said '/proc/x.toml.tmp-cc95...: No such file'."""
    target = tmp_path / "planned.toml"
    exc = OSError(err, os.strerror(err), f"{target}.tmp-cc952758efea482b")
    message = describe_os_error(exc, [PathRole(str(target), "--write-config")])
    assert message.startswith(f"{target}: ") and ".tmp-" not in message and "--write-config" in message, message
    kept = describe_os_error(OSError(err, os.strerror(err), str(tmp_path / "a.tmp-notours")))
    assert kept.startswith(str(tmp_path / "a.tmp-notours")), kept


def test_a_warning_of_offload_plan_is_one_line_naming_the_command(capsys: pytest.CaptureFixture) -> None:
    import warnings

    from offload_trainer.app.user_errors import warnings_as_lines

    with warnings_as_lines("offload-plan"):
        warnings.warn("could not write the machine-rate cache /x\n(Is a directory)", stacklevel=1)
    assert capsys.readouterr().err == "offload-plan: warning: could not write the machine-rate cache /x (Is a directory)\n"


def test_resume_auto_continues_a_run_with_a_checkpoint_and_starts_one_without(tmp_path: Path) -> None:
    """`--resume auto`: one command for a first start and every retry of it (a preemptible job)."""
    from offload_trainer.app.run_checks import check_run_dir
    from offload_trainer.app.run_config import RunConfig

    out_dir = tmp_path / "run"
    cfg = RunConfig().with_overrides({"train": {"out_dir": str(out_dir)}})
    assert check_run_dir(cfg, "auto") is None  # nothing there yet: a fresh run
    out_dir.mkdir()
    assert check_run_dir(cfg, "auto") is None  # an empty directory too
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    # A run killed before its first checkpoint is not replaced unasked, as for a run without --resume.
    with pytest.raises(ValueError, match="holds another run that has no checkpoint.*--train.overwrite true"):
        check_run_dir(cfg, "auto")
    (out_dir / "ckpt-000002").mkdir()
    (out_dir / "ckpt-000002" / "manifest.json").write_text("{}")
    run_dir.point_latest(out_dir, "ckpt-000002")
    assert check_run_dir(cfg, "auto") == out_dir / "ckpt-000002"  # what --resume latest resumes
    run_dir.point_latest_nowhere(out_dir)  # taken away mid-replacement: latest's own refusal and fix
    with pytest.raises(ValueError, match="--resume latest: no latest file .* --resume ckpt-000002"):
        check_run_dir(cfg, "auto")
    with pytest.raises(ValueError, match="--train.overwrite true removes the run that --resume would continue"):
        check_run_dir(cfg.with_overrides({"train": {"overwrite": True}}), "auto")


def test_resume_auto_starts_over_what_the_same_run_left_before_its_first_checkpoint(tmp_path: Path) -> None:
    """A preemptible job killed before its first save left config.json and some metrics: its retry, the
    same command with --resume auto, was refused as "another run that has no checkpoint" on every
    attempt. The same config (as config.json holds it; under placement = "auto" bar what the planner
    chose) starts over, and the trainer removes what the first attempt left; another config's files,
    or anything a run writes only from its first save on, are refused as before."""
    from offload_trainer.app.run_checks import check_run_dir, started_before
    from offload_trainer.app.run_config import RunConfig

    out_dir = tmp_path / "run"
    cfg = RunConfig().with_overrides({"train": {"out_dir": str(out_dir)}})
    out_dir.mkdir()
    (out_dir / "config.json").write_text(cfg.to_json())
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    (out_dir / "trace-rank1.json").write_text("{}")
    (out_dir / "tensorboard").mkdir()
    assert started_before(cfg) and check_run_dir(cfg, "auto") is None
    with pytest.raises(ValueError, match="holds another run that has no checkpoint"):
        check_run_dir(cfg, None)  # a plain start still refuses it: only auto is the job's retry
    other = cfg.with_overrides({"train": {"steps": cfg.train.steps + 1}})
    assert not started_before(other)
    with pytest.raises(ValueError, match="holds another run that has no checkpoint.*--train.overwrite true"):
        check_run_dir(other, "auto")
    planned = cfg.with_overrides({"placement": "auto"})
    (out_dir / "config.json").write_text(  # as trainer.resolved_config writes it: the planner's choice
        planned.with_overrides({"placement": "manual", "tiers": {"params": "host"}, "prefetch": {"lookahead_groups": 5}})
        .to_json()
    )
    assert started_before(planned) and not started_before(cfg)
    for left in ("ckpt-000001", "model.safetensors"):  # a save or an export began: never started over
        (out_dir / left).mkdir() if left.startswith("ckpt") else (out_dir / left).write_text("")
        assert not started_before(planned)
        run_dir.remove_entries(out_dir, [left])
    (out_dir / "config.json").write_text("{not json")
    assert not started_before(planned)


def test_config_json_holds_the_path_settings_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """out_dir/config.json kept relative path settings as given: `offload-train --config run/config.json`
    from another directory read another corpus (or none), swapped and wrote elsewhere. They are written
    absolute, as they meant in the directory the run started in; --resume auto still counts the file as
    this run's first start, in that form or in the relative one an earlier version wrote."""
    from offload_trainer.app.run_checks import started_before

    monkeypatch.chdir(tmp_path)
    cfg = RunConfig().with_overrides(
        {"train": {"out_dir": "run"}, "data": {"path": "corpus"}, "tiers": {"nvme_dir": "swap"}}
    )
    trainer = Trainer(cfg, resume="auto")
    try:
        trainer._prepare_out_dir(cfg, None, None)
    finally:
        trainer.out_dir_lock.release()
    written = (tmp_path / "run" / "config.json").read_text()
    saved = json.loads(written)
    assert (saved["train"]["out_dir"], saved["data"]["path"], saved["tiers"]["nvme_dir"]) == (
        str(tmp_path / "run"), str(tmp_path / "corpus"), str(tmp_path / "swap")
    )
    assert started_before(cfg)
    (tmp_path / "run" / "config.json").write_text(cfg.to_json())  # as an earlier version wrote it
    assert started_before(cfg)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (tmp_path / "run" / "config.json").write_text(written)
    read_back = RunConfig.from_file(tmp_path / "run" / "config.json")
    assert read_back.data.path == str(tmp_path / "corpus") and read_back.train.out_dir == str(tmp_path / "run")


def test_a_checkpoint_in_place_before_the_first_latest_is_resumed(tmp_path: Path) -> None:
    """Killed (or refused `latest` by a full disk) between its first checkpoint's rename and `latest`'s
    first write, a run left ckpt-000002 complete and no `latest`: --resume auto and --resume latest
    refused the directory ("no latest file ... names a complete checkpoint"), so a preemptible job's
    retries failed for good. With no `latest` at all the newest complete checkpoint is resumed; a
    `latest` made to name none (a checkpoint being replaced) is refused as before."""
    from offload_trainer.app.run_checks import check_run_dir
    from offload_trainer.app.run_config import RunConfig

    out_dir = tmp_path / "run"
    cfg = RunConfig().with_overrides({"train": {"out_dir": str(out_dir)}})
    for name in ("ckpt-000001", "ckpt-000002"):
        (out_dir / name).mkdir(parents=True)
        (out_dir / name / "manifest.json").write_text("{}")
    (out_dir / "ckpt-000003").mkdir()  # no manifest: a save under way or interrupted
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert run_dir.latest_checkpoint(out_dir) == "ckpt-000002"
    assert check_run_dir(cfg, "auto") == check_run_dir(cfg, "latest") == out_dir / "ckpt-000002"
    (out_dir / "latest").write_text("")  # made to name none, as point_latest_nowhere does
    assert run_dir.latest_checkpoint(out_dir) is None
    with pytest.raises(ValueError, match="--resume latest: no latest file .* --resume ckpt-000002"):
        check_run_dir(cfg, "auto")
    (out_dir / "latest").unlink()
    (out_dir / run_dir.REPLACING).write_bytes(b"")  # an overwrite half done: nothing is offered
    assert run_dir.latest_checkpoint(out_dir) is None


@pytest.mark.parametrize(
    "steps, export, latest, kept",
    [
        (3, None, "ckpt-000002", []),  # export_dtype = none: the step-2 export would stay beside ckpt-000003
        (3, "adapter", "ckpt-000002", ["adapter"]),  # written again at the end: replaced as a whole then
        (2, None, "ckpt-000002", ["adapter", "model.safetensors"]),  # at train.steps already: the same weights
        (2, None, "ckpt-000004", []),  # an earlier checkpoint than `latest`: its weights are not the export's
    ],
)
def test_a_resumed_run_removes_the_exports_that_would_no_longer_match_its_weights(
    tmp_path: Path, steps: int, export: str, latest: str, kept: list
) -> None:
    run = tmp_path / "run"
    for name in ("ckpt-000002", "ckpt-000004"):
        (run / name).mkdir(parents=True)
        (run / name / "manifest.json").write_text("{}")
    run_dir.point_latest(run, latest)
    (run / "model.safetensors").write_bytes(b"old weights")
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"old adapters")
    cfg = RunConfig().with_overrides({"train": {"out_dir": str(run), "steps": steps}})
    trainer = Trainer(cfg)
    trainer.resumed_from = run / "ckpt-000002"
    trainer._prepare_out_dir(cfg, 2, export)
    assert sorted(n for n in run_dir.EXPORTS if (run / n).exists()) == kept
    assert not run_dir.temporaries(run)


@pytest.mark.parametrize(
    "resumed, latest",
    [("ckpt-000002", "ckpt-000002"), ("ckpt-000004", "ckpt-000004"), ("elsewhere", None), ("elsewhere-later", None)],
)
def test_a_run_resumed_from_before_latest_points_latest_back_before_it_cuts_the_metrics(
    tmp_path: Path, resumed: str, latest: str
) -> None:
    """Resumed from ckpt-000002 while `latest` names ckpt-000006: the metrics of steps 3-6 are cut, so
    `latest` names the resumed checkpoint from then on (nothing, when that one is in another directory),
    never the later one. It named ckpt-000006 until the first save: a run killed before that was
    continued by --resume latest or auto from ckpt-000006, metrics.jsonl without steps 3-6 for good.
    Resumed from another directory at a later step (ckpt-000008 there), `latest` went on naming this
    directory's ckpt-000006, and a kill before the first save had --resume auto continue that run."""
    run = tmp_path / "run"
    for name in ("ckpt-000002", "ckpt-000004", "ckpt-000006"):
        (run / name).mkdir(parents=True)
        (run / name / "manifest.json").write_text("{}")
    run_dir.point_latest(run, "ckpt-000006")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    cfg = RunConfig().with_overrides({"train": {"out_dir": str(run), "steps": 8}})
    trainer = Trainer(cfg)
    outside = {"elsewhere": "ckpt-000002", "elsewhere-later": "ckpt-000008"}
    trainer.resumed_from = tmp_path / "other" / outside[resumed] if resumed in outside else run / resumed
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "other": True}) + "\n" for s in range(1, 9)))
    trainer._prepare_out_dir(cfg, int(trainer.resumed_from.name[5:]), None)
    assert run_dir.latest_checkpoint(run) == latest
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Resumed from another directory, the rows up to the checkpoint are that run's (test_trainer), not out_dir's.
    last = int(trainer.resumed_from.name[5:]) if resumed in outside else min(int(trainer.resumed_from.name[5:]), 6)
    assert [r["step"] for r in rows] == list(range(1, last + 1))
    assert all(r.get("other", False) == (resumed in outside) for r in rows)
    assert sorted(run_dir.checkpoints(run)) == ["ckpt-000002", "ckpt-000004", "ckpt-000006"]  # none removed


@pytest.mark.parametrize("before", ["a run", "nothing"])
def test_a_run_resumed_from_another_directory_and_killed_before_its_first_save_is_named_by_resume_latest(
    tmp_path: Path, before: str
) -> None:
    """Resumed from other/ckpt-000002 into a directory holding another run (or nothing), then killed
    before its first save: `latest` was left empty (or missing), and --resume latest (and auto) named
    this directory's ckpt-000006, of the run replaced (its metrics gone: the rows are other's), as the
    way on (or started over from scratch). `latest` now keeps the path of the checkpoint the run
    continues, which --resume latest's refusal names; it is never followed unasked, and the first save
    names out_dir's own checkpoint again."""
    from offload_trainer.app.run_checks import check_run_dir

    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    if before == "a run":
        for name in ("ckpt-000004", "ckpt-000006"):
            (run / name).mkdir()
            (run / name / "manifest.json").write_text("{}")
        run_dir.point_latest(run, "ckpt-000006")
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    (other / "ckpt-000002").mkdir(parents=True)
    (other / "ckpt-000002" / "manifest.json").write_text("{}")
    (other / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 3)))
    cfg = RunConfig().with_overrides({"train": {"out_dir": str(run), "steps": 8}})
    trainer = Trainer(cfg)
    trainer.resumed_from = other / "ckpt-000002"
    trainer._prepare_out_dir(cfg, 2, None)  # then SIGKILL, before the first save
    for resume in ("latest", "auto"):
        with pytest.raises(ValueError, match=f"continues {other / 'ckpt-000002'} .*: resume it with --resume {other / 'ckpt-000002'}$"):
            check_run_dir(cfg, resume)
    assert run_dir.latest_checkpoint(run) is None and run_dir.latest_resumed_from(run) == other / "ckpt-000002"
    assert check_run_dir(cfg, str(other / "ckpt-000002")) == other / "ckpt-000002"
    run_dir.point_latest(run, "ckpt-000003")  # the first save
    assert run_dir.latest_resumed_from(run) is None
