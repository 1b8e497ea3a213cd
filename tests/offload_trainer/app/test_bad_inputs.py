"""A table of bad inputs, each run through the real command line: offload-train, offload-plan and the
three scripts, called as main(argv) in this process (so the table stays fast; the commands take no
state from one call to the next).

For every row: exit status 2, exactly one line on stderr (progress bars off), no traceback, every
file that was in the case's directories before byte-for-byte unchanged after, nothing new in the
run's out_dir (unless the row says the run got as far as writing), and no swap directory or
temporary file left. One short run, made once, gives the checkpoints that rows copy and break.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest

from tests.command_lines import argv_with

from offload_trainer.app import cli, plan_cli
from offload_trainer.app.bench import bench_io, bench_offload, many_layers, tune_prefetch

COMMANDS: Dict[str, Callable[[List[str]], int]] = {
    "train": cli.main,
    "plan": plan_cli.main,
    "bench_io": bench_io.main,
    "bench_offload": bench_offload.main,
    "tune": tune_prefetch.main,
    "many_layers": many_layers.main,
}
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}

BERT = {"model_type": "bert", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
        "intermediate_size": 64}


@dataclass
class Env:
    """One case's directories: a copy of the prepared run, a corpus, a swap dir, scratch space."""

    root: Path

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def corpus(self) -> Path:
        return self.root / "corpus"

    @property
    def swap(self) -> Path:
        return self.root / "swap"

    @property
    def ckpt(self) -> Path:
        return self.run / "ckpt-000002"

    def train(self, *extra: str, out: Optional[Path] = None, corpus: Optional[Path] = None) -> List[str]:
        """A fresh run into `out` (default: out/, which does not exist yet); the tiny preset unless `extra`
        names a Hugging Face model (both are refused)."""
        model = [] if "--model.hf_path" in extra else ["--model.preset", "tiny"]
        return argv_with([
            *model, "--data.path", str(corpus or self.corpus), "--data.seq_len", "32",
            "--data.batch_size", "4", "--train.steps", "3", "--train.checkpoint_every", "1",
            "--train.eval_batches", "1", "--train.out_dir", str(out or self.root / "out"),
            "--tiers.nvme_dir", str(self.swap),
            "--no-progress",
        ], *extra)

    def resume(self, *extra: str) -> List[str]:
        """The prepared run, resumed from its latest checkpoint (ckpt-000002)."""
        return self.train("--resume", "latest", *extra, out=self.run)

    def file(self, name: str, text: str = "x") -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def fifo(self, name: str) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        return path

    def hf(self, config: object = LLAMA, weights: Optional[bytes] = None, raw_config: Optional[str] = None) -> Path:
        path = self.root / "hf"
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(raw_config if raw_config is not None else json.dumps(config))
        if weights is None:
            weights = safetensors_bytes({"w": [0.0, 1.0]})
        (path / "model.safetensors").write_bytes(weights)
        return path


def safetensors_bytes(
    tensors: Dict[str, List[float]], dtype: str = "F32", shapes: Optional[Dict[str, List[int]]] = None
) -> bytes:
    header, data = {}, b""
    for name, values in tensors.items():
        raw = struct.pack(f"<{len(values)}{ {'F32': 'f', 'I32': 'i'}[dtype] }", *values)
        header[name] = {"dtype": dtype, "shape": (shapes or {}).get(name, [len(values)]), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


def raw_safetensors(header: str, data: bytes) -> bytes:
    """A safetensors file of exactly this header text (which the format's reader parses itself) and data."""
    return struct.pack("<Q", len(header.encode())) + header.encode() + data


TWO_F32 = '{"dtype": "F32", "shape": [2], "data_offsets": '
DEEP = "[" * 100_000 + "]" * 100_000
"""JSON nested past Python's recursion limit."""


def edit_manifest(env: Env, change: Callable[[dict], None], sign: bool = True) -> None:
    from offload_trainer.runtime.persist import checkpoint

    path = env.ckpt / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    if sign:
        manifest["checksum"] = checkpoint._manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))


def flip_byte(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def can_mount(path: Path, options: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
    return subprocess.run(mount, capture_output=True).returncode == 0


def read_only_dir(env: Env, name: str) -> Optional[Path]:
    """An empty directory on a read-only file system (a tmpfs mounted so): root only, so a user's
    machine skips the rows using it and makes the permission rows instead."""
    path = env.root / name
    return path if can_mount(path, "ro,size=64k") else None


def unpermitted_dir(env: Env, name: str) -> Optional[Path]:
    """An empty directory whose mode (0o555) forbids writing: a user only, as root writes there anyway."""
    if os.geteuid() == 0:
        return None
    path = env.root / name
    path.mkdir()
    path.chmod(0o555)
    return path


@dataclass
class Case:
    id: str
    command: str
    argv: Callable[[Env], Optional[List[str]]]
    """The command line; None: this machine cannot make the case (it is skipped)."""
    message: str
    """Text the one line must hold."""
    out_dir_written: bool = False
    """The run got as far as preparing its out_dir (which held nothing before)."""


def corpus_with(env: Env, **files: str) -> Path:
    d = env.root / "corpus2"
    d.mkdir()
    for name, text in files.items():
        (d / name.replace("_", ".")).write_text(text)
    return d


def _in_corpus_fifo(env: Env) -> List[str]:
    d = corpus_with(env, a_py=TEXT)
    os.mkfifo(d / "b.txt")
    return env.train(corpus=d)


def _dangling_in_corpus(env: Env) -> List[str]:
    d = corpus_with(env, a_py=TEXT)
    os.symlink(env.root / "missing.py", d / "b.py")
    return env.train(corpus=d)


def _planted(env: Env, name: str) -> List[str]:
    target = env.root / "elsewhere.txt"
    target.write_text("not yours")
    (env.run / name).unlink()
    os.symlink(target, env.run / name)
    return env.resume("--train.steps", "3")


def _directory_at(env: Env, name: str) -> List[str]:
    (env.run / name).unlink(missing_ok=True)
    (env.run / name).mkdir()
    (env.run / name / "keep").write_text("the user's")
    return env.resume("--train.steps", "3")


def _file_at(env: Env, name: str) -> List[str]:
    (env.run / name).write_text("the user's")
    return env.resume("--train.steps", "3")


def _latest_names(env: Env, absolute: bool) -> List[str]:
    """`latest` naming a checkpoint outside out_dir (a path, not a name) was followed there."""
    other = env.root / "other" / "ckpt-000001"
    shutil.copytree(env.run / "ckpt-000001", other)
    (env.run / "latest").write_text(str(other) if absolute else "../other/ckpt-000001")
    return env.resume("--train.steps", "3")


def _full_disk(env: Env) -> Optional[List[str]]:
    out = env.root / "small"
    if not can_mount(out, "size=512k"):
        return None
    return env.train("--train.steps", "1", out=out)


def _dev_full(env: Env) -> List[str]:
    """A write of the checkpoint fails with ENOSPC (its shard file is /dev/full)."""
    from offload_trainer.runtime.persist import checkpoint

    real = checkpoint.open_exclusive

    def full(path: object, mode: int = 0o666) -> int:
        if str(path).endswith(".bin"):
            return os.open("/dev/full", os.O_WRONLY)
        return real(path, mode)

    env.monkeypatch.setattr(checkpoint, "open_exclusive", full)  # type: ignore[attr-defined]
    return env.train("--train.steps", "1")


def _tied_config_untied_weights(env: Env) -> List[str]:
    """A config that ties the embeddings, over files holding two different tensors for them."""
    config = {**LLAMA, "num_hidden_layers": 0, "tie_word_embeddings": True}
    weights = {"model.norm.weight": [1.0] * 32, "model.embed_tokens.weight": [0.5] * 300 * 32,
               "lm_head.weight": [0.25] * 300 * 32}
    shapes = {"model.embed_tokens.weight": [300, 32], "lm_head.weight": [300, 32]}
    return env.train("--model.hf_path", str(env.hf(config=config, weights=safetensors_bytes(weights, shapes=shapes))))


def _no_memory(env: Env) -> List[str]:
    """The host arena cannot be mapped (ENOMEM: a placement that keeps more in memory than the machine has)."""
    from offload_trainer.runtime.groups import tiers

    def arena(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    env.monkeypatch.setattr(tiers, "HostArena", arena)  # type: ignore[attr-defined]
    return env.train()


def _launched_with(env: Env, **variables: Optional[str]) -> List[str]:
    """A run under torchrun's environment variables, as a launcher or a user's shell left them."""
    for name, value in variables.items():
        if value is None:
            env.monkeypatch.delenv(name, raising=False)  # type: ignore[attr-defined]
        else:
            env.monkeypatch.setenv(name, value)  # type: ignore[attr-defined]
    return env.train()


T = "train"
CASES: List[Case] = [
    # -- flags and overrides ------------------------------------------------------------------
    Case("prefix-resume", T, lambda e: e.train("--resum", "latest"), "did you mean --resume?"),
    Case("prefix-config", T, lambda e: e.train("--conf", "x.toml"), "did you mean --config?"),
    Case("prefix-override", T, lambda e: e.train("--train.step", "3"), "train.step"),
    Case("prefix-json", T, lambda e: e.train("--js"), "did you mean --json?"),
    # a field without its section is no misspelt flag (--lr was "did you mean --help?"): say its section
    Case("lr-without-section", T, lambda e: e.train("--lr", "3e-4"), "belongs at [optimizer] (optimizer.lr)"),
    Case("steps-without-section", T, lambda e: e.train("--steps", "5"), "belongs at [train] (train.steps)"),
    Case("misspelt-section", T, lambda e: e.train("--optimzer.lr", "0.1"), "optimzer"),
    # an unknown flag is named as typed (it was "unknown key 'traing' ... at the top level of the config")
    Case("unknown-flag-misspelt-section", T, lambda e: e.train("--traing.steps", "5"),
         "unknown flag --traing.steps: steps belongs at [train] (train.steps); write --train.steps"),
    Case("unknown-flag-nothing-close", T, lambda e: e.train("--foo.bar", "1"), "unknown flag --foo.bar: no config field"),
    Case("unknown-flag-dashes", T, lambda e: e.train("--train-step", "1"), "unknown flag --train-step; did you mean --train.steps?"),
    Case("lr-not-a-number", T, lambda e: e.train("--optimizer.lr", "fast"), "optimizer.lr"),
    Case("lr-negative", T, lambda e: e.train("--optimizer.lr", "-1"), "optimizer.lr"),
    Case("update-chunk-zero", T, lambda e: e.train("--optimizer.update_chunk_bytes", "0"), "optimizer.update_chunk_bytes=0"),
    Case("adamw-eps-zero", T, lambda e: e.train("--optimizer.eps", "0"), "optimizer.eps=0.0"),
    Case("trace-step-past-the-run", T, lambda e: e.train("--train.trace_step", "100"), "train.trace_step=100"),
    Case("steps-zero", T, lambda e: e.train("--train.steps", "0"), "train.steps"),
    # both trained on without a word: nothing at all, or the run's tail at the schedule's floor
    Case("lr-zero", T, lambda e: e.train("--optimizer.lr", "0"), "optimizer.lr=0 trains nothing"),
    Case("cosine-shorter-than-the-run", T,
         lambda e: e.train("--optimizer.schedule", "warmup_cosine", "--optimizer.total_steps", "2"),
         "optimizer.total_steps=2 is shorter than train.steps=3"),
    Case("cosine-shorter-than-a-resumed-run", T,
         lambda e: e.resume("--optimizer.schedule", "warmup_cosine", "--optimizer.total_steps", "3", "--train.steps", "5"),
         "set optimizer.total_steps 5"),
    # the last --config won without a word
    Case("config-twice", T, lambda e: e.train("--config", str(e.file("a.toml", "")), "--config", str(e.file("b.toml", ""))),
         "--config: is given twice"),
    # a repeated override: the last one won without a word (the flag helpers above merge, these do not)
    Case("override-twice", T, lambda e: e.train("--optimizer.lr", "1e-3", "--optimizer.lr=2e-3"),
         "--optimizer.lr is given twice ('1e-3', then '2e-3'): give it once"),
    Case("override-twice-dashes", T, lambda e: e.train("--optimizer.weight_decay", "0", "--optimizer.weight-decay", "1"),
         "--optimizer.weight-decay is given twice ('0', then '1')"),
    Case("override-list-nested-deep", T, lambda e: e.train("--optimizer.betas", DEEP),
         "is not a JSON list (arrays or objects nested too deeply to read"),
    Case("override-placement-nested-deep", T, lambda e: e.train("--tiers.params", '{"host": ' + DEEP + "}"),
         "is not valid JSON (arrays or objects nested too deeply to read"),
    Case("override-without-value", T, lambda e: e.train("--train.steps"), "needs a value"),
    Case("stray-argument", T, lambda e: e.train("stray"), "unexpected argument 'stray'"),
    Case("batch-zero", T, lambda e: e.train("--data.batch_size", "0"), "data.batch_size"),
    Case("seq-len-past-model", T, lambda e: e.train("--data.seq_len", "100000"), "max_seq_len=256"),
    Case("threads-huge", T, lambda e: e.train("--train.num_threads", "100000"), "train.num_threads=100000"),
    Case("threads-zero", T, lambda e: e.train("--train.num_threads", "0"), "train.num_threads"),
    Case("io-block-1tib", T, lambda e: e.train("--io.block_bytes", "1TiB"), "io.block_bytes"),
    Case("io-threads-huge", T, lambda e: e.train("--io.num_threads", "5000", "--io.queue_depth", "5000"),
         "io.num_threads=5000"),
    Case("io-block-unaligned", T, lambda e: e.train("--io.block_bytes", "1000"), "block_bytes"),
    Case("io-block-over-host-budget", T, lambda e: e.train("--tiers.host_budget_bytes", "64KiB"),
         "tiers.host_budget_bytes"),
    # one step ran 100000 micro-batches over the same few hundred sequences, for minutes without a line
    Case("grad-accum-past-the-data", T, lambda e: e.train("--grad_accum_steps", "100000"),
         "one optimizer step takes data.batch_size=4 x grad_accum_steps=100000 = 400000 sequences, but the corpus "
         "gives "),
    Case("batch-past-the-data", T, lambda e: e.train("--data.batch_size", "4000"), "lower data.batch_size to at most"),
    Case("batch-1e9", T, lambda e: e.train("--data.batch_size", "1000000000"), "memory available"),
    Case("out-dir-empty", T, lambda e: e.train("--train.out_dir", ""), "train.out_dir=''"),
    Case("data-path-empty", T, lambda e: e.train("--data.path", ""), "data.path=''"),
    # the preset was ignored without a word
    # the planner homed the parameters on the host, where the flag said nvme, without a word
    Case("placement-flag-under-auto", T, lambda e: e.train("--placement", "auto", "--tiers.params", "nvme"),
         "--tiers.params nvme is replaced by the planner under placement='auto'"),
    Case("plan-lookahead-flag-under-auto", "plan",
         lambda e: ["--model.preset", "tiny", "--placement", "auto", "--prefetch.lookahead_groups", "4", "--no-measure"],
         "--prefetch.lookahead_groups 4 is replaced by the planner"),
    Case("preset-and-hf-path", T, lambda e: e.train("--model.hf_path", str(e.hf()), "--model.preset", "tiny"),
         "--model.preset tiny and model.hf_path="),
    Case("hf-path-empty", T, lambda e: e.train("--model.hf_path", ""), "model.hf_path=''"),
    Case("nvme-dir-empty", T, lambda e: e.train("--tiers.nvme_dir", ""), "tiers.nvme_dir"),
    Case("export-dtype", T, lambda e: e.train("--train.export_dtype", "fp8"), "train.export_dtype"),
    Case("on-nonfinite", T, lambda e: e.train("--train.on_nonfinite", "maybe"), "train.on_nonfinite"),
    Case("dist-timeout-zero", T, lambda e: e.train("--train.dist_timeout_s", "0"), "train.dist_timeout_s"),
    Case("unknown-preset", T, lambda e: e.train("--model.preset", "3b"), "model.preset"),
    Case("compute-dtype", T, lambda e: e.train("--precision.compute_dtype", "fp64"), "precision.compute_dtype"),
    Case("placement-tier", T, lambda e: e.train("--tiers.params", "disk"), "disk"),
    Case("checkpoint-every", T, lambda e: e.train("--train.checkpoint_every", "-1"), "train.checkpoint_every"),
    Case("eval-fraction", T, lambda e: e.train("--data.eval_fraction", "1.5"), "data.eval_fraction"),
    Case("overwrite-and-resume", T, lambda e: e.resume("--train.overwrite", "true"), "drop one of them"),
    # -- the run directory ----------------------------------------------------------------------
    Case("fresh-run-over-a-run", T, lambda e: e.train(out=e.run), "--train.overwrite true"),
    Case("resume-missing-checkpoint", T, lambda e: e.train("--resume", str(e.root / "nope")), "nope does not exist"),
    Case("resume-missing-name", T, lambda e: e.train("--resume", "ckpt-000099", out=e.run), "the checkpoints in"),
    Case("resume-empty", T, lambda e: e.train("--resume", ""), "empty"),
    Case("resume-latest-names-nothing", T,
         lambda e: (e.run.joinpath("latest").write_text("ckpt-000099"), e.resume())[1], "complete checkpoint"),
    Case("resume-without-checkpoint", T, lambda e: e.train("--resume", "latest"), "no checkpoint yet"),
    # `latest` taken away while the checkpoint it named was replaced, and the run killed: the others are named.
    Case("resume-latest-removed", T,
         lambda e: (e.run.joinpath("latest").write_text(""), e.resume())[1], "--resume ckpt-000002"),
    Case("resume-dir-without-manifest", T,
         lambda e: ((e.root / "empty").mkdir(), e.train("--resume", str(e.root / "empty")))[1], "no manifest.json"),
    Case("planted-metrics-symlink", T, lambda e: _planted(e, "metrics.jsonl"), "symbolic link"),
    Case("planted-config-symlink", T, lambda e: _planted(e, "config.json"), "symbolic link"),
    Case("planted-latest-symlink", T, lambda e: _planted(e, "latest"), "symbolic link"),
    Case("checkpoint-name-a-symlink-loop", T,
         lambda e: (os.symlink(e.run / "ckpt-000003", e.run / "ckpt-000003"), e.resume())[1],
         "ckpt-000003 is a symbolic link; offload-train never writes through one"),
    Case("checkpoint-name-a-file", T,
         lambda e: ((e.run / "ckpt-000003").write_text("the user's"), e.resume())[1],
         "ckpt-000003 is a file where offload-train writes a directory: remove or rename it"),
    Case("config-json-a-directory", T, lambda e: _directory_at(e, "config.json"), "config.json is a directory where"),
    Case("metrics-a-directory", T, lambda e: _directory_at(e, "metrics.jsonl"), "metrics.jsonl is a directory where"),
    Case("export-a-directory", T, lambda e: _directory_at(e, "model.safetensors"), "model.safetensors is a directory where"),
    Case("metrics-a-fifo", T, lambda e: (os.unlink(e.run / "metrics.jsonl"), os.mkfifo(e.run / "metrics.jsonl"),
                                         e.resume("--train.steps", "3"))[2], "metrics.jsonl is a FIFO (named pipe) where"),
    Case("tensorboard-a-file", T, lambda e: _file_at(e, "tensorboard"), "tensorboard is a file where"),
    Case("hf-export-a-file", T, lambda e: _file_at(e, "hf"), "hf is a file where offload-train writes a directory"),
    Case("latest-names-a-path", T, lambda e: _latest_names(e, False), "no latest file in"),
    Case("latest-names-an-absolute-path", T, lambda e: _latest_names(e, True), "no latest file in"),
    Case("out-dir-is-a-file", T, lambda e: e.train(out=e.file("outfile")), "is a file"),
    Case("out-dir-under-a-file", T, lambda e: e.train(out=e.file("outfile") / "run"), "is a file"),
    Case("out-dir-dangling-symlink", T,
         lambda e: (os.symlink(e.root / "gone", e.root / "link"), e.train(out=e.root / "link"))[1], "does not exist"),
    Case("nvme-dir-is-a-file", T, lambda e: e.train("--tiers.nvme_dir", str(e.file("swapfile"))), "is a file"),
    Case("nvme-dir-under-a-file", T, lambda e: e.train("--tiers.nvme_dir", str(e.file("swapfile") / "s")), "is a file"),
    Case("nvme-dir-dangling-symlink", T,
         lambda e: (os.symlink(e.root / "gone", e.root / "swaplink"),
                    e.train("--tiers.nvme_dir", str(e.root / "swaplink")))[1], "does not exist"),
    Case("out-dir-read-only", T,
         lambda e: (lambda d: None if d is None else e.train(out=d))(read_only_dir(e, "ro-out")), "read-only"),
    Case("nvme-dir-read-only", T,
         lambda e: (lambda d: None if d is None else e.train("--tiers.nvme_dir", str(d / "swap")))(
             read_only_dir(e, "ro-swap")), "read-only"),
    Case("out-dir-not-permitted", T,
         lambda e: (lambda d: None if d is None else e.train(out=d))(unpermitted_dir(e, "ro-out")), "permission denied"),
    Case("nvme-dir-not-permitted", T,
         lambda e: (lambda d: None if d is None else e.train("--tiers.nvme_dir", str(d / "swap")))(
             unpermitted_dir(e, "ro-swap")), "permission denied"),
    # -- config files ---------------------------------------------------------------------------
    Case("config-missing", T, lambda e: e.train("--config", str(e.root / "none.toml")), "does not exist"),
    Case("config-suffix", T, lambda e: e.train("--config", str(e.file("run.yaml"))), ".yaml"),
    Case("config-fifo", T, lambda e: e.train("--config", str(e.fifo("run.toml"))), "FIFO"),
    Case("config-bad-toml", T, lambda e: e.train("--config", str(e.file("run.toml", "[train\nsteps ="))),
         "not valid TOML"),
    Case("config-bad-json", T, lambda e: e.train("--config", str(e.file("run.json", "{'a': 1"))), "not valid JSON"),
    Case("config-json-list", T, lambda e: e.train("--config", str(e.file("run.json", "[1, 2]"))), "JSON object"),
    Case("grad-accum-past-int64", T, lambda e: e.train("--grad_accum_steps", "99999999999999999999"),
         "grad_accum_steps=99999999999999999999 is beyond"),
    Case("io-block-1e400", T, lambda e: e.train("--io.block_bytes", "1e400"), "io.block_bytes='1e400' is more than"),
    Case("config-json-nested-deep", T, lambda e: e.train("--config", str(e.file("run.json", "[" * 100_000 + "]" * 100_000))),
         "arrays or objects nested too deeply to read"),
    Case("config-toml-nested-deep", T,
         lambda e: e.train("--config", str(e.file("run.toml", "seed = " + "[" * 100_000 + "]" * 100_000))),
         "nests arrays or tables too deeply"),
    Case("config-json-5000-digits", T,
         lambda e: e.train("--config", str(e.file("run.json", '{"seed": 1' + "0" * 5000 + "}"))), "run.json"),
    Case("config-toml-5000-digits", T,
         lambda e: e.train("--config", str(e.file("run.toml", "seed = 1" + "0" * 5000))), "run.toml"),
    Case("config-json-key-twice", T,
         lambda e: e.train("--config", str(e.file("run.json", '{"train": {"steps": 5, "steps": 3}}'))),
         "'steps' is given twice"),
    Case("config-unknown-section", T, lambda e: e.train("--config", str(e.file("run.toml", "[trian]\nsteps = 1\n"))),
         "trian"),
    Case("config-is-a-directory", T,
         lambda e: ((e.root / "cfg.toml").mkdir(), e.train("--config", str(e.root / "cfg.toml")))[1], "cfg.toml"),
    # -- corpora ----------------------------------------------------------------------------------
    Case("corpus-missing", T, lambda e: e.train(corpus=e.root / "nowhere"), "no corpus"),
    Case("corpus-hub-name", T, lambda e: e.train("--data.path", "HuggingFaceFW/fineweb"),
         "load_dataset('HuggingFaceFW/fineweb', split='train').save_to_disk('fineweb')"),
    Case("corpus-is-a-fifo", T, lambda e: e.train(corpus=e.fifo("corpus.txt")), "FIFO"),
    Case("corpus-holds-a-fifo", T, _in_corpus_fifo, "FIFO"),
    Case("corpus-dangling-symlink", T, _dangling_in_corpus, "does not exist"),
    Case("corpus-bad-jsonl", T,
         lambda e: e.train(corpus=corpus_with(e, a_jsonl='{"text": "a"}\n{oops\n')),
         "bad JSON"),
    Case("corpus-jsonl-no-text", T,
         lambda e: e.train(corpus=corpus_with(e, a_jsonl='{"body": "a"}\n')), '"text"'),
    # json.loads' RecursionError (a traceback) and its ValueError for an int past int()'s digit limit (naming no file)
    Case("corpus-jsonl-nested-deep", T,
         lambda e: e.train(corpus=corpus_with(e, a_jsonl='{"text": "a"}\n{"text": "b", "meta": ' + DEEP + "}\n")),
         "a.jsonl:2: bad JSON (arrays or objects nested too deeply to read (past Python's recursion limit) at column 100022)"),
    Case("corpus-jsonl-5000-digits", T,
         lambda e: e.train(corpus=corpus_with(e, a_jsonl='{"text": "a", "id": 1' + "0" * 5000 + "}\n")),
         "a.jsonl:1: bad JSON (a number of 5001 digits where at most 4300 are read at column 21)"),
    # a stream of end-of-document tokens alone, trained on without a word
    Case("corpus-jsonl-all-empty", T, lambda e: e.train(corpus=corpus_with(e, a_jsonl='{"text": ""}\n' * 500)),
         "the corpus's 500 documents (the first in "),
    Case("corpus-too-small", T,
         lambda e: e.train(corpus=corpus_with(e, a_txt="tiny")), "too little data"),
    Case("corpus-parquet-not-parquet", T,
         lambda e: e.train(corpus=corpus_with(e, a_parquet="not parquet" * 20)), "a.parquet is not a readable parquet"),
    Case("corpus-saved-dataset-broken", T,
         lambda e: (lambda d: ((d / "dataset_info.json").write_text("{}"), (d / "state.json").write_text("{oops"),
                               e.train(corpus=d))[2])(corpus_with(e)),
         "cannot be loaded"),
    # keep_last deleted the checkpoint holding the live swap files (the run went on on open descriptors), and a
    # checkpoint kept held the swap directory, for which --resume refused it
    Case("nvme-dir-inside-a-checkpoint", T,
         lambda e: e.resume("--tiers.nvme_dir", str(e.run / "ckpt-000004" / "swap"), "--train.steps", "4"),
         "/run/ckpt-000004, which the run in train.out_dir="),
    Case("nvme-dir-inside-the-export", T, lambda e: e.train("--tiers.nvme_dir", str(e.root / "out" / "hf" / "swap")),
         "/out/hf, which the run in train.out_dir="),
    # a pattern with a typo exempted nothing: the weights it was written for decayed without a word
    Case("no-decay-pattern-matching-nothing", T, lambda e: e.train("--optimizer.no_decay_patterns", "norm,layrnorm"),
         "optimizer.no_decay_patterns=['norm', 'layrnorm'] holds 'layrnorm', which is in the name of no trainable "
         "parameter (did you mean 'input_layernorm'?)"),
    Case("out-dir-inside-the-corpus", T, lambda e: e.train(out=e.corpus / "run"), "inside data.path"),
    # Fine-tuning a run's own export further in the same out_dir: --train.overwrite removed the model
    # being trained with the run it replaced (the user's only copy), and the run failed at its export.
    Case("hf-path-in-the-runs-export", T,
         lambda e: e.train("--model.hf_path", str(shutil.copytree(e.hf(), e.run / "hf")), "--train.overwrite", "true",
                           out=e.run),
         "/run/hf, which the run in train.out_dir="),
    Case("hf-path-is-the-out-dir", T, lambda e: e.train("--model.hf_path", str(e.hf()), out=e.hf()),
         "is train.out_dir itself"),
    Case("corpus-binary-txt", T, lambda e: e.train(corpus=corpus_with(e, a_py=TEXT, b_txt=TEXT + "\0" + TEXT)),
         "b.txt holds a NUL byte (at offset 3040)"),
    Case("corpus-utf16-md", T,
         lambda e: e.train(corpus=(e.file("u16/a.md").write_bytes(TEXT.encode("utf-16")), e.root / "u16")[1]),
         "a.md holds a NUL byte"),
    Case("corpus-nul-in-jsonl", T,
         lambda e: e.train(corpus=e.file("a.jsonl", json.dumps({"text": TEXT}) + "\n\0\n")), "a.jsonl holds a NUL byte"),
    # its accented letters were trained on as U+FFFD, silently
    Case("corpus-latin-1", T,
         lambda e: e.train(corpus=(e.file("l1/a.txt").write_bytes(("Noël à l'école. " * 200).encode("latin-1")),
                                   e.root / "l1")[1]),
         "a.txt is not UTF-8 text: byte 0xeb at offset 2 is not UTF-8, nor are 599 more"),
    # skipped as a README is: the run trained on the .py file alone, the corpus's data left out without a word
    Case("corpus-holds-a-gzipped-jsonl", T,
         lambda e: e.train(corpus=(e.file("gz/a.py", TEXT), e.file("gz/b.jsonl.gz", "x"), e.root / "gz")[2]),
         "b.jsonl.gz' is a compressed .jsonl file (.gz), which offload-train does not read (1 such file(s) in "
         "data.path): decompress it, keeping the name it had (e.g. gunzip b.jsonl.gz)"),
    Case("corpus-wrong-suffix", T, lambda e: e.train(corpus=e.file("data.csv", TEXT)), ".csv"),
    Case("corpus-empty-dir", T, lambda e: ((e.root / "void").mkdir(), e.train(corpus=e.root / "void"))[1],
         "holds no usable file"),
    # -- checkpoints ------------------------------------------------------------------------------
    Case("ckpt-flipped-byte", T, lambda e: (flip_byte(e.ckpt / "rank00000.bin"), e.resume())[1],
         "fails its checksum; resume from another checkpoint: --resume ckpt-000001"),
    Case("ckpt-only-one-truncated", T,
         lambda e: (shutil.rmtree(e.run / "ckpt-000001"), os.truncate(e.ckpt / "rank00000.bin", 10), e.resume())[2],
         "is truncated: group 0 param needs 249856 bytes at offset 0, found 10; no other checkpoint is in"),
    Case("ckpt-manifest-not-json", T,
         lambda e: ((e.ckpt / "manifest.json").write_text("{nope"), e.resume())[1], "corrupted"),
    Case("ckpt-manifest-nested-deep", T,
         lambda e: ((e.ckpt / "manifest.json").write_text('{"a": ' + DEEP + "}"), e.resume())[1],
         "manifest.json is corrupted: arrays or objects nested too deeply to read"),
    Case("ckpt-manifest-edited", T,
         lambda e: (edit_manifest(e, lambda m: m["state"].update(step=7), sign=False), e.resume())[1], "edited"),
    Case("ckpt-manifest-missing-key", T, lambda e: (edit_manifest(e, lambda m: m.pop("extra")), e.resume())[1],
         "extra"),
    Case("ckpt-manifest-missing-data", T,
         lambda e: (edit_manifest(e, lambda m: m["extra"].pop("data")), e.resume())[1], "data"),
    Case("ckpt-data-position-not-a-table", T,
         lambda e: (edit_manifest(e, lambda m: m["extra"].update(data="x")), e.resume())[1],
         "ckpt-000002 was not saved by offload-train or is corrupted: the data position it keeps for offload-train "
         "is unusable (a BatchStream state is a dict"),
    Case("ckpt-state-missing-key", T,
         lambda e: (edit_manifest(e, lambda m: m["state"]["loss_scale"].pop("good_steps")), e.resume())[1],
         "good_steps"),
    Case("ckpt-optimizer-state-missing", T,
         lambda e: (edit_manifest(e, lambda m: m["ranks"][0]["state"].pop("optimizer")), e.resume())[1],
         "optimizer"),
    Case("ckpt-state-step-not-a-number", T,
         lambda e: (edit_manifest(e, lambda m: m["state"].update(step="x")), e.resume())[1],
         "its saved engine state misstates a value (invalid literal for int() with base 10: 'x'); resume from "
         "another checkpoint: --resume ckpt-000001"),
    Case("ckpt-record-offset-past-2**63", T,
         lambda e: (edit_manifest(e, lambda m: m["ranks"][0]["records"][0].update(offset=2**63)), e.resume())[1],
         "rank00000.bin is truncated: group 0 param needs 249856 bytes at offset 9223372036854775808, found 0"),
    Case("ckpt-loss-scale-zero", T,
         lambda e: (edit_manifest(e, lambda m: m["state"]["loss_scale"].update(scale=0.0)), e.resume())[1], "scale"),
    Case("ckpt-rank-file-truncated", T,
         lambda e: ((e.ckpt / "rank00000.bin").write_bytes((e.ckpt / "rank00000.bin").read_bytes()[:1000]),
                    e.resume())[1], "--resume ckpt-000001"),
    Case("ckpt-rank-file-missing", T, lambda e: ((e.ckpt / "rank00000.bin").unlink(), e.resume())[1], "rank00000.bin"),
    Case("ckpt-manifest-fifo", T,
         lambda e: ((e.ckpt / "manifest.json").unlink(), os.mkfifo(e.ckpt / "manifest.json"), e.resume())[2], "FIFO"),
    Case("ckpt-data-past-the-corpus", T, lambda e: e.resume("--data.max_tokens", "200"),
         "data.max_tokens=4000000 then, 200 now"),
    Case("ckpt-rng-garbage", T,
         lambda e: (edit_manifest(e, lambda m: m["extra"].update(torch_rng=[1, 2, 3])), e.resume())[1], "RNG state"),
    Case("resume-past-train-steps", T, lambda e: e.resume("--train.steps", "1"), "train.steps=1 is below"),
    Case("resume-a-file", T, lambda e: e.train("--resume", str(e.run / "metrics.jsonl"), out=e.run),
         "metrics.jsonl is not a checkpoint: it is a file, not a directory; name a checkpoint directory"),
    Case("ckpt-of-a-newer-format", T, lambda e: (edit_manifest(e, lambda m: m.update(format=99)), e.resume())[1],
         "newer than this one: this offload-trainer"),
    Case("ckpt-of-an-older-format", T, lambda e: (edit_manifest(e, lambda m: m.update(format=1)), e.resume())[1],
         "older than this one: this offload-trainer"),
    Case("ckpt-of-another-model", T, lambda e: e.resume("--model.preset", "small"), "another model"),
    # "load it with the optimizer kind and precision it was saved with", without saying which
    Case("ckpt-of-another-precision", T, lambda e: e.resume("--precision.compute_dtype", "bf16"),
         "saved with (optimizer.kind='adamw', precision.compute_dtype='fp32')"),
    # -- Hugging Face model directories ---------------------------------------------------------------
    Case("hf-missing", T, lambda e: e.train("--model.hf_path", str(e.root / "nohf")), "does not exist"),
    Case("hf-hub-name", T, lambda e: e.train("--model.hf_path", "meta-llama/Llama-3.2-1B"),
         "huggingface-cli download meta-llama/Llama-3.2-1B --local-dir Llama-3.2-1B"),
    Case("hf-no-config", T,
         lambda e: ((e.hf(), (e.root / "hf" / "config.json").unlink()),
                    e.train("--model.hf_path", str(e.root / "hf")))[1], "config.json"),
    Case("hf-config-not-json", T, lambda e: e.train("--model.hf_path", str(e.hf(raw_config="{llama"))),
         "not valid JSON"),
    Case("hf-config-nested-deep", T, lambda e: e.train("--model.hf_path", str(e.hf(raw_config='{"a": ' + DEEP + "}"))),
         "config.json is not valid JSON (arrays or objects nested too deeply to read"),
    Case("hf-config-a-list", T, lambda e: e.train("--model.hf_path", str(e.hf(raw_config="[]"))), "not an object"),
    Case("hf-no-weights", T,
         lambda e: ((e.hf(), (e.root / "hf" / "model.safetensors").unlink()),
                    e.train("--model.hf_path", str(e.root / "hf")))[1], "no *.safetensors"),
    Case("hf-random-safetensors", T, lambda e: e.train("--model.hf_path", str(e.hf(weights=os.urandom(4096)))),
         "model.safetensors"),
    Case("hf-truncated-safetensors", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=safetensors_bytes({"w": [1.0] * 64})[:40]))),
         "model.safetensors"),
    Case("hf-header-nested-deep", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=raw_safetensors('{"a": ' + DEEP + "}", b"")))),
         "model.safetensors has a header that is not JSON"),
    Case("hf-2p62-header", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=struct.pack("<Q", 2**62) + b"{}"))), "header claims"),
    Case("hf-offsets-past-end", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=safetensors_bytes({"w": [1.0] * 64})[:-16]))),
         "truncated"),
    # what the safetensors library refuses itself, in a message naming no file: the check names it
    Case("hf-overlapping-offsets", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=raw_safetensors(
             '{"a": ' + TWO_F32 + '[0, 8]}, "b": ' + TWO_F32 + '[0, 8]}}', b"\0" * 8)))),
         "hf/model.safetensors is corrupted: tensor 'b' at [0, 8] overlaps the tensor before it"),
    Case("hf-gap-between-tensors", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=raw_safetensors(
             '{"a": ' + TWO_F32 + '[0, 8]}, "b": ' + TWO_F32 + '[16, 24]}}', b"\0" * 24)))),
         "tensor 'b' at [16, 24] leaves bytes [8, 16) to no tensor"),
    Case("hf-name-twice-in-header", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=raw_safetensors(
             '{"w": ' + TWO_F32 + '[0, 8]}, "w": ' + TWO_F32 + '[8, 16]}}', b"\0" * 16)))),
         "hf/model.safetensors is corrupted: its header names 'w' twice"),
    Case("hf-metadata-not-strings", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=raw_safetensors(
             '{"__metadata__": {"format": 5}, "w": ' + TWO_F32 + '[0, 8]}}', b"\0" * 8)))),
         "its __metadata__ {'format': 5} is not a table of strings"),
    Case("hf-bytes-appended", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=safetensors_bytes({"w": [1.0, 2.0]}) + b"\0" * 4))),
         "its tensors cover 8 of its 12 bytes of data"),
    Case("hf-weights-fifo", T,
         lambda e: ((e.hf(), (e.root / "hf" / "model.safetensors").unlink(),
                     os.mkfifo(e.root / "hf" / "model.safetensors")),
                    e.train("--model.hf_path", str(e.root / "hf")))[1], "FIFO"),
    Case("hf-seq-len-past-positions", T,
         lambda e: e.train("--model.hf_path", str(e.hf(config={**LLAMA, "max_position_embeddings": 16}))),
         "max_position_embeddings=16"),
    Case("hf-config-value-of-wrong-type", T,
         lambda e: e.train("--model.hf_path", str(e.hf(config={**LLAMA, "hidden_size": "big"}))), "hidden_size"),
    Case("hf-config-vocab-beyond-any-model", T,
         lambda e: e.train("--model.hf_path", str(e.hf(config={**LLAMA, "vocab_size": 10**30}))),
         "vocab_size=1000000000000000000000000000000 is beyond any model's size (at most 2**31 - 1); fix config.json"),
    Case("hf-config-layers-negative", T,
         lambda e: e.train("--model.hf_path", str(e.hf(config={**LLAMA, "num_hidden_layers": -3}))),
         "the Hugging Face config's num_hidden_layers=-3 must be at least 0"),
    Case("hf-config-max-positions-negative", T,
         lambda e: e.train("--model.hf_path", str(e.hf(config={**LLAMA, "max_position_embeddings": -5}))),
         "the Hugging Face config's max_position_embeddings=-5 must be at least 1"),
    # transformers builds it and loads its weights: the first forward failed in attention, a traceback.
    Case("hf-config-heads-not-a-multiple-of-kv-heads", T,
         lambda e: e.train("--model.hf_path", str(e.hf(config={**LLAMA, "num_key_value_heads": 3}))),
         "the Hugging Face config's num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    Case("plan-hf-heads-not-a-multiple-of-kv-heads", "plan",
         lambda e: ["--hf-config", str(e.hf(config={**LLAMA, "num_key_value_heads": 3}) / "config.json"), "--no-measure"],
         "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    # transformers logged "Missing validation function ... 'rope_type'='banana'" to stderr: a second line
    Case("hf-config-unknown-rope-type", T,
         lambda e: e.train("--model.hf_path", str(e.hf(config={**LLAMA, "rope_scaling": {"rope_type": "banana"}}))),
         "its config.json cannot be built into a causal LM (KeyError: 'banana')"),
    # json.loads reads NaN: the model built and loaded, and step 1's loss was NaN, the line blaming optimizer.lr
    Case("hf-config-nan", T,
         lambda e: e.train("--model.hf_path", str(e.hf(config={**LLAMA, "rms_norm_eps": float("nan")}))),
         "the Hugging Face config's rms_norm_eps=NaN is not a value of any setting"),
    Case("plan-hf-config-nan-nested", "plan",
         lambda e: ["--hf-config", str(e.hf(config={**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": float("nan")}})),
                    "--data.seq_len", "64", "--no-measure"],
         "the Hugging Face config's rope_scaling.factor=NaN"),
    Case("hf-config-unknown-model-type", T,
         lambda e: e.train("--model.hf_path", str(e.hf(config={**LLAMA, "model_type": "banana"}))), "banana"),
    # the class alone, its vocabulary files missing: it loaded with no vocabulary, and every document gave 0
    # tokens ("too little data", blaming the corpus)
    Case("hf-tokenizer-config-without-vocabulary", T,
         lambda e: (e.hf(), (e.root / "hf" / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizerFast"}'),
                    e.train("--model.hf_path", str(e.root / "hf")))[2], "turns text into no tokens ('a' gave none)"),
    Case("hf-tokenizer-not-json", T,
         lambda e: (e.hf(), (e.root / "hf" / "tokenizer.json").write_text("{oops"),
                    e.train("--model.hf_path", str(e.root / "hf")))[2], "tokenizer files cannot be loaded"),
    Case("hf-header-unknown-dtype", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=safetensors_bytes({"w": [1.0, 2.0]}).replace(b'"F32"', b'"Q32"')))),
         "dtype 'Q32'"),
    # an empty tensor of sizes no tensor holds: the library's "overflow computing buffer size", naming no file
    Case("hf-header-empty-tensor-of-overflowing-sizes", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=raw_safetensors(
             '{"w": {"dtype": "F32", "shape": [4611686018427387904, 4611686018427387904, 0], "data_offsets": [0, 0]}}',
             b"")))),
         "hf/model.safetensors is corrupted: tensor 'w' has shape [4611686018427387904, 4611686018427387904, 0], whose "
         "sizes multiply past any tensor's"),
    # JSON's true is Python's 1: passed the check, then the library refused it naming no file
    Case("hf-header-bool-in-shape", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=raw_safetensors(
             '{"w": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', b"\0" * 4)))),
         "hf/model.safetensors is corrupted: tensor 'w' has shape [True]"),
    Case("hf-header-bool-in-offsets", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=raw_safetensors(
             '{"w": {"dtype": "U8", "shape": [1], "data_offsets": [false, true]}}', b"\0")))),
         "hf/model.safetensors is truncated or corrupted: tensor 'w' lies at [False, True]"),
    Case("hf-header-shape-misstates-data", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=safetensors_bytes({"w": [1.0, 2.0]}).replace(b"[2]", b"[3]")))),
         "needs 12 bytes"),
    # an encoder builds a "causal LM" whose positions see the tokens they predict: refused before its
    # weights are looked at (offload-plan planned it); transformers' own warning is not a second line
    Case("hf-encoder-config", T, lambda e: e.train("--model.hf_path", str(e.hf(config=BERT))),
         "builds BertLMHeadModel, whose attention is not causal"),
    Case("hf-config-without-sizes", T, lambda e: e.train("--model.hf_path", str(e.hf(config={"model_type": "llama"}))),
         "do not fit the model"),
    Case("hf-tied-config-untied-weights", T, _tied_config_untied_weights, "set tie_word_embeddings false"),
    Case("hf-weights-stored-as-int", T,
         lambda e: e.train("--model.hf_path", str(e.hf(weights=safetensors_bytes({"model.norm.weight": [1] * 32}, "I32")))), "stored as I32"),
    Case("hf-same-tensor-in-two-files", T,
         lambda e: (e.hf(), (e.root / "hf" / "model.safetensors").rename(e.root / "hf" / "a.safetensors"),
                    (e.root / "hf" / "b.safetensors").write_bytes(safetensors_bytes({"w": [5.0, 5.0]})),
                    e.train("--model.hf_path", str(e.root / "hf")))[3], "stored in both"),
    Case("hf-index-names-a-missing-shard", T,
         lambda e: (e.hf(), (e.root / "hf" / "model.safetensors").rename(e.root / "hf" / "m-1.safetensors"),
                    (e.root / "hf" / "model.safetensors.index.json").write_text(
                        json.dumps({"weight_map": {"w": "m-1.safetensors", "v": "m-2.safetensors"}})),
                    e.train("--model.hf_path", str(e.root / "hf")))[3], "m-2.safetensors"),
    # the index's names were joined to the directory as they were: a shard read from outside the model
    Case("hf-index-names-a-shard-outside", T,
         lambda e: (e.hf(), (e.root / "hf" / "model.safetensors").rename(e.root / "w.safetensors"),
                    (e.root / "hf" / "model.safetensors.index.json").write_text(
                        json.dumps({"weight_map": {"w": "../w.safetensors"}})),
                    e.train("--model.hf_path", str(e.root / "hf")))[3], "names shard files that are not files of"),
    # the index was read for its file names only: a shard of another save under a listed name went unseen
    Case("hf-index-misplaces-a-tensor", T,
         lambda e: (e.hf(), (e.root / "hf" / "model.safetensors").rename(e.root / "hf" / "m-1.safetensors"),
                    (e.root / "hf" / "m-2.safetensors").write_bytes(safetensors_bytes({"v": [5.0, 5.0]})),
                    (e.root / "hf" / "model.safetensors.index.json").write_text(
                        json.dumps({"weight_map": {"w": "m-2.safetensors", "v": "m-1.safetensors"}})),
                    e.train("--model.hf_path", str(e.root / "hf")))[4],
         "does not match the shards' headers: it places 'w' in m-2.safetensors, but m-1.safetensors holds it"),
    Case("hf-index-names-a-tensor-no-shard-holds", T,
         lambda e: (e.hf(), (e.root / "hf" / "model.safetensors").rename(e.root / "hf" / "m-1.safetensors"),
                    (e.root / "hf" / "model.safetensors.index.json").write_text(
                        json.dumps({"weight_map": {"w": "m-1.safetensors", "lm_head.weight": "m-1.safetensors"}})),
                    e.train("--model.hf_path", str(e.root / "hf")))[3],
         "'lm_head.weight' in m-1.safetensors, but no shard holds it"),
    Case("hf-index-nested-deep", T,
         lambda e: (e.hf(), (e.root / "hf" / "model.safetensors").rename(e.root / "hf" / "m-1.safetensors"),
                    (e.root / "hf" / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}"),
                    e.train("--model.hf_path", str(e.root / "hf")))[3], "model.safetensors.index.json is not a shard index"),
    Case("hf-index-not-json", T,
         lambda e: (e.hf(), (e.root / "hf" / "model.safetensors").rename(e.root / "hf" / "m-1.safetensors"),
                    (e.root / "hf" / "model.safetensors.index.json").write_text("{oops"),
                    e.train("--model.hf_path", str(e.root / "hf")))[3], "not a shard index"),
    Case("lora-built-in-without-targets", T, lambda e: e.train("--lora.rank", "4"), "lora.target_modules"),
    # PEFT took the rank and allocated it: torch's allocator error (256 GB for one adapter), a traceback
    Case("lora-rank-past-full-rank", T,
         lambda e: e.train("--lora.rank", "1000000000", "--lora.target_modules", "q_proj"),
         "lora.rank=1000000000 is above the full rank of every module it adapts (at most 64: 'layers.1.self_attn.q_proj' "
         "is 64 x 64)"),
    Case("host-memory-exhausted", T, _no_memory, "tiers.host_budget_bytes"),
    # -- torchrun's environment ---------------------------------------------------------------------
    Case("world-size-not-a-number", T, lambda e: _launched_with(e, WORLD_SIZE="abc"),
         "WORLD_SIZE='abc' must be a whole number 1 or more: start the run with torchrun"),
    Case("world-size-zero-env", T, lambda e: _launched_with(e, WORLD_SIZE="0"), "WORLD_SIZE='0'"),
    Case("rank-not-a-number", T, lambda e: _launched_with(e, WORLD_SIZE="2", RANK="first"),
         "RANK='first' must be a whole number from 0 to 1"),
    Case("rank-past-world-size", T, lambda e: _launched_with(e, WORLD_SIZE="2", RANK="2"), "RANK='2'"),
    Case("local-rank-negative", T, lambda e: _launched_with(e, WORLD_SIZE="2", RANK="1", LOCAL_RANK="-1"),
         "LOCAL_RANK='-1'"),
    Case("master-port-not-a-number", T, lambda e: _launched_with(e, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1",
                                                               MASTER_PORT="abc"),
         "MASTER_PORT='abc' must be a port number from 1 to 65535 when WORLD_SIZE > 1: start the run with torchrun"),
    Case("master-port-past-65535", T, lambda e: _launched_with(e, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1",
                                                             MASTER_PORT="99999"), "MASTER_PORT='99999'"),
    Case("master-port-missing", T, lambda e: _launched_with(e, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1",
                                                          MASTER_PORT=None), "MASTER_PORT=None"),
    Case("master-addr-missing", T, lambda e: _launched_with(e, WORLD_SIZE="2", RANK="0", MASTER_ADDR=None,
                                                          MASTER_PORT="29500"),
         "MASTER_ADDR=None must name the host of rank 0 when WORLD_SIZE > 1"),
    Case("master-addr-empty", T, lambda e: _launched_with(e, WORLD_SIZE="2", RANK="0", MASTER_ADDR=" ",
                                                        MASTER_PORT="29500"), "MASTER_ADDR=' '"),
    # -- a full disk mid-save ---------------------------------------------------------------------------
    Case("disk-full-mid-save", T, _full_disk, "the disk is full", out_dir_written=True),
    Case("enospc-mid-save", T, _dev_full, "the disk is full", out_dir_written=True),
    # -- offload-plan ----------------------------------------------------------------------------------
    Case("plan-device-banana", "plan", lambda e: ["--device", "banana"], "--device 'banana'"),
    Case("plan-write-config-missing-dir", "plan", lambda e: ["--write-config", str(e.root / "no" / "p.toml")],
         "does not exist"),
    Case("plan-write-config-suffix", "plan", lambda e: ["--write-config", str(e.root / "p.txt")], ".toml"),
    Case("plan-write-config-a-directory", "plan",
         lambda e: ((e.root / "p.toml").mkdir(), ["--write-config", str(e.root / "p.toml")])[1], "directory"),
    Case("plan-world-size-zero", "plan", lambda e: ["--world-size", "0"], "--world-size 0"),
    Case("plan-world-size-banana", "plan", lambda e: ["--world-size", "banana"], "invalid int value"),
    Case("plan-preset-and-hf-config", "plan",
         lambda e: ["--model.preset", "tiny", "--hf-config", str(e.hf()), "--no-measure"],
         "--model.preset tiny and --hf-config both name the model"),
    # --hf-config's model was planned, and written as model.hf_path, without a word about the other
    Case("plan-hf-path-and-hf-config", "plan",
         lambda e: ["--model.hf_path", str(e.root / "other"), "--hf-config", str(e.hf()), "--data.seq_len", "64", "--no-measure"],
         "and --hf-config both name the model, and --hf-config's would be planned: drop one of them"),
    Case("plan-prefix-flag", "plan", lambda e: ["--refres"], "did you mean --refresh?"),
    Case("plan-world-size-twice", "plan", lambda e: ["--world-size", "2", "--world-size=3"], "--world-size: is given twice"),
    Case("plan-override-twice", "plan", lambda e: ["--model.preset", "tiny", "--model.preset", "small"],
         "--model.preset is given twice ('tiny', then 'small')"),
    Case("plan-prefix-override", "plan", lambda e: ["--model.pre", "tiny"], "unknown flag --model.pre; did you mean --model.preset?"),
    Case("plan-hf-encoder-config", "plan", lambda e: ["--hf-config", str(e.hf(config=BERT)), "--no-measure"],
         "hf' builds BertLMHeadModel, whose attention is not causal"),
    Case("plan-hf-config-missing", "plan", lambda e: ["--hf-config", str(e.root / "none.json")], "does not exist"),
    Case("plan-hf-config-hub-name", "plan", lambda e: ["--hf-config", "Qwen/Qwen2.5-0.5B"],
         "then give --hf-config Qwen2.5-0.5B"),
    Case("plan-hf-config-nested-deep", "plan",
         lambda e: ["--hf-config", str(e.hf(raw_config='{"a": ' + DEEP + "}")), "--no-measure"],
         "config.json is not valid JSON (arrays or objects nested too deeply to read"),
    Case("plan-hf-config-with-a-bom", "plan",
         lambda e: ["--hf-config", str(e.hf(raw_config="\ufeff" + json.dumps(LLAMA)) / "config.json"), "--no-measure"],
         "config.json is not valid JSON (the text starts with a byte-order mark (BOM), which JSON does not allow: save "
         "the file as UTF-8 without a BOM"),
    Case("plan-hf-config-not-json", "plan", lambda e: ["--hf-config", str(e.file("c.json", "{x"))], "not valid JSON"),
    Case("plan-hf-config-named-otherwise", "plan",
         lambda e: ["--hf-config", str(e.file("c.json", json.dumps(LLAMA))), "--data.seq_len", "64"],
         "is a file named 'c.json': give the model's directory, or its file named config.json"),
    Case("plan-hf-config-without-model-type", "plan",
         lambda e: ["--hf-config", str(e.hf(config={k: v for k, v in LLAMA.items() if k != "model_type"})),
                    "--data.seq_len", "64"],
         "its config.json cannot be built into a causal LM (ValueError: Unrecognized model"),
    Case("plan-hf-vocab-beyond-any-model", "plan",
         lambda e: ["--hf-config", str(e.hf(config={**LLAMA, "vocab_size": 10**30})), "--data.seq_len", "64"],
         "the Hugging Face config's vocab_size=1000000000000000000000000000000 is beyond any model's size"),
    # 0 was taken for a limit: "set data.seq_len to at most 0", a value no command takes
    Case("plan-hf-max-positions-zero", "plan",
         lambda e: ["--hf-config", str(e.hf(config={**LLAMA, "max_position_embeddings": 0})), "--data.seq_len", "64"],
         "the Hugging Face config's max_position_embeddings=0 must be at least 1: it is a size of the model; fix config.json"),
    Case("plan-world-size-beyond-int32", "plan", lambda e: ["--world-size", str(10**30)],
         "--world-size 1000000000000000000000000000000 must be from 1 to 2147483647"),
    Case("plan-hf-config-fifo", "plan", lambda e: ["--hf-config", str(e.fifo("c.json"))], "FIFO"),
    Case("plan-config-fifo", "plan", lambda e: ["--config", str(e.fifo("run.toml"))], "FIFO"),
    Case("plan-seq-len", "plan", lambda e: ["--model.preset", "tiny", "--data.seq_len", "4096"], "max_seq_len=256"),
    Case("plan-io-block-1tib", "plan", lambda e: ["--io.block_bytes", "1TiB"], "io.block_bytes"),
    Case("plan-nvme-dir-a-file", "plan", lambda e: ["--tiers.nvme_dir", str(e.file("f"))], "is a file"),
    # -- the scripts -------------------------------------------------------------------------------------
    Case("bench-io-size", "bench_io", lambda e: ["--dir", str(e.swap), "--size", "lots"], "'lots'"),
    Case("bench-io-dir-a-file", "bench_io", lambda e: ["--dir", str(e.file("f"))], "is a file"),
    # abspath('') is the current directory: the test file, or the swap files, went there without a word
    Case("bench-io-dir-empty", "bench_io", lambda e: ["--dir", "", "--size", "1MiB"],
         "--dir '' is empty, which would put the files in the current directory"),
    Case("many-layers-nvme-dir-empty", "many_layers",
         lambda e: ["--layers", "2", "--steps", "1", "--warmup-steps", "1", "--disk-size", "0", "--nvme-dir", ""],
         "--nvme-dir '' is empty"),
    Case("bench-offload-nvme-dir-empty", "bench_offload", lambda e: ["--nvme-dir", ""], "--nvme-dir '' is empty"),
    Case("bench-io-dir-under-a-file", "bench_io", lambda e: ["--dir", str(e.file("f") / "d"), "--size", "1MiB"],
         "--dir"),
    Case("bench-io-threads", "bench_io", lambda e: ["--dir", str(e.swap), "--threads", "0"], "--threads"),
    # an empty value ran with the default, as if the flag were not given
    Case("bench-io-sweep-threads-empty", "bench_io", lambda e: ["--dir", str(e.swap), "--sweep", "--sweep-threads", ""],
         "--sweep-threads '' is empty; give a comma-separated list, for example --sweep-threads 4,8"),
    Case("bench-io-threads-empty", "bench_io", lambda e: ["--dir", str(e.swap), "--threads", ""],
         "--threads '' is not a whole number"),
    Case("bench-offload-disk-size-empty", "bench_offload", lambda e: ["--nvme-dir", str(e.swap), "--disk-size", ""],
         "--disk-size ''"),
    # the file was rounded up to the blocks' least common multiple: 3.7 TiB for --size 1MiB, without a word
    Case("bench-io-sweep-blocks-coprime", "bench_io",
         lambda e: ["--dir", str(e.swap), "--sweep", "--sweep-blocks", "3988KiB,3964KiB,3932KiB", "--size", "1MiB"],
         "--size 1 MiB would be rounded up to 3.62 TiB: the test file is a whole number of blocks of every block size "
         "timed, and theirs have a least common multiple of 3.62 TiB"),
    Case("bench-io-prefix", "bench_io", lambda e: ["--dir", str(e.swap), "--siz", "1MiB"], "unrecognized arguments"),
    Case("bench-io-block", "bench_io", lambda e: ["--dir", str(e.swap), "--block-size", "1000"], "4096"),
    Case("bench-offload-steps", "bench_offload", lambda e: ["--nvme-dir", str(e.swap), "--steps", "-1"], "--steps -1"),
    Case("bench-offload-preset", "bench_offload", lambda e: ["--nvme-dir", str(e.swap), "--preset", "banana"],
         "banana"),
    Case("bench-offload-nvme-a-file", "bench_offload", lambda e: ["--nvme-dir", str(e.file("f"))], "is a file"),
    Case("bench-offload-prefix", "bench_offload", lambda e: ["--nvme-dir", str(e.swap), "--step", "2"],
         "unrecognized arguments"),
    Case("bench-offload-grad-clip", "bench_offload", lambda e: ["--nvme-dir", str(e.swap), "--grad-clip", "x"],
         "--grad-clip"),
    Case("bench-io-threads-huge", "bench_io", lambda e: ["--dir", str(e.swap), "--threads", "100000"],
         "--threads 100000"),
    Case("bench-offload-threads-huge", "bench_offload", lambda e: ["--nvme-dir", str(e.swap), "--threads", "100000"],
         "--threads 100000"),
    Case("bench-offload-batch-1e9", "bench_offload",
         lambda e: ["--nvme-dir", str(e.swap), "--preset", "tiny", "--batch-size", "1000000000", "--seq-len", "32"],
         "memory available"),
    Case("tune-batch-1e9", "tune", lambda e: ["--preset", "tiny", "--batch-size", "1000000000"], "memory available"),
    Case("tune-seq-len", "tune", lambda e: ["--preset", "tiny", "--seq-len", "4096"], "max_seq_len=256"),
    Case("tune-config-fifo", "tune", lambda e: ["--config", str(e.fifo("run.toml"))], "FIFO"),
    Case("tune-out-suffix", "tune", lambda e: ["--out", str(e.root / "t.txt")], ".toml or .json"),
    # found only when the config was written, after every point was measured (minutes on a real model)
    Case("tune-out-under-a-file", "tune",
         lambda e: ["--preset", "tiny", "--seq-len", "16", "--batch-size", "1", "--steps", "1", "--warmup-steps", "0",
                    "--max-points", "1", "--rates-size", "1MiB", "--out", str(e.file("f") / "t.toml")],
         "--out's directory="),
    Case("tune-steps", "tune", lambda e: ["--steps", "0"], "--steps"),
    Case("tune-preset", "tune", lambda e: ["--preset", "banana"], "banana"),
    # the scripts' flags given twice: the last one won without a word
    Case("bench-io-dir-twice", "bench_io", lambda e: ["--dir", str(e.swap), "--dir", str(e.root / "other")],
         "--dir: is given twice"),
    Case("bench-offload-steps-twice", "bench_offload", lambda e: ["--nvme-dir", str(e.swap), "--steps", "2", "--steps=3"],
         "--steps: is given twice ('2', then '3')"),
    Case("tune-preset-twice", "tune", lambda e: ["--preset", "tiny", "--preset", "small"], "--preset: is given twice"),
    Case("tune-prefix", "tune", lambda e: ["--max-point", "3"], "unrecognized arguments"),
    # offload-bench-many-layers: a traceback, a kill by the kernel, a crash, and an --nvme-dir found unusable only
    # after the host placement had run (minutes at its defaults)
    Case("many-layers-batch-1e9", "many_layers", lambda e: ["--batch-size", "1000000000"], "memory available"),
    Case("many-layers-model-past-memory", "many_layers", lambda e: ["--layers", "1000000"],
         "--layers 1000000 x --dim 64 (--ffn-dim 256, --vocab 256) is 65664.0 M parameters"),
    Case("many-layers-threads-huge", "many_layers", lambda e: ["--threads", "100000"], "--threads 100000"),
    Case("many-layers-nvme-dir-under-a-file", "many_layers",
         lambda e: ["--layers", "2", "--steps", "1", "--warmup-steps", "1", "--disk-size", "0",
                    "--nvme-dir", str(e.file("f") / "d")],
         "(a part of this path is a file, not a directory); set --nvme-dir to a path made of directories"),
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus and a run of 2 steps with checkpoints ckpt-000001 and ckpt-000002 (made once)."""
    root = tmp_path_factory.mktemp("prepared")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.py").write_text(f"# document {i}\n" + TEXT)
    env = Env(root)
    assert cli.main(env.train("--train.steps", "2", out=env.run)) == 0
    shutil.rmtree(env.swap)
    return root


def snapshot(root: Path) -> Dict[str, object]:
    """Every entry under `root`: a file's bytes, a symlink's target, a FIFO or directory's kind."""
    out: Dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            mode = os.lstat(path).st_mode
            key = str(path.relative_to(root))
            if stat.S_ISLNK(mode):
                out[key] = ("link", os.readlink(path))
            elif stat.S_ISREG(mode):
                out[key] = path.read_bytes()
            else:
                out[key] = stat.S_IFMT(mode)
    return out


def leftovers(root: Path) -> List[str]:
    return [str(p) for p in root.rglob("*") if ".tmp-" in p.name or p.name.startswith("offload-swap-")]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_ends_with_one_line_and_exit_2(
    case: Case, prepared: Path, tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(prepared, tmp_path, dirs_exist_ok=True, symlinks=True)
    monkeypatch.setenv("OFFLOAD_TRAINER_CACHE", str(tmp_path / "cache" / "machine.json"))
    monkeypatch.chdir(tmp_path)
    env = Env(tmp_path)
    env.monkeypatch = monkeypatch  # type: ignore[attr-defined]
    try:
        argv = case.argv(env)
        if argv is None:
            pytest.skip("this machine cannot make the case (needs a tmpfs mount or a non-root user)")
        before = snapshot(tmp_path)
        capfd.readouterr()
        try:
            status = COMMANDS[case.command](argv)
        except SystemExit as exc:
            status = exc.code
        out, err = capfd.readouterr()
        after = snapshot(tmp_path)
    finally:
        for mount in [p for p in tmp_path.iterdir() if os.path.ismount(p)]:
            subprocess.run(["umount", str(mount)], capture_output=True)
    assert status == 2, f"exit {status}; stderr: {err}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert case.message in lines[0], lines[0]
    changed = [k for k, v in before.items() if after.get(k) != v]
    assert not changed, f"changed or removed: {changed}"
    if not case.out_dir_written:
        new = [k for k in after if k not in before and k.split(os.sep)[0] in ("run", "out", "small")]
        assert not new, f"written into the out_dir of a refused run: {new}"
    assert not leftovers(tmp_path), leftovers(tmp_path)


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)
