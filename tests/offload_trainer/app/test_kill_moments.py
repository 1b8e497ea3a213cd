"""offload-train killed with SIGKILL at named moments resumes to the uninterrupted run, bit for bit.

test_trainer.py kills at random moments (timing); here the run kills itself at the Nth call of a
named function (KILL_AT="module:attr.path:N[:after]", set up by LAUNCHER before offload-train
starts; with KILL_RANK=r, only in rank r; KILL_SIGNAL=SIGTERM sends that instead of SIGKILL; or
KILL_CHANGE="module:attr.path:N": before the Nth file-system change made inside that function), so
each moment is hit on every machine: the optimizer's update pass running behind the
next forward with its states on NVMe, between micro-batches, a checkpoint renamed into place but
not yet named by `latest`, keep_last's deletion half done, a resume's own load, the first step
after a resume, the first checkpoint in place before `latest` is first written, a step before the
first checkpoint (retried with --resume auto), and the first step of a run gone back to an earlier checkpoint. After every kill each complete checkpoint still passes its checksums and equals
the uninterrupted run's of its step; the last resume ends with the same final checkpoint and the
same metrics.jsonl (loss, learning rate, gradient norm, eval loss of every step, each once).
A kill in the export at the end leaves nothing behind once the run resumes, and a kill before each
file-system change of a Hugging Face export leaves the previous export or the new one, never a mix.
A resume under placement = "auto" has the NVMe room its SIGKILLed attempt's swap files held.
Some of these moments again under a layer-major schedule, LoRA, SIGTERM and fp16 (SETTINGS).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from tests.command_lines import argv_with

REPO = Path(__file__).resolve().parents[3]
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40
STEPS = 6

LAUNCHER = r"""
import importlib, os, runpy, signal, sys, threading
from offload_trainer.app.launch import quiet_cpp_warnings
quiet_cpp_warnings()  # as offload-train's entry does, before the patching below imports torch
if os.environ.get("KILL_AT") and os.environ.get("KILL_RANK", os.environ.get("RANK")) == os.environ.get("RANK"):
    module, attr, n, *when = os.environ["KILL_AT"].split(":")
    n, after = int(n), when == ["after"]
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    original, calls, lock = getattr(owner, name), [0], threading.Lock()
    match = os.environ.get("KILL_MATCH")
    def die():
        open(os.environ["KILL_MARK"], "w").close()
        os.kill(os.getpid(), signal.Signals[os.environ.get("KILL_SIGNAL", "SIGKILL")])
    def counted(*args, **kwargs):
        if match and not any(match in str(a) for a in args):
            return original(*args, **kwargs)
        with lock:
            calls[0] += 1
            now = calls[0] == n
        if now and not after:
            die()
        result = original(*args, **kwargs)
        if now:
            die()
        return result
    setattr(owner, name, counted)
if os.environ.get("KILL_CHANGE"):  # before the Nth file-system change made inside the named function
    module, attr, n = os.environ["KILL_CHANGE"].split(":")
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    original, state = getattr(owner, name), {"inside": False, "changes": 0, "dying": False}
    CHANGES = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.symlink", "os.truncate"}
    def changes(event, args):
        if event == "open":
            mode, flags = args[1], args[2]
            if isinstance(mode, str):
                return any(c in mode for c in "wax+")
            return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        return event in CHANGES
    def hook(event, args):
        if state["inside"] and not state["dying"] and changes(event, args):
            state["changes"] += 1
            if state["changes"] == int(n):
                state["dying"] = True
                open(os.environ["KILL_MARK"], "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
    def inside(*args, **kwargs):
        state["inside"] = True
        try:
            return original(*args, **kwargs)
        finally:
            state["inside"] = False
    setattr(owner, name, inside)
    sys.addaudithook(hook)
sys.argv = ["offload_trainer", *sys.argv[1:]]
runpy.run_module("offload_trainer", run_name="__main__", alter_sys=True)
"""

OPTIMIZER = "offload_trainer.runtime.optimizer:StreamingOptimizer._update_chunk"
ENGINE = "offload_trainer.runtime.engine:Engine"
CHECKPOINT = "offload_trainer.runtime.persist.checkpoint"
Kill = Tuple[str, Optional[str]]
"""KILL_AT, and KILL_MATCH (count only calls with an argument whose text holds it) or None."""

MOMENTS: Dict[str, List[Kill]] = {
    # The tiny model has 5 groups: step 3's update pass (calls 11-15 with 2 micro-batches a step)
    # runs behind step 4's forward (checkpoint_every 2: no save waits for it). Then the resumed run
    # is killed in its first step's backward, between its micro-batches.
    "update_behind_forward_then_first_resumed_step": [(f"{OPTIMIZER}:13", None), (f"{ENGINE}.backward:1:after", None)],
    # Checkpoint 3 renamed into place, `latest` still naming 2: the resumed run saves step 3 again
    # over it. Then keep_last's deletion of a checkpoint half done (a file of it removed).
    "checkpoint_renamed_not_latest_then_half_deleted": [
        (f"{CHECKPOINT}:fsync_dir:6", None), ("os:unlink:2", "rank00000.bin"),
    ],
    # Between the micro-batches of step 4, then during the resume's load of checkpoint 2 (a group
    # half written into its homes), then mid-save of the next checkpoint.
    "between_micro_batches_then_in_the_load_then_mid_save": [
        (f"{ENGINE}.backward:7:after", None), (f"{CHECKPOINT}:_gather_range:4", None),
        ("offload_trainer.runtime.groups.homes:Home.read:3", None),
    ],
    # As the first run's swap directory is made (its lock file not yet in place: a directory too
    # young to judge, reclaimed as the next run's store closes), then right after step 3's row of
    # metrics.jsonl is appended (the resume from ckpt-000002 cuts it and logs step 3 again), then
    # mid-export of model.safetensors after the last save (the resume, at its last step, exports again).
    "swap_dir_made_then_after_a_metrics_row_then_mid_export": [
        ("os:rename:1", ".owner.lock.new"), ("offload_trainer.app.loggers:JsonlLogger.log:3:after", None),
        ("offload_trainer.runtime.persist.export:group_parameters:3", None),
    ],
}


def _corpus(root: Path) -> None:
    d = root / "corpus"
    d.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        (d / f"doc{i}.py").write_text(f"# document {i}\n" + TEXT)


def _args(root: Path, *extra: str) -> List[str]:
    return argv_with([
        "--model.preset", "tiny", "--data.path", str(root / "corpus"), "--data.seq_len", "32",
        "--data.batch_size", "4", "--grad_accum_steps", "2", "--train.steps", str(STEPS),
        "--train.eval_batches", "1", "--optimizer.schedule", "warmup_cosine", "--optimizer.warmup_steps", "2",
        "--optimizer.total_steps", str(STEPS), "--train.out_dir", str(root / "run"),
        "--tiers.nvme_dir", str(root / "swap"), "--no-progress",
    ], *extra)


def _launch(
    root: Path, extra: List[str], kill: Optional[Kill] = None, resume_from: Optional[str] = None,
    signal_name: str = "SIGKILL",
) -> subprocess.CompletedProcess:
    """offload-train into root/run, killed at `kill` (by `signal_name`); resumed from `resume_from` if
    given, else from latest when root/run has one."""
    env = {k: v for k, v in os.environ.items() if k not in ("KILL_AT", "KILL_MATCH", "KILL_SIGNAL")}
    env["KILL_MARK"] = str(root / "killed")
    env["KILL_SIGNAL"] = signal_name
    if kill is not None:
        env["KILL_AT"] = kill[0]
        if kill[1] is not None:
            env["KILL_MATCH"] = kill[1]
    resume = ["--resume", "latest"] if (root / "run" / "latest").exists() else []
    if resume_from is not None:
        resume = ["--resume", resume_from]
    return subprocess.run(
        [sys.executable, "-c", LAUNCHER, *_args(root, *extra, *resume)], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=300,
    )


def _records(checkpoint: Path) -> list:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    return [(r["group"], r["kind"], r["crc32"]) for part in manifest["ranks"] for r in part["records"]]


def _intact(checkpoint: Path) -> bool:
    """Every record of the checkpoint's rank files still matches its CRC32."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for part in manifest["ranks"]:
        data = (checkpoint / part["file"]).read_bytes()
        for r in part["records"]:
            nbytes = r["numel"] * (4 if r["dtype"] == "float32" else 2)
            if zlib.crc32(data[r["offset"] : r["offset"] + nbytes]) != r["crc32"]:
                return False
    return True


def _log(run: Path) -> List[dict]:
    keys = ("step", "loss", "lr", "grad_norm", "eval_loss", "nonfinite")
    return [{k: json.loads(line).get(k) for k in keys} for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("straight")
    _corpus(root)
    done = _launch(root, ["--train.checkpoint_every", "1", "--train.keep_last", "0"])
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "run"


@pytest.mark.slow  # 30-60 s each on 2 shared cores: three or four runs of offload-train
@pytest.mark.parametrize("moment", sorted(MOMENTS))
def test_a_kill_at_a_named_moment_resumes_bit_for_bit(tmp_path: Path, straight: Path, moment: str) -> None:
    every = "2" if moment.startswith("update_behind_forward") else "1"
    extra = ["--train.checkpoint_every", every, "--train.keep_last", "2"]
    _corpus(tmp_path)
    run = tmp_path / "run"
    for kill in MOMENTS[moment]:
        (tmp_path / "killed").unlink(missing_ok=True)
        died = _launch(tmp_path, extra, kill)
        assert (tmp_path / "killed").exists(), f"{kill} was never reached (exit {died.returncode}):\n{died.stderr[-2000:]}"
        for checkpoint in run.glob("ckpt-*"):
            if ".tmp-" in checkpoint.name:
                continue
            assert (checkpoint / "manifest.json").is_file(), f"after {kill}: {checkpoint.name} looks complete, is not"
            assert _intact(checkpoint), f"after {kill}: {checkpoint.name} fails its checksums"
            assert _records(checkpoint) == _records(straight / checkpoint.name), f"after {kill}: {checkpoint.name}"
        if not run_dir_checkpoints(run):  # killed before the first save (its swap directory made): nothing to name
            continue
        latest = (run / "latest").read_text()
        assert (run / latest / "manifest.json").is_file(), f"after {kill}: latest names {latest}"
    resumed = _launch(tmp_path, extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    name = f"ckpt-{STEPS:06d}"
    assert _records(run / name) == _records(straight / name)
    assert _log(run) == _log(straight)
    assert (run / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()
    assert not list(run.glob("*.tmp-*"))
    _assert_no_swap_dir_is_left(tmp_path / "swap")


def _assert_no_swap_dir_is_left(swap: Path) -> None:
    """No run left a swap directory, but one killed before its lock was in place: that one is judged only
    once UNLOCKED_GRACE_S old ([Note: Swap directory lifecycle] in io_engine/swap_dirs.py), and on a fast
    machine the runs after the kill all end sooner (9 s here, so it stayed, every time). It is aged past
    the grace here, and the next run's reclaim (as at a store's start or close) must remove it."""
    from io_engine.swap_dirs import LOCK_NAME, UNLOCKED_GRACE_S, reclaim_dead_swap_dirs

    leftovers = [d for d in swap.glob("offload-swap-*") if not (d / LOCK_NAME).exists()]
    past = time.time() - 2 * UNLOCKED_GRACE_S
    for d in leftovers:
        os.utime(d, (past, past))
    reclaim_dead_swap_dirs(str(swap))
    assert not list(swap.glob("offload-swap-*"))


SETTINGS: Dict[str, Tuple[List[str], List[Tuple[str, str]]]] = {
    # Layer-major steps: checkpoint 2 renamed into place, `latest` naming 1; then the resumed run's
    # first step, killed as it ends.
    "layer_major": (["--train.micro_batch_order", "layer_major"], [
        (f"{CHECKPOINT}:fsync_dir:4", "SIGKILL"), ("offload_trainer.app.layer_major_step:train_step_layer_major:1:after", "SIGKILL"),
    ]),
    # LoRA adapters (the base frozen, its states absent from the checkpoints): the same two moments.
    "lora": (["--lora.rank", "2", "--lora.target_modules", "q_proj,v_proj"], [
        (f"{CHECKPOINT}:fsync_dir:4", "SIGKILL"), (f"{ENGINE}.backward:1:after", "SIGKILL"),
    ]),
    # SIGTERM (a scheduler's stop) while step 3's update pass runs in the background, then mid-save.
    "sigterm": ([], [(f"{OPTIMIZER}:13", "SIGTERM"), ("offload_trainer.runtime.groups.homes:Home.read:3", "SIGTERM")]),
    # fp16 with its loss scale: an update pass, then between micro-batches.
    "fp16": (["--precision.compute_dtype", "fp16"], [(f"{OPTIMIZER}:7", "SIGKILL"), (f"{ENGINE}.backward:3:after", "SIGKILL")]),
}


@pytest.mark.slow  # 40-90 s each on 2 shared cores: four runs of offload-train
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_a_kill_under_other_settings_resumes_bit_for_bit(tmp_path_factory, setting: str) -> None:
    """As test_a_kill_at_a_named_moment_resumes_bit_for_bit, under a layer-major schedule, LoRA, SIGTERM
    instead of SIGKILL and fp16: against an uninterrupted run of the same setting."""
    if setting == "lora":
        pytest.importorskip("peft")
    settings, kills = SETTINGS[setting]
    straight, killed = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("killed")
    for root in (straight, killed):
        _corpus(root)
    done = _launch(straight, ["--train.checkpoint_every", "1", "--train.keep_last", "0", *settings])
    assert done.returncode == 0, done.stderr[-3000:]
    extra, run = ["--train.checkpoint_every", "1", "--train.keep_last", "2", *settings], killed / "run"
    for at, signal_name in kills:
        (killed / "killed").unlink(missing_ok=True)
        died = _launch(killed, extra, (at, None), signal_name=signal_name)
        assert (killed / "killed").exists(), f"{at} was never reached (exit {died.returncode}):\n{died.stderr[-2000:]}"
        for checkpoint in (c for c in run.glob("ckpt-*") if ".tmp-" not in c.name):
            assert _intact(checkpoint) and _records(checkpoint) == _records(straight / "run" / checkpoint.name), checkpoint
    resumed = _launch(killed, extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    name = f"ckpt-{STEPS:06d}"
    assert _records(run / name) == _records(straight / "run" / name) and _log(run) == _log(straight / "run")
    assert (run / "model.safetensors").read_bytes() == (straight / "run" / "model.safetensors").read_bytes()
    assert not list(run.glob("*.tmp-*")) and not list((killed / "swap").glob("offload-swap-*"))


@pytest.mark.slow  # two runs of offload-train; test_run_dir.py covers the mechanism by default
def test_a_kill_between_the_first_checkpoint_and_latest_resumes_with_resume_auto(tmp_path: Path, straight: Path) -> None:
    """SIGKILL once the first checkpoint is renamed into place, before `latest` is first written: the
    retry with --resume auto (a preemptible job's one command) refused the directory, naming the
    checkpoint; it now resumes from it and ends bitwise equal to the uninterrupted run."""
    _corpus(tmp_path)
    run, extra = tmp_path / "run", ["--train.checkpoint_every", "1", "--train.keep_last", "2"]
    died = _launch(tmp_path, extra, (f"{CHECKPOINT}:fsync_dir:2", None), resume_from="auto")
    assert (tmp_path / "killed").exists(), f"the kill never came (exit {died.returncode}):\n{died.stderr[-2000:]}"
    assert (run / "ckpt-000001" / "manifest.json").is_file() and not (run / "latest").exists()
    resumed = _launch(tmp_path, extra, resume_from="auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from ckpt-000001" in resumed.stdout, resumed.stdout[-2000:]
    name = f"ckpt-{STEPS:06d}"
    assert _records(run / name) == _records(straight / name) and _log(run) == _log(straight)
    assert not list(run.glob("*.tmp-*"))


@pytest.mark.slow  # two runs of offload-train; test_run_dir.py covers the mechanism by default
def test_a_kill_before_the_first_checkpoint_starts_over_with_resume_auto(tmp_path: Path, straight: Path) -> None:
    """SIGKILL in step 2, before the first save (checkpoint_every 2): out_dir held config.json and step 1's
    metrics, and the retry with --resume auto (a preemptible job's one command) was refused as another
    run's on every attempt. It now starts over and ends bitwise equal to the uninterrupted run."""
    _corpus(tmp_path)
    run, extra = tmp_path / "run", ["--train.checkpoint_every", "2", "--train.keep_last", "2"]
    died = _launch(tmp_path, extra, (f"{ENGINE}.backward:3:after", None), resume_from="auto")
    assert (tmp_path / "killed").exists(), f"the kill never came (exit {died.returncode}):\n{died.stderr[-2000:]}"
    assert not run_dir_checkpoints(run) and [r["step"] for r in _log(run)] == [1]
    resumed = _launch(tmp_path, extra, resume_from="auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    name = f"ckpt-{STEPS:06d}"
    assert _records(run / name) == _records(straight / name) and _log(run) == _log(straight)
    assert not list(run.glob("*.tmp-*")) and not list((tmp_path / "swap").glob("offload-swap-*"))


def run_dir_checkpoints(run: Path) -> List[str]:
    return sorted(p.name for p in run.glob("ckpt-*"))


@pytest.mark.slow  # three runs of offload-train; test_run_dir.py covers the mechanism by default
def test_a_kill_after_going_back_to_an_earlier_checkpoint_resumes_from_that_one(tmp_path: Path, straight: Path) -> None:
    """A finished run resumed from its ckpt-000002 (going back: its metrics are cut to step 2) and killed
    in step 3, before its first save: `latest` named ckpt-000006 still, so --resume auto continued the
    run it had gone back from, at step 6, and metrics.jsonl kept steps 1-2 only, for good. Now it names
    ckpt-000002, and the resume ends with the uninterrupted run's checkpoint and metrics."""
    shutil.copytree(straight, tmp_path / "run")
    _corpus(tmp_path)
    run, extra = tmp_path / "run", ["--train.checkpoint_every", "1", "--train.keep_last", "0"]
    died = _launch(tmp_path, extra, (f"{ENGINE}.backward:1:after", None), resume_from=str(run / "ckpt-000002"))
    assert (tmp_path / "killed").exists(), f"the kill never came (exit {died.returncode}):\n{died.stderr[-2000:]}"
    assert (run / "latest").read_text() == "ckpt-000002" and [r["step"] for r in _log(run)] == [1, 2]
    resumed = _launch(tmp_path, extra, resume_from="auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from ckpt-000002" in resumed.stdout, resumed.stdout[-2000:]
    name = f"ckpt-{STEPS:06d}"
    assert _records(run / name) == _records(straight / name) and _log(run) == _log(straight)
    assert not list(run.glob("*.tmp-*"))


@pytest.mark.slow  # two runs of offload-train; test_run_dir.py covers the mechanism by default
def test_a_kill_in_the_export_leaves_nothing_behind_once_the_run_resumes(tmp_path: Path) -> None:
    """A SIGKILL while the adapters' weights are written (into the new out_dir/adapter beside its name):
    the resumed run (at its last step already) exports again, and the killed export's temporary is gone."""
    pytest.importorskip("peft")
    _corpus(tmp_path)
    lora = ["--lora.rank", "2", "--lora.target_modules", "q_proj,v_proj", "--lora.export", "adapter",
            "--train.checkpoint_every", "1", "--train.keep_last", "1"]
    died = _launch(tmp_path, lora, ("offload_trainer.runtime.persist.export:group_parameters:2", None))
    assert (tmp_path / "killed").exists(), died.stderr[-2000:]
    run = tmp_path / "run"
    assert list(run.glob("adapter.tmp-*/adapter_model.safetensors.tmp-*")), "the kill was not mid-export"
    assert not (run / "adapter").exists(), "a first export killed part-way left a directory that looks like one"
    resumed = _launch(tmp_path, lora)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert [str(p.relative_to(run)) for p in run.rglob("*.tmp-*")] == []


def _tiny_llama(path: Path) -> None:
    """A tiny Hugging Face Llama with a tokenizer (built from a config: no download)."""
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    chars = sorted(set(TEXT + "0123456789#"))
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(path)


def _hf_launch(root: Path, model: Path, steps: int, dtype: str, kill_at: int = 0) -> subprocess.CompletedProcess:
    """offload-train of the tiny Llama into root/run up to `steps`, exporting in `dtype`, resumed when
    root/run has a checkpoint; killed before the kill_at-th file-system change of the export (0: never)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KILL_AT", "KILL_MATCH", "KILL_CHANGE")}
    env["KILL_MARK"] = str(root / "killed")
    if kill_at:
        env["KILL_CHANGE"] = f"offload_trainer.app.causal_lm:CausalLM.export:{kill_at}"
    resume = ["--resume", "latest"] if (root / "run" / "latest").exists() else []
    argv = [
        "--model.hf_path", str(model), "--data.path", str(root / "corpus"), "--data.seq_len", "32",
        "--data.batch_size", "4", "--train.steps", str(steps), "--train.checkpoint_every", "1",
        "--train.keep_last", "1", "--train.eval_batches", "1", "--train.export_dtype", dtype,
        "--train.out_dir", str(root / "run"), "--tiers.nvme_dir", str(root / "swap"), "--no-progress", *resume,
    ]
    return subprocess.run(
        [sys.executable, "-c", LAUNCHER, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )


def _files(directory: Path) -> Optional[Dict[str, bytes]]:
    """Every file under `directory` with its bytes; None if nothing is there."""
    if not os.path.lexists(directory):
        return None
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow  # one run of offload-train per file-system change of the export (62 with transformers 5): 15-40 min
def test_a_kill_at_each_change_of_an_hf_export_leaves_the_old_export_or_the_new(tmp_path: Path) -> None:
    """A finished run (2 steps, exported in fp32) continued to 3 steps and exported in bf16, killed
    before the 1st file-system change of that export, its resume killed before the 2nd, and so on
    (chained kills, each resume of a killed run killed later in its export) until a run finishes:
    out_dir/hf is always the fp32 export or the bf16 one, whole (written file by file into hf/, a
    kill left bf16's config.json beside fp32's weights, which loaded as bf16). The run that finishes
    ends with the uninterrupted run's export, last checkpoint and metrics.jsonl, bitwise, and no
    temporary is left."""
    model = tmp_path / "llama"
    _tiny_llama(model)
    template = tmp_path / "template"
    _corpus(template)
    first = _hf_launch(template, model, 2, "fp32")
    assert first.returncode == 0, first.stderr[-3000:]
    old = _files(template / "run" / "hf")
    for name in ("straight", "killed"):
        shutil.copytree(template, tmp_path / name, ignore=shutil.ignore_patterns("swap"))
    straight, run = tmp_path / "straight" / "run", tmp_path / "killed" / "run"
    done = _hf_launch(straight.parent, model, 3, "bf16")
    assert done.returncode == 0, done.stderr[-3000:]
    new = _files(straight / "hf")
    assert new != old and set(new) == set(old)
    for n in range(1, 200):
        (run.parent / "killed").unlink(missing_ok=True)
        died = _hf_launch(run.parent, model, 3, "bf16", kill_at=n)
        if not (run.parent / "killed").exists():
            assert died.returncode == 0, died.stderr[-3000:]
            break  # the export made fewer than n changes: every moment was tried
        assert _files(run / "hf") in (old, new), f"killed before change {n}: hf/ is neither export whole"
        assert (run / "latest").read_text() == "ckpt-000003"
    assert n > 5, "the export made almost no file-system change: the sweep tried nothing"
    assert _files(run / "hf") == new
    assert _records(run / "ckpt-000003") == _records(straight / "ckpt-000003")
    assert _log(run) == _log(straight)
    assert [str(p.relative_to(run)) for p in run.rglob("*.tmp-*")] == []


@pytest.mark.slow  # two runs of offload-train; test_checkpoint.py injects the full disk by default
def test_a_disk_that_fills_mid_checkpoint_ends_with_one_line_and_the_run_resumes_bit_for_bit(
    tmp_path: Path, straight: Path
) -> None:
    """out_dir on a tmpfs that holds two checkpoints and a half: the third save fails with ENOSPC. The
    run ends with exit 2 and one line naming the file, the offset and the size of the write refused
    (it named the checkpoint's directory only); `latest` names the last good checkpoint, which passes
    its checksums, and no temporary is left. Once the disk has room, the resume ends bitwise equal to
    the uninterrupted run."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    _corpus(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    one = sum(p.stat().st_size for p in (straight / "ckpt-000001").iterdir())
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={one * 5 // 2}", "tmpfs", str(run)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        extra = ["--train.checkpoint_every", "1", "--train.keep_last", "0"]
        full = _launch(tmp_path, extra)
        lines = full.stderr.strip().splitlines()
        assert full.returncode == 2 and len(lines) == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
        assert f"in {run}/ckpt-000003/rank00000.bin failed: No space left on device" in lines[0], lines[0]
        assert " bytes at offset " in lines[0] and "train.out_dir" in lines[0], lines[0]
        assert (run / "latest").read_text() == "ckpt-000002" and _intact(run / "ckpt-000002")
        assert not list(run.glob("*.tmp-*")) and not (run / "ckpt-000003").exists()
        subprocess.run(["mount", "-o", "remount,size=64m", str(run)], check=True)  # room made
        resumed = _launch(tmp_path, extra)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        name = f"ckpt-{STEPS:06d}"
        assert _records(run / name) == _records(straight / name) and _log(run) == _log(straight)
        assert (run / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()
    finally:
        subprocess.run(["umount", str(run)])


@pytest.mark.slow  # two runs of offload-train that plan their placement; test_planner.py covers the room by default
def test_a_resume_under_auto_placement_has_the_room_its_killed_attempt_held(
    tmp_path: Path, straight: Path, monkeypatch
) -> None:
    """tiers.nvme_dir on a tmpfs that holds one run's swap files, placement = "auto": SIGKILLed in step 3,
    the run left its swap directory, and the resume's planner counted it as used and refused ("free 1.86
    MiB more under .../swap"), leaving it there for good. The resume now reclaims it, says so, and ends
    bitwise equal to the uninterrupted run (whatever the placement chosen)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    _corpus(tmp_path)
    swap = tmp_path / "swap"
    swap.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(swap)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    monkeypatch.setenv("OFFLOAD_TRAINER_CACHE", str(tmp_path / "machine.json"))  # measured here, not the user's
    try:
        extra = ["--placement", "auto", "--tiers.host_budget_bytes", "2MiB",
                 "--train.checkpoint_every", "1", "--train.keep_last", "2"]
        died = _launch(tmp_path, extra, (f"{ENGINE}.backward:5:after", None))
        assert (tmp_path / "killed").exists(), f"the kill never came (exit {died.returncode}):\n{died.stderr[-2000:]}"
        assert len(list(swap.glob("offload-swap-*"))) == 1
        resumed = _launch(tmp_path, extra)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"removed 1 swap directories of dead runs in {swap}" in resumed.stderr, resumed.stderr[-2000:]
        run, name = tmp_path / "run", f"ckpt-{STEPS:06d}"
        assert _records(run / name) == _records(straight / name) and _log(run) == _log(straight)
        assert (run / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()
        assert not list(swap.glob("offload-swap-*"))
    finally:
        subprocess.run(["umount", str(swap)])
