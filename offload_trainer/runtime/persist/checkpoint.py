"""Checkpoints of an engine: every rank's shards of every state kind, streamed, atomic, checksummed.

    engine.save_checkpoint("runs/ckpt-000100", extra={"data_position": 1234})
    extra = engine.load_checkpoint("runs/ckpt-000100")   # same model; any number of ranks

Layout of a checkpoint directory:

    manifest.json      format, world size, config, the model's parameters (name, shape, group,
                       offset), `state` (the engine's state shared by every rank: step, loss scale,
                       recorded order), `extra`, `written_by` (the versions of offload-trainer and
                       torch that saved it: for a bug report, not checked), and per rank its shard
                       file, its own `state` (the optimizer's update counts) and one record per
                       (group, state kind): byte offset, element range in the group's flat layout,
                       dtype, CRC32
    rank00000.bin ...  each rank's shards, one after another
    buffers.safetensors  the model's persistent buffers (BatchNorm's running statistics, what
                       `model.state_dict()` holds besides parameters), rank 0's; its CRC32 in the
                       manifest (`buffers`); absent for a model without any

This module knows shards and files, not the engine: the engine hands it its groups (`Shards`) and
its small state as plain dicts (each stateful component's state_dict()), and loads them back with
load_state_dict(). Saving writes into `<name>.tmp-<random>` next to the target (one name all ranks
agree on), fsyncs every file and the directory, then renames it to the target: a kill at any
instant leaves either no checkpoint or a complete one, and never touches an existing checkpoint
(saving over one is refused). A save that fails or is interrupted (an exception, Ctrl-C) removes
its temporary directory, each rank its own files in it (_remove_own_part); one a SIGKILL left is
offload-train's next run's to remove (`*.tmp-*`). Loading checks the manifest against the model
and verifies every record's checksum before it changes any state, so a corrupted or foreign
checkpoint is refused with the engine untouched.

Shards are stored in flat-layout coordinates, which do not depend on the number of ranks (only
the padding at the end of each group does), so a checkpoint saved by N ranks loads on M: each
rank reads the element ranges of its new shard from whichever saved shards cover them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import safetensors.torch
import torch

from io_engine import aligned_empty
from io_engine.atomic_file import fsync_dir, make_dirs, open_exclusive, temporary_prefix
from io_engine.sequential_file import SequentialFile

from offload_trainer.config import json_text
from offload_trainer.errors import CheckpointError, NonFiniteError, PartialStateError
from offload_trainer.runtime.collectives import Collectives
from offload_trainer.runtime.groups.homes import Home
from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.groups.tiers import MemoryTiers
from offload_trainer.version import __version__

FORMAT = 2
MANIFEST = "manifest.json"
BUFFERS = "buffers.safetensors"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Shards:
    """What a checkpoint streams: every group's homes on this rank, where they live, and the ranks."""

    groups: Sequence[ShardGroup]
    tiers: MemoryTiers
    collectives: Collectives

    def saved_homes(self, group: ShardGroup) -> List[Tuple[str, Home, int]]:
        """(kind, home, first element in flat coordinates) of every state kind saved for a group:
        the parameters and the optimizer states; gradients are never saved (a step ends without them)."""
        out: List[Tuple[str, Home, int]] = [("param", group.param_home, group.shard_start)]
        for name, home in group.optimizer_homes.items():
            out.append((name, home, group.shard_start))
        return out

    def staging(self) -> torch.Tensor:
        """A page-aligned host buffer that holds the largest home."""
        largest = max((home.nbytes for g in self.groups for _, home, _ in self.saved_homes(g)), default=1)
        return aligned_empty(max(largest, 1))


@dataclass(frozen=True)
class _Record:
    """One state kind of one group in one rank's file."""

    group: int
    kind: str
    """"param" or an optimizer state's name."""
    start: int
    """First element, in the group's flat coordinates (trainable coordinates for optimizer states)."""
    numel: int
    dtype: str
    offset: int
    """Byte offset in the rank's file."""
    crc32: int

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Loaded:
    """What load() read besides the shards: the engine's shared state, each saved rank's own state, and `extra`."""

    shared_state: Dict[str, Any]
    rank_states: List[Dict[str, Any]]
    extra: Dict[str, Any]


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.bin"


def _rank_part_file(rank: int) -> str:
    """A rank's records and state during a save, which rank 0 folds into the manifest."""
    return f"rank{rank:05d}.json"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def save(
    directory: "str | os.PathLike[str]",
    shards: Shards,
    shared_state: Dict[str, Any],
    rank_state: Dict[str, Any],
    header: Dict[str, Any],
    extra: Dict[str, Any],
    buffers: Optional[Dict[str, torch.Tensor]] = None,
) -> Path:
    """Write a complete checkpoint to `directory` (which must not exist). Collective.

    `shared_state`: state every rank holds alike (rank 0's is saved); `rank_state`: this rank's own;
    `header`: what identifies the run (config, model layout), saved in the manifest as is;
    `buffers`: the model's persistent buffers by name (rank 0's are saved)."""
    target = Path(directory)
    if target.exists():
        raise ValueError(f"{target} exists; checkpoints are never overwritten: choose a new directory")
    _check_extra(extra)
    coll = shards.collectives
    tmp = target.with_name(f"{temporary_prefix(target)}{_shared_token(coll)}")  # within the name length limit
    try:
        _write(tmp, target, shards, shared_state, rank_state, header, extra, buffers)
    except BaseException:
        _remove_own_part(tmp, coll.rank)
        raise
    return target


def _check_extra(extra: object) -> None:
    """TypeError unless `extra` is a dict that JSON holds, before anything is written: a list was saved
    and then the checkpoint refused by load() ("the manifest lacks 'extra'"), an object or a tensor
    failed half-way through the save."""
    if not isinstance(extra, dict):
        raise TypeError(f"extra={extra!r} must be a dict (of what JSON holds: numbers, strings, lists, dicts), "
                        f"not a {type(extra).__name__}: pass extra={{'key': value}}")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"extra cannot be saved in the manifest ({exc}): give numbers, strings, lists and dicts only "
            "(a tensor as tensor.tolist(), or in the model's state)"
        ) from None


def _remove_own_part(tmp: Path, rank: int) -> None:
    """After a failed or interrupted save: this rank's files in the temporary directory, and the
    directory once it is empty. Never another rank's files: a rank interrupted alone (a signal to
    one process) removed the whole directory while its peers still wrote into it, and they failed
    with "No such file or directory", blaming train.out_dir, instead of finding the rank gone at
    their next collective. The last rank out removes the directory. Never raises."""
    own = [_rank_file(rank), _rank_part_file(rank)] + ([MANIFEST, BUFFERS] if rank == 0 else [])
    for name in own:
        try:
            os.unlink(tmp / name)
        except OSError:
            pass
    try:
        os.rmdir(tmp)
    except OSError:
        pass  # gone, or a peer's files are still there: that peer removes it when it fails too


def _write(
    tmp: Path, target: Path, shards: Shards, shared_state: Dict[str, Any], rank_state: Dict[str, Any],
    header: Dict[str, Any], extra: Dict[str, Any], buffers: Optional[Dict[str, torch.Tensor]],
) -> None:
    """save()'s work: every rank's files into `tmp`, then rank 0's manifest and the rename to `target`;
    returns once every rank is done."""
    coll = shards.collectives
    if coll.rank == 0:
        try:
            make_dirs(tmp.parent)
            tmp.mkdir()
        except OSError as exc:  # mkdir named the temporary, a name the caller never gave: the target instead
            named = os.fspath(target) if exc.filename in (None, os.fspath(tmp)) else exc.filename  # a parent: kept
            raise type(exc)(exc.errno, exc.strerror, named) from None
    coll.barrier()
    buf = shards.staging()
    records: List[_Record] = []
    nonfinite: List[str] = []
    # Made again if rank 0, interrupted, removed it empty before this rank's file was in it: this rank
    # then finds rank 0 gone at its next collective, not the directory gone (_remove_own_part).
    tmp.mkdir(exist_ok=True)
    # Failures name the file as it will be in `target` (the temporary directory is gone by the time the
    # user reads the line), with the offset and size of the write that failed (a full disk).
    with SequentialFile(open_exclusive(tmp / _rank_file(coll.rank)), target / _rank_file(coll.rank)) as f:
        offset = 0
        for group in shards.groups:
            for kind, home, start in shards.saved_homes(group):
                data = buf.view(torch.uint8)[: home.nbytes].view(home.dtype)
                home.read(shards.tiers, data)
                if not bool(torch.isfinite(data).all()):
                    nonfinite.append(f"group {group.plan.name!r} {kind}")
                raw = data.view(torch.uint8).numpy()
                f.write(memoryview(raw))
                records.append(
                    _Record(group.index, kind, start, home.numel, _dtype_name(home.dtype), offset, zlib.crc32(raw))
                )
                offset += home.nbytes
        f.fsync()
    if not coll.all_true(not nonfinite):  # save() removes every rank's files
        where = f": {', '.join(nonfinite[:4])} hold inf or nan" if nonfinite else " on another rank"
        raise NonFiniteError(
            f"{target} was not written: the training state is not finite{where}; a checkpoint is never saved "
            "from a non-finite state (resume from the last good checkpoint, with a lower learning rate or clipping)"
        )
    part = {"file": _rank_file(coll.rank), "records": [r.as_dict() for r in records], "state": rank_state}
    with SequentialFile(open_exclusive(tmp / _rank_part_file(coll.rank)), target / _rank_part_file(coll.rank)) as f:
        f.write(json.dumps(part).encode("utf-8"))
        f.flush()
    coll.barrier()
    if coll.rank == 0:
        ranks = [json.loads((tmp / _rank_part_file(r)).read_text(encoding="utf-8")) for r in range(coll.world_size)]
        manifest = {
            "format": FORMAT, "world_size": coll.world_size, **header, "state": shared_state, "ranks": ranks,
            "extra": extra, "written_by": {"offload_trainer": __version__, "torch": torch.__version__},
        }
        if buffers:
            manifest["buffers"] = {"file": BUFFERS, "crc32": _write_buffers(tmp / BUFFERS, target / BUFFERS, buffers)}
        manifest["checksum"] = _manifest_checksum(manifest)
        with SequentialFile(open_exclusive(tmp / MANIFEST), target / MANIFEST) as f:
            f.write(json.dumps(manifest).encode("utf-8"))
            f.fsync()
        for r in range(coll.world_size):
            (tmp / _rank_part_file(r)).unlink()
        fsync_dir(tmp)
        os.rename(tmp, target)
        fsync_dir(target.parent)
    coll.barrier()


def _write_buffers(path: Path, named: Path, buffers: Dict[str, torch.Tensor]) -> int:
    """The buffers as one safetensors file at `path` (any dtype: num_batches_tracked is int64), fsynced;
    its CRC32. Failures name `named` (where it will be)."""
    data = safetensors.torch.save({name: b.detach().cpu().contiguous() for name, b in buffers.items()})
    with SequentialFile(open_exclusive(path), named) as f:
        f.write(data)
        f.fsync()
    return zlib.crc32(data)


def _read_buffers(manifest: Dict[str, Any], directory: Path, live: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The saved buffers, checked (CRC32, and the names, shapes and dtypes of the model's `live`
    buffers) before anything is loaded; none for a checkpoint saved without any."""
    entry = manifest.get("buffers")
    if entry is None:
        return {}
    path = directory / BUFFERS
    if not isinstance(entry, dict) or entry.get("file") != BUFFERS or not isinstance(entry.get("crc32"), int):
        raise CheckpointError(f"{directory / MANIFEST} is corrupted: its buffers entry is {entry!r}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    if zlib.crc32(data) != entry["crc32"]:
        raise CheckpointError(f"{path} is corrupted: it fails its checksum")
    saved = safetensors.torch.load(data)
    if sorted(saved) != sorted(live):
        raise CheckpointError(
            f"{directory} is a checkpoint of another model: its buffers {sorted(saved)[:4]} meet this model's "
            f"{sorted(live)[:4]}"
        )
    for name, b in saved.items():
        if b.shape != live[name].shape or b.dtype != live[name].dtype:
            raise CheckpointError(
                f"{directory} is a checkpoint of another model: its buffer {name!r} {list(b.shape)} {b.dtype} meets "
                f"this model's {list(live[name].shape)} {live[name].dtype}"
            )
    return saved


def _shared_token(coll: Collectives) -> str:
    """A temporary-directory suffix all ranks agree on: rank 0's random one (a process id repeats, as a
    container's process 1 does, and a killed save's directory of that name made later saves fail)."""
    token = torch.tensor([secrets.randbits(63)], dtype=torch.int64)
    coll.broadcast_from_0(token)
    return f"{int(token):016x}"


def _manifest_checksum(manifest: Dict[str, Any]) -> str:
    """CRC32 of the manifest's canonical JSON without its own checksum: any edit of a value changes it."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


_RANK_PART_KEYS = {"file": str, "records": list, "state": dict}
_RECORD_KEYS = {"group": int, "kind": str, "start": int, "numel": int, "dtype": str, "offset": int, "crc32": int}
_MANIFEST_KEYS = {"format": int, "world_size": int, "config": dict, "params": list, "state": dict, "ranks": list, "extra": dict}


def _load_manifest(directory: Path) -> Dict[str, Any]:
    """The manifest, refused with one sentence if it is missing, edited, or not what save() writes."""
    path = directory / MANIFEST
    if not directory.is_dir():
        raise not_a_checkpoint_directory(directory)
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a checkpoint: it has no {MANIFEST} (an interrupted save leaves *.tmp-*)")
    try:
        manifest = json_text.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupted: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} is corrupted: not a JSON object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(_foreign_format(path, manifest))
    if manifest.get("checksum") != _manifest_checksum(manifest):
        raise CheckpointError(f"{path} has been edited or corrupted: its checksum does not match its contents")
    _check_types(manifest, _MANIFEST_KEYS, path, "the manifest")
    for part in manifest["ranks"]:
        _check_types(part, _RANK_PART_KEYS, path, "a rank's entry")
        if not re.fullmatch(r"rank[0-9]{5}\.bin", part["file"]):
            raise CheckpointError(
                f"{path} names the rank file {part['file']!r}: rank files are plain names rankNNNNN.bin in the checkpoint"
            )
        for record in part["records"]:
            _check_types(record, _RECORD_KEYS, path, "a shard record")
            if record["dtype"] not in _DTYPES or record["numel"] < 0 or record["offset"] < 0:
                raise CheckpointError(f"{path} has an impossible shard record {record}")
    return manifest


def not_a_checkpoint_directory(directory: Path) -> CheckpointError:
    """The error for a checkpoint path that is no directory: missing, or a file (a rank file, an export)."""
    what = "no such directory" if not os.path.exists(directory) else "it is a file, not a directory"
    return CheckpointError(
        f"{directory} is not a checkpoint: {what}; name a checkpoint directory (ckpt-NNNNNN, holding {MANIFEST})"
    )


def _foreign_format(path: Path, manifest: Dict[str, Any]) -> str:
    """Why a manifest of another format cannot be read, and what to do: it names the version that wrote it."""
    saved = manifest.get("format")
    written_by = manifest.get("written_by")
    writer = written_by.get("offload_trainer") if isinstance(written_by, dict) else None
    by = f"offload-trainer {writer}" if isinstance(writer, str) else "another offload-trainer"
    this = f"this offload-trainer ({__version__}) reads format {FORMAT}"
    if isinstance(saved, int) and not isinstance(saved, bool) and saved > FORMAT:
        return (f"{path} has format {saved}, written by {by}, newer than this one: {this}; upgrade offload-trainer "
                "to resume from it, or start a new run")
    if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 1:
        return (f"{path} has format {saved}, written by {by}, older than this one: {this}; resume it with the "
                "version that wrote it, or start a new run (model.hf_path may name its export)")
    return f"{path} is corrupted: its format is {saved!r}, which no offload-trainer writes ({this})"


def _check_types(entry: Any, keys: Dict[str, type], path: Path, what: str) -> None:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path} is corrupted: {what} is not a JSON object")
    for key, kind in keys.items():
        if key not in entry or not isinstance(entry[key], kind) or isinstance(entry[key], bool):
            raise CheckpointError(f"{path} is corrupted: {what} lacks {key!r} ({kind.__name__})")


def _check_same_model(
    manifest: Dict[str, Any], layout: List[Dict[str, Any]], optimizer_states: Sequence[str], directory: Path
) -> None:
    theirs = manifest["params"]
    if len(layout) != len(theirs):
        raise CheckpointError(
            f"{directory} is a checkpoint of another model: it has {len(theirs)} parameters, this model {len(layout)}"
        )
    for a, b in zip(layout, theirs):
        if a != b and {**a, "stride": None} == {**b, "stride": None}:
            raise CheckpointError(
                f"{directory} holds parameter {b['name']!r} in another memory order (strides {b.get('stride', 'row-major')}, "
                f"this model's {a.get('stride', 'row-major')}): convert the model to the memory format it was saved "
                "in (model.to(memory_format=...)) before initialize()"
            )
        if a != b and {**a, "offset": None} == {**b, "offset": None}:
            raise CheckpointError(
                f"{directory} holds parameter {b['name']!r} at element {b['offset']} of group {b['group']}, where this "
                f"engine lays it out at {a['offset']}: it was written by an offload-trainer that packed parameters "
                "without aligning them to 256 bytes; resume it with that version, or start from its exported weights "
                "(load_safetensors)"
            )
        if a != b:
            raise CheckpointError(
                f"{directory} is a checkpoint of another model: its parameter {b['name']!r} {b['shape']} "
                f"(group {b['group']}) meets this model's {a['name']!r} {a['shape']} (group {a['group']})"
            )
    kinds = set(optimizer_states)
    saved = {r["kind"] for part in manifest["ranks"] for r in part["records"]} - {"param"}
    if saved and saved != kinds:
        raise CheckpointError(
            f"{directory} holds optimizer states {sorted(saved)} but this engine keeps {sorted(kinds)}; "
            f"load it with the optimizer kind and precision it was saved with{_saved_with(manifest)}"
        )


def _saved_with(manifest: Dict[str, Any]) -> str:
    """' (optimizer.kind='adamw', precision.compute_dtype='fp32')' as the manifest's config records them, or ''
    (a manifest whose config lacks them: the sentence stands without the values)."""
    config = manifest["config"]
    named = [
        f"{section}.{key}={config[section][key]!r}"
        for section, key in (("optimizer", "kind"), ("precision", "compute_dtype"))
        if isinstance(config.get(section), dict) and isinstance(config[section].get(key), str)
    ]
    return f" ({', '.join(named)})" if named else ""


def load(
    directory: "str | os.PathLike[str]",
    shards: Shards,
    layout: List[Dict[str, Any]],
    optimizer_states: Sequence[str],
    buffers: Optional[Dict[str, torch.Tensor]] = None,
    adopt: Optional[Callable[[Loaded], None]] = None,
) -> Loaded:
    """Fill every group's homes, and the model's persistent `buffers` (by name, copied in place),
    from a checkpoint saved by any number of ranks. Collective.

    `layout`: this model's parameter layout as save()'s header["params"] has it, checked against the
    saved one. No device copy may exist. `adopt` is given the small state once every record has
    passed its checks and before any home is written: the engine loads it there, and one it refuses
    (raising, the same on every rank: the state is) leaves the homes untouched too. Returns the
    small state."""
    directory = Path(directory)
    # Each rank checks the records it reads, and all agree before any home is written: every rank
    # checking every record read the whole checkpoint once per rank (8 ranks: 8 times). The checks
    # before (the manifest, the model, the buffers) are agreed on too: one rank that failed them (its
    # copy of the directory missing or unreadable) left the others waiting at the agreement forever.
    try:
        manifest = _load_manifest(directory)
        _check_same_model(manifest, layout, optimizer_states, directory)
        saved_buffers = _read_buffers(manifest, directory, buffers or {})
        by_key: Dict[Tuple[int, str], List[Tuple[Path, Dict[str, Any]]]] = {}
        for part in manifest["ranks"]:
            for r in part["records"]:
                by_key.setdefault((r["group"], r["kind"]), []).append((directory / part["file"], r))
        _check_coverage(by_key, shards, directory)
        _verify(_records_read_here(by_key, shards))
        damage: Optional[CheckpointError] = None
    except CheckpointError as error:
        damage = error
    except BaseException:
        _tell_failed(shards.collectives)
        raise
    if not shards.collectives.all_true(damage is None):
        raise damage or CheckpointError(
            f"{directory} cannot be loaded: another rank found a record that fails its check, or a file it could "
            "not use (its error names it)"
        )
    rank_states = [dict(part["state"]) for part in manifest["ranks"]]
    loaded = Loaded(dict(manifest["state"]), rank_states, dict(manifest["extra"]))
    try:
        # The small state is agreed on with the homes: a Ctrl-C in adopt on one rank left the others
        # at the agreement below, which that rank's next collective met, out of step.
        if adopt is not None:
            adopt(loaded)
        _write_homes(shards, by_key, directory, saved_buffers, buffers)
    except BaseException:
        _tell_failed(shards.collectives)  # [Note: A load that failed part-way on one rank]
        raise
    if not shards.collectives.all_true(True):
        raise PartialStateError(
            f"engine.load_checkpoint({os.fspath(directory)!r}): another rank's load raised after it had written "
            "part of its state (its error names why), so no rank trains, saves or exports until a load completes "
            "on every rank: load again"
        )
    return loaded


def _tell_failed(coll: Collectives) -> None:
    """This rank's side of the agreement the other ranks wait at, from its error path: it failed.
    A second error (the process group gone too) is dropped: the caller raises the first."""
    try:
        coll.all_true(False)
    except BaseException:  # noqa: B902 - the caller's error is the one to raise
        pass


def _write_homes(
    shards: Shards,
    by_key: Dict[Tuple[int, str], List[Tuple[Path, Dict[str, Any]]]],
    directory: Path,
    saved_buffers: Dict[str, torch.Tensor],
    buffers: Optional[Dict[str, torch.Tensor]],
) -> None:
    """Every home of this rank's groups, and the model's persistent buffers, from the checked records.

    [Note: A load that failed part-way on one rank]
    A rank whose writes raise (its disk, a file read short, Ctrl-C) leaves its homes part the
    checkpoint's and its engine refusing to train ([Note: A load that failed part-way] in
    engine.py). The other ranks loaded all of theirs and went on to the barrier that ended the
    load, where they waited for the failed rank: until the process group's timeout, or until the
    failed rank's loop, which caught the error, met that barrier with its next collective (a load
    again: its agreement), from which on the ranks' collectives were paired out of step. Every rank
    now ends the load with an agreement, the failed one from its error path: where any rank failed,
    every other raises PartialStateError too, its engine marked part-loaded, so all ranks refuse
    the same calls and a load that completes on every rank mends them all. The checks before any
    home is written are agreed on the same way (a rank that cannot read its manifest), and so is the
    engine's adoption of the small state before the writes (a Ctrl-C there on one rank: the others
    went on, and their agreement paired with that rank's next load, which they reported loaded)."""
    buf = shards.staging()
    for group in shards.groups:
        for kind, home, start in shards.saved_homes(group):
            target = buf.view(torch.uint8)[: home.nbytes].view(home.dtype)
            target.zero_()
            _gather_range(by_key.get((group.index, kind), []), start, target, directory, kind, group.index)
            home.write(shards.tiers, target)
    with torch.no_grad():
        for name, value in saved_buffers.items():
            assert buffers is not None
            buffers[name].copy_(value)


def _check_coverage(
    by_key: Dict[Tuple[int, str], List[Tuple[Path, Dict[str, Any]]]], shards: Shards, directory: Path
) -> None:
    """Every saved state kind of every group must be covered by the saved records, up to its padding."""
    for group in shards.groups:
        for kind, _, _ in shards.saved_homes(group):
            needed = group.plan.used_numel if kind == "param" else group.plan.trainable_numel
            covered = 0
            for _, r in sorted(by_key.get((group.index, kind), []), key=lambda pr: pr[1]["start"]):
                if r["start"] > covered:
                    break
                covered = max(covered, r["start"] + r["numel"])
            if covered < needed:
                raise CheckpointError(
                    f"{directory} is incomplete: group {group.index} {kind} is saved for elements [0, {covered}) of "
                    f"[0, {needed})"
                )


def _records_read_here(
    by_key: Dict[Tuple[int, str], List[Tuple[Path, Dict[str, Any]]]], shards: Shards
) -> List[Tuple[Path, Dict[str, Any]]]:
    """The records this rank's homes read from (those overlapping the ranges _gather_range fills)."""
    out: List[Tuple[Path, Dict[str, Any]]] = []
    for group in shards.groups:
        for kind, home, start in shards.saved_homes(group):
            end = start + home.numel
            out += [(path, r) for path, r in by_key.get((group.index, kind), []) if r["start"] < end and start < r["start"] + r["numel"]]
    return out


def _verify(records: Sequence[Tuple[Path, Dict[str, Any]]]) -> None:
    """Check the size and CRC32 of every record given before anything is loaded. A record is held
    against its file's size before it is read: one past the end (a truncated file, or a manifest
    whose offsets were rewritten) is refused with the numbers, never handed to seek() or read()
    (which overflowed on an offset past 2**63, and allocated the record's size first)."""
    sizes: Dict[Path, int] = {}
    for path, r in records:
        nbytes = r["numel"] * torch.empty((), dtype=_DTYPES[r["dtype"]]).element_size()
        try:
            if path not in sizes:
                sizes[path] = os.stat(path).st_size
            found = max(0, min(nbytes, sizes[path] - r["offset"]))
            data = b""
            if found == nbytes:
                with open(path, "rb") as f:
                    f.seek(r["offset"])
                    data = f.read(nbytes)
                found = len(data)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read {nbytes} bytes at offset {r['offset']} ({exc.strerror})") from None
        if found != nbytes:
            raise CheckpointError(
                f"{path} is truncated: group {r['group']} {r['kind']} needs {nbytes} bytes at offset "
                f"{r['offset']}, found {found}"
            )
        if zlib.crc32(data) != r["crc32"]:
            raise CheckpointError(
                f"{path} is corrupted: group {r['group']} {r['kind']} ({nbytes} bytes at offset {r['offset']}) "
                "fails its checksum"
            )


def _gather_range(
    records: List[Tuple[Path, Dict[str, Any]]], start: int, target: torch.Tensor, directory: Path, kind: str, group: int
) -> None:
    """Fill `target` (elements [start, start + numel) of a flat layout) from the saved shards covering it.

    Elements no saved shard covers are end-of-group padding (its length depends on the rank
    count) and keep the zeros `target` starts with.

    Every record used is read whole and its CRC32 checked again as it is read (_read_record): _verify
    checked what it read before the first home was written, but this is a second read of the file,
    and bytes that changed in between (a file rewritten in place, a bad sector read back otherwise)
    were loaded unchecked."""
    if not records:
        raise CheckpointError(f"{directory} has no {kind} for group {group}")
    end = start + target.numel()
    esize = target.element_size()
    for path, r in records:
        lo, hi = max(start, r["start"]), min(end, r["start"] + r["numel"])
        if lo >= hi:
            continue
        _read_record(path, r, esize, (lo - r["start"]) * esize, target[lo - start : hi - start].view(torch.uint8))


_SCRATCH_BYTES = 4 << 20
"""The most _read_record reads at once of a record's bytes that it only checks (outside the range loaded)."""


def _read_record(path: Path, r: Dict[str, Any], esize: int, skip_bytes: int, into: torch.Tensor) -> None:
    """Read record `r` of `path` whole: its bytes [skip_bytes, skip_bytes + into.numel()) into `into`,
    the rest (a record only partly this rank's, in a load onto another number of ranks) through a small
    scratch buffer; CheckpointError unless it is all there and matches the record's CRC32."""
    nbytes = r["numel"] * esize
    crc = 0
    with open(path, "rb") as f:
        f.seek(r["offset"])
        view = memoryview(into.numpy())
        for begin, end, dest in ((0, skip_bytes, None), (skip_bytes, skip_bytes + len(view), view),
                                 (skip_bytes + len(view), nbytes, None)):
            at = begin
            while at < end:
                part = dest[at - begin : end - begin] if dest is not None else memoryview(
                    bytearray(min(_SCRATCH_BYTES, end - at)))
                got = f.readinto(part)
                if not got:
                    raise CheckpointError(
                        f"{path} was truncated while it was loaded: group {r['group']} {r['kind']} needs {nbytes} "
                        f"bytes at offset {r['offset']}, found {at}"
                    )
                crc = zlib.crc32(part[:got], crc)
                at += got
    if crc != r["crc32"]:
        raise CheckpointError(
            f"{path} is corrupted: group {r['group']} {r['kind']} ({nbytes} bytes at offset {r['offset']}) fails its "
            "checksum as it is loaded (it passed when the checkpoint was checked: the file changed in between)"
        )
