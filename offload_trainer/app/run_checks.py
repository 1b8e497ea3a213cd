"""offload-train's checks before anything is written: paths, bounds, the model's limits and the run directory.

    checkpoint = check_run(cfg, resume="latest", world_size=1)   # ValueError naming the setting and the fix

Every mistake a user can make in a config or on a disk that can be found without building the model
is found here, so that a refused run leaves its out_dir as it was (config.json and metrics.jsonl
are written only after these checks, the engine's construction and the checkpoint's load pass).
offload-plan and the scripts reuse the pieces that apply to them.

- Paths: train.out_dir and tiers.nvme_dir must be (or be makeable as) writable directories; a
  symlink the user named as the directory itself is followed (users symlink scratch space), a
  dangling one is refused. Inside out_dir no file offload-train writes may be a symlink (it would
  never write through one; see io_engine/atomic_file.py). Files that are read (a config, a corpus,
  a Hugging Face model's files, a checkpoint's) must be regular files: opening a FIFO blocks forever.
- Bounds: train.num_threads by the CPUs this machine has; the IO engine's threads, and its bounce
  buffers (io.num_threads x io.block_bytes, allocated up front) against the memory available and
  one block against the host budget; one micro-batch's activations and logits (data.batch_size x
  data.seq_len) against the memory available; data.seq_len against the model's longest sequence.
- The run directory: a fresh run into a directory that holds another run is refused unless
  train.overwrite; --resume latest needs a complete checkpoint there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any, Dict, List, Optional, TypeVar

import torch

from io_engine import IOConfig
from io_engine.usable_cpus import usable_cpus
from io_engine.atomic_file import TEMP_MARKER
from io_engine.buffers import round_up

from offload_trainer.config import json_text
from offload_trainer.app.hf_weights import hf_weight_files
from offload_trainer.app.hub_names import model_download_hint
from offload_trainer.app.run_config import MicroBatchOrder, RunConfig
from offload_trainer.app.run_dir import (
    CHECKPOINT_PATTERN,
    CONFIG,
    LATEST,
    MANIFEST,
    METRICS,
    PLAN,
    RANK_TRACE_PATTERN,
    REGULAR_RUN_FILES,
    REPLACING,
    RUN_FILES,
    TENSORBOARD,
    TRACE,
    checkpoints,
    complete_checkpoints,
    latest_checkpoint,
    latest_resumed_from,
    replacement_interrupted,
    run_contents,
)
from offload_trainer.app.user_errors import PathRole
from offload_trainer.config import OffloadConfig
from offload_trainer.config.placement import PlacementMode
from offload_trainer.config.byte_size import format_bytes
from offload_trainer.errors import CheckpointError
from offload_trainer.models.decoder import DecoderConfig
from offload_trainer.planning.host_memory import memory_available_bytes
from offload_trainer.planning.zero_memory import DecoderShape, activation_bytes, check_hf_sizes
from offload_trainer.runtime.persist.checkpoint import not_a_checkpoint_directory
from offload_trainer.runtime.persist.safetensors_header import check_safetensors_header

MAX_IO_THREADS = 256
"""Most IO worker threads an engine may start: each is an OS thread with a bounce buffer of its own,
and far fewer saturate any disk (bench_io.py --sweep measures where more stop helping)."""
IO_MEMORY_SHARE_OF_AVAILABLE = 0.5
"""The IO engine's bounce buffers may take at most this share of the memory available."""
TOKEN_ID_BYTES = 2 * 8
"""Per token of a micro-batch: its input and target ids, int64 each."""


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def check_regular_file(path: "str | os.PathLike[str]", setting: str) -> None:
    """`path` must be a regular file (a symlink to one is fine): reading a FIFO would block forever."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise ValueError(
                f"{setting}: {os.fspath(path)} is a symbolic link to {os.readlink(path)}, which does not exist"
            ) from None
        raise ValueError(f"{setting}: {os.fspath(path)} does not exist") from None
    except OSError as exc:
        raise ValueError(f"{setting}: {os.fspath(path)} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{setting}: {os.fspath(path)} is {_kind(mode)}, not a regular file; name a regular file")


def check_directory_to_write(path: str, setting: str) -> None:
    """`path` must be a directory this process may write into, or one it can make: not a file, not
    under a file, not a dangling symlink, not on a read-only disk."""
    if not path.strip():
        raise ValueError(f"{setting}={path!r} is empty; name a directory")
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(
            f"{setting}={path!r} is a symbolic link to {os.readlink(path)!r}, which does not exist; "
            "create its target or remove the link"
        )
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{setting}={path!r} is a file, not a directory; name a directory (it is made if missing)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(
                f"{setting}={path!r} is not writable ({_why_not_writable(path)}); choose a writable directory"
            )
        return
    ancestor = os.path.abspath(path)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(
            f"{setting}={path!r} cannot be made: {ancestor} is a file, not a directory; choose another path"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(
            f"{setting}={path!r} cannot be made in {ancestor} ({_why_not_writable(ancestor)}); choose a writable place"
        )


ConfigT = TypeVar("ConfigT", bound=OffloadConfig)


def with_real_nvme_dir(config: ConfigT) -> ConfigT:
    """`config` with tiers.nvme_dir resolved through symlinks, for the engine and the machine's measurement.

    A symlink the user named as the swap directory is followed (scratch space often is one), but the
    swap store opens its parent without following links (io_engine/swap_dirs.py, O_NOFOLLOW), so given
    the link it could neither remove its directory at the end nor reclaim dead runs'. The config
    saved and shown keeps the path as the user wrote it."""
    nvme_dir = config.tiers.nvme_dir
    if nvme_dir is None or not os.path.islink(nvme_dir.rstrip(os.sep) or nvme_dir):
        return config
    return dataclasses.replace(config, tiers=dataclasses.replace(config.tiers, nvme_dir=os.path.realpath(nvme_dir)))


def _why_not_writable(path: str) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "its file system is read-only"
    except OSError:
        pass
    return "permission denied"


def check_num_threads(num_threads: Optional[int]) -> None:
    """train.num_threads at most the CPUs this process may use (more only slows torch down, and 100000 crashed it)."""
    cpus = usable_cpus()
    if num_threads is not None and num_threads > cpus:
        raise ValueError(
            f"train.num_threads={num_threads} is more than the {cpus} CPUs this process may run on (its CPU "
            f"affinity: taskset, a cpuset; its cgroup's CPU quota: a container's CPU limit); use at most {cpus}, or leave it out for torch's default"
        )


def io_buffer_bytes(io: IOConfig) -> int:
    """Bytes of the IO engine's bounce buffers, one per worker, allocated (and faulted in) up front."""
    return io.worker_threads() * round_up(io.block_bytes + 2 * io.alignment_bytes, io.alignment_bytes)


def check_io(io: IOConfig, host_budget_bytes: Optional[int]) -> None:
    """io.num_threads and io.block_bytes: the engine's worker threads and their bounce buffers must fit.

    The bounce buffers (one block per worker, allocated and faulted in when the engine starts) are
    checked against the memory available; one block against the host budget, when there is one (a
    block larger than all the host memory the run may hold is a typo). The queue (io.queue_depth)
    allocates nothing: a queued block is a view of the caller's buffer."""
    if io.num_threads is not None and io.num_threads > MAX_IO_THREADS:
        raise ValueError(
            f"io.num_threads={io.num_threads} is more than {MAX_IO_THREADS}, the most this version starts "
            "(each is an OS thread with a bounce buffer of io.block_bytes); 8 to 32 saturate a disk"
        )
    if host_budget_bytes is not None and io.block_bytes > host_budget_bytes:
        raise ValueError(
            f"io.block_bytes={format_bytes(io.block_bytes)} is more than the whole "
            f"tiers.host_budget_bytes={format_bytes(host_budget_bytes)} (each IO worker keeps a bounce buffer of "
            "one block in host memory); lower io.block_bytes (1MiB is the default) or raise the budget"
        )
    need = io_buffer_bytes(io)
    available = memory_available_bytes()
    if need > IO_MEMORY_SHARE_OF_AVAILABLE * available:
        raise ValueError(
            f"io.num_threads={io.worker_threads()} x io.block_bytes={format_bytes(io.block_bytes)} need "
            f"{format_bytes(need)} of IO bounce buffers, allocated up front, more than "
            f"{IO_MEMORY_SHARE_OF_AVAILABLE:.0%} of the {format_bytes(available)} of memory available; lower "
            "io.block_bytes (1MiB is the default) or io.num_threads"
        )


def model_limits(cfg: RunConfig) -> "tuple[Optional[DecoderShape], Optional[int], str]":
    """(shape for the activation estimate or None, longest sequence or None, what the model is called)."""
    if cfg.model.hf_path is None:
        config = DecoderConfig.preset(cfg.model.preset)
        return DecoderShape.from_decoder_config(config), config.max_seq_len, f"the {cfg.model.preset} preset"
    raw = read_hf_config(Path(cfg.model.hf_path) / "config.json", "model.hf_path")
    check_hf_sizes(raw)  # a size given but impossible is refused; sizes left out mean another kind of model
    try:
        shape: Optional[DecoderShape] = DecoderShape.from_hf_config(raw)
    except (ValueError, TypeError):
        shape = None  # not a Llama-style config: no activation estimate
    longest = raw.get("max_position_embeddings")
    longest = longest if isinstance(longest, int) and not isinstance(longest, bool) and longest > 0 else None
    return shape, longest, f"the model in {cfg.model.hf_path}"


def check_seq_len(seq_len: int, longest: Optional[int], model: str, longest_name: str) -> None:
    if longest is not None and seq_len > longest:
        raise ValueError(
            f"data.seq_len={seq_len} is longer than {model} takes ({longest_name}={longest}); "
            f"use data.seq_len {longest} or less"
        )


def micro_batch_memory_problem(
    shape: Optional[DecoderShape], batch_size: int, seq_len: int, dtype_bytes: int, checkpointing: bool, what: str,
    fix: str,
) -> Optional[str]:
    """Why one micro-batch of `batch_size` x `seq_len` tokens cannot fit in the memory available (its
    activations and logits, planning/zero_memory.py's estimate, and its token ids), or None if it can.
    `what` names the two settings ("data.batch_size=8 x data.seq_len=256"); `fix` says what to lower."""
    tokens = batch_size * seq_len
    device = _compute_device()
    acts = 0 if shape is None else activation_bytes(shape, batch_size, seq_len, dtype_bytes, checkpointing, device)
    need = acts + TOKEN_ID_BYTES * tokens
    available = _device_memory_available(device)
    if need <= available:
        return None
    hint = ""
    if shape is not None and not checkpointing:
        with_ckpt = activation_bytes(shape, batch_size, seq_len, dtype_bytes, True, device) + TOKEN_ID_BYTES * tokens
        if with_ckpt <= available:
            hint = f", or turn on activation checkpointing (then about {format_bytes(with_ckpt)})"
    return (
        f"{what} is {tokens:,} tokens per micro-batch, which need about {format_bytes(need)} for activations, "
        f"logits and token ids, more than the {format_bytes(available)} of memory available; {fix}{hint}"
    )


def check_micro_batch_memory(cfg: RunConfig, shape: Optional[DecoderShape], world_size: int) -> None:
    """One rank's micro-batch must fit in the memory available (on a CPU the device's memory is host memory)."""
    batch = max(cfg.data.batch_size // world_size, 1)
    what = f"data.batch_size={cfg.data.batch_size} x data.seq_len={cfg.data.seq_len}" + (
        f" on each of {world_size} ranks" if world_size > 1 else ""
    )
    problem = micro_batch_memory_problem(
        shape, batch, cfg.data.seq_len, cfg.precision.compute_dtype.torch_dtype.itemsize,
        cfg.model.activation_checkpointing, what, "lower data.batch_size or data.seq_len",
    )
    if problem is not None:
        raise ValueError(problem)


def _compute_device() -> torch.device:
    """The device a run computes on by default: the GPU where there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _device_memory_available(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return memory_available_bytes()


def read_hf_config(path: Path, setting: str) -> Dict[str, Any]:
    """A Hugging Face config.json as a dict; ValueError naming the file if it is not one."""
    check_regular_file(path, setting)
    try:
        raw = json_text.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{setting}: {path} is not text (not UTF-8); it must be a Hugging Face config.json") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{setting}: {path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
            "it must be the model's config.json as save_pretrained writes it"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"{setting}: {path} holds a JSON {type(raw).__name__}, not an object; it must be a config.json"
        )
    return raw


def check_safetensors_file(path: Path, setting: str) -> None:
    """A safetensors file's header, checked as the format defines it (check_safetensors_header),
    with the setting that named it. Nothing is loaded."""
    check_regular_file(path, setting)
    try:
        check_safetensors_header(path)
    except ValueError as exc:
        raise ValueError(f"{setting}: {exc}") from None


def check_hf_dir(hf_path: str) -> None:
    """A local Hugging Face model directory: config.json (JSON), *.safetensors (valid headers), and
    tokenizer files that are regular files. The weights are not loaded."""
    path = Path(hf_path)
    setting = "model.hf_path"
    if not path.is_dir():
        what = "does not exist" if not os.path.lexists(path) else "is not a directory"
        raise ValueError(
            f"{setting}={hf_path!r} {what}; name a local Hugging Face model directory{model_download_hint(hf_path)}"
        )
    read_hf_config(path / "config.json", setting)
    weights = hf_weight_files(path, setting)
    if not weights:
        raise ValueError(
            f"{setting}={hf_path!r} has no *.safetensors weights; convert the checkpoint to safetensors "
            "(model.save_pretrained(dir) writes them)"
        )
    for file in weights:
        check_safetensors_file(file, setting)
    for name in os.listdir(path):
        file = path / name
        side_file = name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config"))
        if side_file and os.path.lexists(file):
            check_regular_file(file, setting)


def check_data_path(data_path: Optional[str], out_dir: str) -> None:
    """data.path, when given, is a directory or a regular file (the files under a directory are checked
    as they are read, by data.load_documents), and does not hold train.out_dir: the run's metrics.jsonl
    would be read as part of the corpus by the next run (its resume refused as of different data)."""
    if data_path is None or not os.path.lexists(data_path):
        return  # the default corpus; or missing, which load_documents reports with the fix
    if os.path.isdir(data_path):
        corpus, out = os.path.realpath(data_path), os.path.realpath(out_dir)
        if out == corpus or out.startswith(corpus.rstrip(os.sep) + os.sep):
            raise ValueError(
                f"train.out_dir={out_dir!r} is inside data.path={data_path!r}: the run's metrics.jsonl would become "
                "part of the corpus the next run reads; choose a train.out_dir outside the corpus"
            )
        return
    check_regular_file(data_path, "data.path")


def check_model_outside_run(hf_path: Optional[str], out_dir: str) -> None:
    """model.hf_path is neither train.out_dir itself nor inside what the run in it writes, replaces or
    removes (hf/, adapter/, a checkpoint, a temporary). Fine-tuning a run's own export further in the
    same out_dir with --train.overwrite true removed that export, the model being trained, with the
    run it replaced: the user's only copy of it was gone, and the run failed at its export, after every
    step, naming model.hf_path as missing (a resume of it failed at its start for good). A resume
    with another export removes it the same way, and out_dir as the model's own directory had its
    config.json and model.safetensors taken for the run's."""
    if hf_path is None or not os.path.lexists(hf_path):
        return  # check_hf_dir says it is missing
    model, out = os.path.realpath(hf_path), os.path.realpath(out_dir)
    if model == out:
        raise ValueError(
            f"model.hf_path={hf_path!r} is train.out_dir itself, where offload-train writes its own config.json, "
            "model.safetensors and checkpoints (and --train.overwrite removes them): choose another train.out_dir"
        )
    first = _run_entry_holding(model, out)
    if first is not None:
        raise ValueError(
            f"model.hf_path={hf_path!r} is inside {os.path.join(out_dir, first)}, which the run in "
            f"train.out_dir={out_dir!r} replaces or removes (its export, a resume's stale exports, --train.overwrite): "
            "copy the model out of train.out_dir first, or choose another train.out_dir"
        )


def check_nvme_dir_outside_run(nvme_dir: Optional[str], out_dir: str) -> None:
    """tiers.nvme_dir is not inside what the run in train.out_dir writes, replaces or removes (a
    checkpoint, hf/, adapter/, tensorboard/, a temporary). Under a checkpoint's name, the swap
    directory made that checkpoint's directory before the save; train.keep_last then deleted it with
    the live swap files in it (the run went on only because their descriptors were open), and a
    checkpoint kept was refused at --resume for the directory in it. An export swapped in over hf/
    removes the old one, swap files and all. out_dir itself, or a directory of the user's in it
    (out_dir/swap), is fine: the run touches only the names it writes."""
    if nvme_dir is None:
        return
    first = _run_entry_holding(os.path.realpath(nvme_dir), os.path.realpath(out_dir))
    if first is not None:
        raise ValueError(
            f"tiers.nvme_dir={nvme_dir!r} is inside {os.path.join(out_dir, first)}, which the run in "
            f"train.out_dir={out_dir!r} writes, replaces or removes (a checkpoint train.keep_last deletes, an "
            "export swapped in, --train.overwrite), taking the live swap files with it: choose a tiers.nvme_dir "
            f"outside it, e.g. {os.path.join(out_dir, 'swap')!r}"
        )


def _run_entry_holding(path: str, out: str) -> Optional[str]:
    """The name in the directory `out` (both real paths) that holds `path`, when it is one the run
    there writes, replaces or removes (RUN_FILES, a checkpoint, a temporary); None otherwise."""
    if not path.startswith(out.rstrip(os.sep) + os.sep):
        return None
    first = os.path.relpath(path, out).split(os.sep)[0]
    if first in RUN_FILES or CHECKPOINT_PATTERN.match(first) or TEMP_MARKER in first:
        return first
    return None


def check_checkpoint_files(directory: Path) -> None:
    """A checkpoint's manifest and shard files are regular files (what runtime/persist/checkpoint.py reads)."""
    if not directory.is_dir():
        raise not_a_checkpoint_directory(directory)
    manifest = directory / MANIFEST
    if not os.path.lexists(manifest):
        raise CheckpointError(
            f"{directory} is not a checkpoint: it has no {MANIFEST} (an interrupted save leaves *.tmp-*)"
        )
    check_regular_file(manifest, "--resume")
    for name in os.listdir(directory):
        if name != MANIFEST:
            check_regular_file(directory / name, "--resume")


def resume_path(resume: str, out_dir: Path) -> Path:
    """The checkpoint `--resume` names: a bare name (ckpt-000004) is looked up in train.out_dir first,
    then in the current directory; a path is taken as it is. ValueError if nothing is there."""
    given = Path(resume)
    bare = os.sep not in resume.rstrip(os.sep) and resume not in (".", "..")
    if bare and os.path.lexists(out_dir / resume):
        return out_dir / resume
    if os.path.lexists(given):
        return given
    where = f"neither {out_dir / resume} nor {given.absolute()} exists" if bare else f"{given} does not exist"
    held = checkpoints(out_dir)
    if held:
        known = f"; the checkpoints in {out_dir} are {', '.join(held[-4:])} (or say --resume latest)"
    else:  # --resume latest would be refused too: the way on is a fresh run
        known = f"; {out_dir} has no checkpoint (start without --resume, or say --resume auto)"
    raise ValueError(f"--resume {resume}: {where}{known}")


def _wrong_kind(path: Path, directory: bool) -> Optional[str]:
    """What is at `path` if it exists but is not what offload-train writes there (a directory, or a
    regular file); None otherwise."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if directory and not stat.S_ISDIR(mode):
        return f"{'a file' if stat.S_ISREG(mode) else _kind(mode)} where offload-train writes a directory"
    if not directory and not stat.S_ISREG(mode):
        return f"{_kind(mode)} where offload-train writes a file"
    return None


RESUME_AUTO = "auto"
"""`--resume auto`: continue the run in train.out_dir if it has a checkpoint, else start one (over
what this same run left before its first checkpoint, if anything: started_before(cfg))."""

_PLANNED = (("placement",), ("tiers", "params"), ("tiers", "grads"), ("tiers", "optimizer"), ("prefetch", "lookahead_groups"))
"""What config.json holds as the planner chose it under placement = "auto" (trainer.resolved_config)."""


def started_before(cfg: RunConfig) -> bool:
    """Whether train.out_dir holds only what a run of this same config wrote before its first checkpoint
    (config.json, the metrics, plan, traces, TensorBoard files; no checkpoint, `latest` or export): a job
    killed (preempted) before its first save. --resume auto starts it over; it refused the directory as
    another run's, so a preemptible job's retries failed for good while its first attempt had saved
    nothing yet. Another config's files are still refused (a fresh run never replaces them unasked).
    config.json holds the path settings absolute (Trainer._prepare_out_dir); one an earlier version wrote
    holds them as given, and counts as this run's when they are given the same way."""
    out_dir = Path(cfg.train.out_dir)
    written_first = {CONFIG, METRICS, TRACE, PLAN, TENSORBOARD}
    held = [name for name in run_contents(out_dir) if not RANK_TRACE_PATTERN.match(name)]
    if CONFIG not in held or not set(held) <= written_first:
        return False
    try:
        saved = json_text.loads((out_dir / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(saved, dict):
        return False
    written, as_given = json.loads(cfg.with_absolute_paths().to_json()), json.loads(cfg.to_json())
    if cfg.placement is PlacementMode.AUTO:
        for table in (saved, written, as_given):
            for *section, key in _PLANNED:
                inner = table
                for name in section:
                    inner = inner.get(name) if isinstance(inner, dict) else None
                if isinstance(inner, dict):
                    inner.pop(key, None)
    return saved in (written, as_given)


def check_run_dir(cfg: RunConfig, resume: Optional[str]) -> Optional[Path]:
    """The out_dir's state against what was asked: the checkpoint to resume from (None: a fresh run)."""
    out_dir = Path(cfg.train.out_dir)
    if resume is not None and cfg.train.overwrite:
        raise ValueError(
            "--train.overwrite true removes the run that --resume would continue: drop one of them"
        )
    starting_over = False
    if replacement_interrupted(out_dir) and not cfg.train.overwrite:
        # Whatever is left of it (checkpoints that look complete, an export) is not to be continued.
        raise ValueError(
            f"train.out_dir={cfg.train.out_dir!r} holds a run whose removal by --train.overwrite was interrupted "
            f"({out_dir / REPLACING} is there): pass --train.overwrite true to finish replacing it"
            + (" (without --resume)" if resume is not None else "")
        )
    if resume == RESUME_AUTO:
        # One command for a first start and every retry (a preemptible job): "latest" once a
        # checkpoint was written (or `latest` names one), else a fresh run with a fresh run's checks.
        resume = LATEST if complete_checkpoints(out_dir) or os.path.lexists(out_dir / LATEST) else None
        # What this run left before its first checkpoint: the trainer removes it, as train.overwrite would.
        starting_over = resume is None and started_before(cfg)
    if not cfg.train.overwrite:
        # The checkpoints too: a symlink (a loop ended a resumed run's save in a traceback) or a file at a
        # checkpoint's name was renamed aside when the run reached that step, and then removed with the run's
        # temporaries.
        for name in [*RUN_FILES, *checkpoints(out_dir)]:
            if os.path.islink(out_dir / name):
                raise ValueError(
                    f"{out_dir / name} is a symbolic link; offload-train never writes through one: remove it "
                    "(or pass --train.overwrite true, which removes it with the rest of the run)"
                )
            # Found now, not when it is written (the export: at the end of the run).
            wrong = _wrong_kind(out_dir / name, directory=name not in REGULAR_RUN_FILES)
            if wrong is not None:
                raise ValueError(
                    f"{out_dir / name} is {wrong}: remove or rename it (or pass --train.overwrite true, which "
                    "removes it with the rest of the run)"
                )
    if resume is None:
        held = run_contents(out_dir)
        if held and not cfg.train.overwrite and not starting_over:
            shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
            if checkpoints(out_dir):
                raise ValueError(
                    f"train.out_dir={cfg.train.out_dir!r} holds another run ({shown}): say --resume latest "
                    "to continue it, or pass --train.overwrite true to replace it"
                )
            raise ValueError(
                f"train.out_dir={cfg.train.out_dir!r} holds another run that has no checkpoint ({shown}): pass "
                "--train.overwrite true to replace it, or choose another train.out_dir"
            )
        return None
    if resume == LATEST:
        name = latest_checkpoint(out_dir)
        if name is None:
            elsewhere = latest_resumed_from(out_dir)
            if elsewhere is not None:  # a run resumed from another directory, stopped before its first save
                raise ValueError(
                    f"--resume latest: the run in {out_dir} continues {elsewhere} (it resumed from there and "
                    f"stopped before its first checkpoint): resume it with --resume {elsewhere}"
                )
            complete = complete_checkpoints(out_dir)
            if complete:  # `latest` names none: made empty while the checkpoint it named is replaced
                raise ValueError(
                    f"--resume latest: no {LATEST} file in {out_dir} names a complete checkpoint, but it holds "
                    f"{len(complete)} ({', '.join(complete[-3:])}): resume from the newest with --resume {complete[-1]}"
                )
            if os.path.lexists(out_dir / LATEST):
                raise ValueError(
                    f"--resume latest: {out_dir / LATEST} does not name a complete checkpoint in {out_dir}; "
                    "pass --resume with a checkpoint directory instead"
                )
            raise ValueError(
                f"--resume latest: {out_dir} has no checkpoint yet (no {LATEST} file); start without --resume"
                + (" and with --train.overwrite true, which replaces what it holds" if run_contents(out_dir) else "")
            )
        checkpoint = out_dir / name
    else:
        if not resume.strip():
            raise ValueError("--resume '' is empty: give 'latest' or a checkpoint directory")
        checkpoint = resume_path(resume, out_dir)
    check_checkpoint_files(checkpoint)
    return checkpoint


def check_sequences_per_step(cfg: RunConfig, num_train_sequences: int) -> None:
    """One optimizer step's sequences (data.batch_size x grad_accum_steps, over every rank) are at most
    the corpus's training sequences. Past them a step sees some sequences twice or more (the batch
    order runs on into the next epochs): a mistake, not a setting (grad_accum_steps=100000 ran one step
    over the same few hundred sequences for minutes without a line, nothing saying why)."""
    per_step = cfg.data.batch_size * cfg.grad_accum_steps
    if per_step <= num_train_sequences:
        return
    if cfg.data.batch_size <= num_train_sequences:
        fix = f"lower grad_accum_steps to at most {num_train_sequences // cfg.data.batch_size}"
    else:
        fix = f"lower data.batch_size to at most {num_train_sequences} (with grad_accum_steps=1)"
    raise ValueError(
        f"one optimizer step takes data.batch_size={cfg.data.batch_size} x grad_accum_steps={cfg.grad_accum_steps} = "
        f"{per_step} sequences, but the corpus gives {num_train_sequences} training sequences of "
        f"data.seq_len={cfg.data.seq_len}, so each step would see sequences more than once: {fix}, or give more data"
    )


def check_batch_over_ranks(batch_size: int, world_size: int) -> None:
    """data.batch_size is the global micro-batch: each of the ranks takes an equal share of its rows."""
    if batch_size % world_size:
        raise ValueError(f"data.batch_size={batch_size} must be a multiple of the {world_size} ranks")


def check_run(cfg: RunConfig, resume: Optional[str], world_size: int) -> Optional[Path]:
    """Everything offload-train can check before building the model; returns the checkpoint to resume
    from (None: a fresh run). Raises ValueError (or CheckpointError) naming the setting and the fix."""
    check_batch_over_ranks(cfg.data.batch_size, world_size)
    check_directory_to_write(cfg.train.out_dir, "train.out_dir")
    if cfg.tiers.nvme_dir is not None:
        check_directory_to_write(cfg.tiers.nvme_dir, "tiers.nvme_dir")
    check_nvme_dir_outside_run(cfg.tiers.nvme_dir, cfg.train.out_dir)
    check_data_path(cfg.data.path, cfg.train.out_dir)
    if cfg.model.hf_path is not None:
        check_hf_dir(cfg.model.hf_path)
        check_model_outside_run(cfg.model.hf_path, cfg.train.out_dir)
    shape, longest, model = model_limits(cfg)
    longest_name = "max_seq_len" if cfg.model.hf_path is None else "max_position_embeddings"
    check_seq_len(cfg.data.seq_len, longest, model, longest_name)
    check_num_threads(cfg.train.num_threads)
    check_io(cfg.io, cfg.tiers.host_budget_bytes)
    check_micro_batch_memory(cfg, shape, world_size)
    return check_run_dir(cfg, resume)


def path_roles(cfg: RunConfig, config_path: Optional[str] = None) -> List[PathRole]:
    """Which setting each of the run's paths comes from, for messages about them."""
    roles = [PathRole(cfg.train.out_dir, "train.out_dir")]
    if cfg.tiers.nvme_dir is not None:
        roles.append(PathRole(cfg.tiers.nvme_dir, "tiers.nvme_dir"))
    if cfg.data.path is not None:
        roles.append(PathRole(cfg.data.path, "data.path"))
    if cfg.model.hf_path is not None:
        roles.append(PathRole(cfg.model.hf_path, "model.hf_path"))
    if config_path is not None:
        roles.append(PathRole(config_path, "--config"))
    return roles


def check_micro_batch_order(cfg: RunConfig, restarts_positions: bool) -> None:
    """The layer-major step gives the model its input ids alone (models/hf_block_stack.py runs the base
    model as `model(input_ids)` does, with the config's key/value cache), so the position ids that keep
    chat data's packed conversations apart (packed_dataset.Batch) cannot reach it: refused, not trained
    on other attention than the micro-batch-major step's."""
    if restarts_positions and cfg.train.micro_batch_order is MicroBatchOrder.LAYER_MAJOR:
        raise ValueError(
            'train.micro_batch_order="layer_major" cannot keep the conversations of chat data apart (its step '
            "gives the model no position ids, so the conversations packed into a sequence would attend to each "
            'other): set train.micro_batch_order = "micro_batch_major" for chat data'
        )
