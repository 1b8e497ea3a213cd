"""A run's directory (train.out_dir): what it holds, which checkpoint is the newest, and its upkeep.

    out_dir/
      config.json        the resolved config (written once everything is validated)
      metrics.jsonl      one JSON object per step, appended (open_append: never through a symlink)
      ckpt-NNNNNN/       checkpoints (runtime/persist/checkpoint.py), never overwritten in place
      latest             the name of the newest complete checkpoint, replaced atomically after each save;
                         empty (naming none) while the checkpoint it named is replaced, or naming the
                         checkpoint of another directory a run resumed from until its first save; missing only
                         between a run's first checkpoint and its first write (then that checkpoint,
                         the newest complete one, is the run's latest)
      model.safetensors  or hf/: the export at the end; trace.json: a traced step (trace-rank{r}.json
                         per rank with several ranks); plan.txt: the planner's table (placement = "auto")
      tensorboard/       the TensorBoard event files (train.loggers = ["jsonl", "tensorboard"])
      replacing          only while train.overwrite removes the run before (remove_run): a kill there
                         leaves it, and no checkpoint of the half-removed run is offered for resuming

Every file here is created through io_engine/atomic_file.py. What a killed writer leaves is named
`*.tmp-*` (a checkpoint's temporary directory, an atomic file's temporary name, an export
directory's new or replaced version: hf/ and adapter/ are written whole through
io_engine/atomic_dir.py), and is removed by the next run, or by this one on its way out
(remove_new_temporaries).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Iterable, List, Optional, Set

from io_engine.atomic_file import TEMP_MARKER, atomic_open, fsync_dir, open_append, temporary_name, write_atomic

from offload_trainer.config import json_text

LATEST = "latest"
"""File naming the newest complete checkpoint (written after it is in place)."""
CONFIG = "config.json"
METRICS = "metrics.jsonl"
TRACE = "trace.json"
PLAN = "plan.txt"
"""The planner's table, under placement = "auto" (config.json holds the placement it chose)."""
TENSORBOARD = "tensorboard"
EXPORTS = ("model.safetensors", "hf", "adapter")
"""What the export at the end writes (the built-in decoder's file; a Hugging Face model's directory; LoRA adapters)."""
REPLACING = "replacing"
"""Written first by remove_run and removed last: while it exists, out_dir holds a run being replaced."""
CHECKPOINT_PATTERN = re.compile(r"^ckpt-(\d{6,})$")
MANIFEST = "manifest.json"

RUN_FILES = (LATEST, CONFIG, METRICS, TRACE, PLAN, TENSORBOARD, *EXPORTS, REPLACING)
"""Names (besides ckpt-*) that make a directory hold a run; the files offload-train writes there."""
REGULAR_RUN_FILES = (LATEST, CONFIG, METRICS, TRACE, PLAN, EXPORTS[0], REPLACING)
"""Those of RUN_FILES that are regular files (the others are directories)."""


RANK_TRACE_PATTERN = re.compile(r"^trace-rank\d+\.json$")


def trace_name(rank: int, world_size: int) -> str:
    """The trace file of one rank: trace.json alone, trace-rank{r}.json with several ranks."""
    return TRACE if world_size == 1 else f"trace-rank{rank}.json"


def rank_traces(out_dir: Path) -> List[str]:
    """Names of the per-rank trace files in `out_dir`."""
    if not out_dir.is_dir():
        return []
    return sorted(n for n in os.listdir(out_dir) if RANK_TRACE_PATTERN.match(n))


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def checkpoint_step(name: str) -> int:
    """The step of the checkpoint named `name` (ckpt-NNNNNN); ValueError for another name."""
    found = CHECKPOINT_PATTERN.match(name)
    if found is None:
        raise ValueError(f"{name!r} is not a checkpoint's name (ckpt-NNNNNN)")
    return int(found.group(1))


def checkpoints(out_dir: Path) -> List[str]:
    """Names of the checkpoint directories in `out_dir`, complete or not, oldest step first."""
    if not out_dir.is_dir():
        return []
    return sorted((n for n in os.listdir(out_dir) if CHECKPOINT_PATTERN.match(n)), key=lambda n: (checkpoint_step(n), n))


def replacement_interrupted(out_dir: Path) -> bool:
    """Whether train.overwrite's removal of the run in `out_dir` was interrupted (REPLACING is there):
    what is left of that run is never resumed, only removed by the next run with train.overwrite."""
    return os.path.lexists(out_dir / REPLACING)


def complete_checkpoints(out_dir: Path) -> List[str]:
    """Names of the checkpoints in `out_dir` that have their manifest (a save completed), oldest step
    first; none while a replaced run is half removed (replacement_interrupted)."""
    if replacement_interrupted(out_dir):
        return []
    return [name for name in checkpoints(out_dir) if os.path.isfile(out_dir / name / MANIFEST)]


def run_contents(out_dir: Path) -> List[str]:
    """What in `out_dir` belongs to a run (empty: the directory holds none, or does not exist)."""
    if not out_dir.is_dir():
        return []
    names = set(os.listdir(out_dir))
    return [n for n in RUN_FILES if n in names] + rank_traces(out_dir) + checkpoints(out_dir)


def latest_checkpoint(out_dir: Path) -> Optional[str]:
    """The newest checkpoint of the run in `out_dir`: the one `latest` names, if that file names a
    complete checkpoint of `out_dir` (a name ckpt-NNNNNN, never a path); without any `latest` file, the
    newest complete checkpoint; else None (`latest` names none: point_latest_nowhere).

    A run killed (or refused `latest` by a full disk) between its first checkpoint's rename into place
    and `latest`'s first write left a complete checkpoint and no `latest`: --resume auto and latest
    refused the directory, so a preemptible job's one command failed on every retry. Only then is
    `latest` missing: it is replaced atomically, and made empty, never removed, while the checkpoint
    it named is replaced (a run gone back to an earlier step, or from another directory)."""
    if replacement_interrupted(out_dir):
        return None
    pointer = out_dir / LATEST
    try:
        if not stat.S_ISREG(os.lstat(pointer).st_mode):
            return None
        name = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        complete = complete_checkpoints(out_dir)
        return complete[-1] if complete else None
    except (OSError, UnicodeDecodeError):
        return None
    if not CHECKPOINT_PATTERN.match(name):  # only a checkpoint of out_dir: never "../other/ckpt-..." or a path
        return None
    return name if os.path.exists(out_dir / name / MANIFEST) else None


def point_latest(out_dir: Path, name: str) -> None:
    """Make `latest` name checkpoint `name` (atomically: a kill leaves the old name or the new one)."""
    write_atomic(out_dir / LATEST, name)


RESUMED_FROM = "resumed from "
"""How `latest` begins when it names no checkpoint of out_dir because the run there continues one of
another directory (point_latest_nowhere): the absolute path of that checkpoint follows."""


def point_latest_nowhere(out_dir: Path, resumed_from: Optional[Path] = None) -> None:
    """Make `latest` name no checkpoint of out_dir (written atomically), before the checkpoint it
    named is replaced or left behind. Removed instead, it read as a run killed before its first
    `latest`, whose newest complete checkpoint is resumed (latest_checkpoint).

    `resumed_from`: the checkpoint of another directory that the run in out_dir continues, kept in
    `latest` (RESUMED_FROM and its absolute path; empty without one) until the run's first save names
    its own. A run resumed from another directory and killed before that save left an empty `latest`,
    and --resume latest then named out_dir's newest checkpoint, of the run it had replaced (whose
    metrics were gone), as the way on; it now names the one this run continued (latest_resumed_from),
    and is never followed there unasked: `latest` names no path."""
    text = "" if resumed_from is None else f"{RESUMED_FROM}{os.path.abspath(resumed_from)}\n"
    write_atomic(out_dir / LATEST, text.encode("utf-8"))


def latest_resumed_from(out_dir: Path) -> Optional[Path]:
    """The checkpoint of another directory that `latest` says the run in out_dir continues, before that
    run's first save (point_latest_nowhere), else None."""
    pointer = out_dir / LATEST
    try:
        if not stat.S_ISREG(os.lstat(pointer).st_mode):
            return None
        text = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not text.startswith(RESUMED_FROM):
        return None
    path = Path(text[len(RESUMED_FROM):])
    return path if path.is_absolute() else None


def temporaries(out_dir: Path) -> Set[str]:
    """Names of what interrupted writers left in `out_dir` (`*.tmp-*`): a checkpoint's temporary
    directory, an atomic file's temporary name, an export directory's new or replaced version
    (io_engine/atomic_dir.py: an export directory is written beside its name, so nothing partial is
    ever inside it)."""
    if not out_dir.is_dir():
        return set()
    return {name for name in os.listdir(out_dir) if TEMP_MARKER in name}


def remove_entries(out_dir: Path, names: Iterable[str]) -> None:
    """Remove these entries of `out_dir` (paths relative to it): directories with their contents,
    files and symlinks themselves (a symlink is unlinked, never followed).

    A directory is first renamed to a temporary name (`*.tmp-*`), then removed: a kill during its
    removal leaves a temporary that the next run removes, never a checkpoint (or an export
    directory) that looks complete and is not. train.overwrite's removal of the replaced run once
    left a checkpoint with its manifest and without its shards, which the interrupted run's last line
    then said to resume from (keep_last renamed aside already; it now calls this). The rename is made
    durable (fsync of out_dir) before anything inside goes: a power loss may otherwise keep the
    removal of its files and lose the rename, which no kill test sees (io_engine/atomic_dir.py's
    replace_dir does the same before it removes the version it replaced)."""
    for name in names:
        path = out_dir / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            if TEMP_MARKER not in path.name:
                aside = temporary_name(path)
                os.rename(path, aside)
                path = aside
            fsync_dir(out_dir)  # this rename, or the earlier one that named the temporary (a displaced checkpoint)
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def remove_new_temporaries(out_dir: Path, before: Set[str]) -> None:
    """Remove the `*.tmp-*` entries that were not in `out_dir` when the run started: what this run's
    interrupted save or write left. Never raises (it runs while an error or a signal unwinds)."""
    try:
        remove_entries(out_dir, sorted(temporaries(out_dir) - before))
    except OSError:
        pass


def remove_run(out_dir: Path) -> None:
    """Remove the run `out_dir` holds (train.overwrite). Other files are left alone.

    REPLACING is written first and removed last: a kill part-way (or a full disk) left some of the
    replaced run's checkpoints complete and its export in place, and the next start offered that
    run's checkpoint for resuming (--resume auto resumed it) beside an export of weights that were
    being thrown away. While REPLACING is there no checkpoint counts as complete and `latest` names
    none. Then `latest` goes, so that no pointer ever names a checkpoint being removed, the export
    (never left beside a new run's checkpoints), the checkpoints, and the metrics, config, traces,
    plan and TensorBoard files."""
    held = [name for name in run_contents(out_dir) if name != REPLACING]
    if not held:
        remove_entries(out_dir, [REPLACING])
        return
    write_atomic(out_dir / REPLACING, b"")  # empty: made even on a full disk, which is often why a run is replaced
    remove_entries(out_dir, [LATEST, *EXPORTS])
    remove_entries(out_dir, checkpoints(out_dir))
    remove_entries(out_dir, [METRICS, CONFIG, TRACE, PLAN, TENSORBOARD, *rank_traces(out_dir)])
    remove_entries(out_dir, [REPLACING])


def remove_first_start(out_dir: Path) -> None:
    """Remove what a run wrote before its first checkpoint, which --resume auto starts over
    (run_checks.started_before), config.json last: a kill part-way leaves it, so the same command
    starts over again. No REPLACING (remove_run's marker): there is no checkpoint or export to keep
    from being offered, and a marker left by a kill here made every retry of --resume auto refuse
    the directory until someone passed --train.overwrite true."""
    remove_entries(out_dir, [METRICS, TRACE, PLAN, TENSORBOARD, *rank_traces(out_dir)])
    remove_entries(out_dir, [CONFIG])


def truncate_metrics(out_dir: Path, last_step: int) -> None:
    """Keep the metrics of steps up to `last_step` (a resumed checkpoint's step): the steps after it
    ran in a run that was stopped before its next checkpoint and run again now. Atomic."""
    path = out_dir / METRICS
    if not os.path.lexists(path):
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    new = _rows_up_to(text, last_step)
    if new != text:
        write_atomic(path, new)


def take_metrics(out_dir: Path, source_dir: Path, last_step: int) -> None:
    """A run resumed from a checkpoint of another directory (`source_dir`): out_dir's metrics become that
    run's, its rows up to `last_step` (none where `source_dir` has no metrics.jsonl, a checkpoint copied
    alone). What out_dir's metrics held was another run's history: truncate_metrics kept its rows up to
    the resumed step, so the file told two runs' steps as one. Atomic."""
    source = source_dir / METRICS
    text = source.read_text(encoding="utf-8", errors="replace") if source.is_file() else ""
    path = out_dir / METRICS
    new = _rows_up_to(text, last_step)
    if new or os.path.lexists(path):
        write_atomic(path, new)


def _rows_up_to(text: str, last_step: int) -> str:
    """The lines of a metrics.jsonl text whose step is at most `last_step`, each ended with a newline."""
    kept = []
    for line in text.splitlines():
        try:
            record = json_text.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            kept.append(line + "\n")
    return "".join(kept)


def open_metrics(out_dir: Path):  # -> IO[str]
    """metrics.jsonl, opened to append (made if missing); a symlink there is refused (OSError ELOOP)."""
    return open_append(out_dir / METRICS)


def copy_atomic(source: Path, target: Path) -> None:
    """Copy the file `source` to `target` through atomic_file: a symlink planted at `target` is replaced,
    never written through (shutil.copy2 would follow it), and a kill leaves no torn copy."""
    with open(source, "rb") as src, atomic_open(target) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)


__all__ = [
    "copy_atomic",
    "CONFIG",
    "EXPORTS",
    "LATEST",
    "METRICS",
    "REGULAR_RUN_FILES",
    "RUN_FILES",
    "PLAN",
    "RANK_TRACE_PATTERN",
    "TENSORBOARD",
    "TRACE",
    "rank_traces",
    "trace_name",
    "checkpoint_name",
    "checkpoint_step",
    "checkpoints",
    "complete_checkpoints",
    "latest_checkpoint",
    "open_metrics",
    "point_latest",
    "point_latest_nowhere",
    "latest_resumed_from",
    "remove_entries",
    "remove_first_start",
    "remove_new_temporaries",
    "remove_run",
    "REPLACING",
    "replacement_interrupted",
    "run_contents",
    "temporaries",
    "truncate_metrics",
]
