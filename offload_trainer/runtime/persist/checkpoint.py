"""Checkpoints of an engine: every rank's shards of every state kind, streamed, atomic, checksummed.

    engine.save_checkpoint("runs/ckpt-000100", extra={"data_position": 1234})
    extra = engine.load_checkpoint("runs/ckpt-000100")   # same model; any number of ranks

Layout of a checkpoint directory:

    manifest.json      format, step, world size, config, the model's parameters (name, shape,
                       group, offset), optimizer step counts, loss scale, schedule, `extra`, and
                       per rank its shard file and one record per (group, state kind): byte
                       offset, element range in the group's flat layout, dtype, CRC32
    rank00000.bin ...  each rank's shards, one after another

Saving writes into `<name>.tmp-<pid>` next to the target, fsyncs every file and the directory,
then renames it to the target: a kill at any instant leaves either no checkpoint or a complete
one, and never touches an existing checkpoint (saving over one is refused). Loading checks the
manifest against the model and verifies every record's checksum before it changes any state,
so a corrupted or foreign checkpoint is refused with the engine untouched.

Shards are stored in flat-layout coordinates, which do not depend on the number of ranks (only
the padding at the end of each group does), so a checkpoint saved by N ranks loads on M: each
rank reads the element ranges of its new shard from whichever saved shards cover them.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from io_engine import aligned_empty

from offload_trainer.errors import CheckpointError


if TYPE_CHECKING:
    from offload_trainer.runtime.engine import Engine
    from offload_trainer.runtime.groups.shard_group import ShardGroup
    from offload_trainer.runtime.groups.tiers import Home

FORMAT = 1
MANIFEST = "manifest.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class _Record:
    """One state kind of one group in one rank's file."""

    group: int
    kind: str
    """"param" or an optimizer state's name; gradients are never saved (a step ends without them)."""
    start: int
    """First element, in the group's flat coordinates (trainable coordinates for optimizer states)."""
    numel: int
    dtype: str
    offset: int
    """Byte offset in the rank's file."""
    crc32: int

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.bin"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _homes(group: "ShardGroup") -> List[Tuple[str, "Home", int]]:
    """(kind, home, first element in flat coordinates) of every state kind saved for a group."""
    out: List[Tuple[str, "Home", int]] = [("param", group.param_home, group.shard_start)]
    for name, home in group.optimizer_homes.items():
        out.append((name, home, group.shard_start))
    return out


def _read_home(engine: "Engine", home: "Home", buf: torch.Tensor) -> torch.Tensor:
    view = buf.view(torch.uint8)[: home.nbytes].view(home.dtype)
    home.read(engine.tiers, view)
    return view


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(engine: "Engine", directory: "str | os.PathLike[str]", extra: Optional[Dict[str, Any]] = None) -> Path:
    """Write a complete checkpoint of `engine` to `directory` (which must not exist). Collective."""
    if engine.grads.micro_batch != 0:
        raise ValueError(
            f"save_checkpoint between micro-batches ({engine.grads.micro_batch} of this step ran): save right "
            "after engine.step(), where no gradient is pending"
        )
    target = Path(directory)
    if target.exists():
        raise ValueError(f"{target} exists; checkpoints are never overwritten: choose a new directory")
    coll = engine.collectives
    tmp = target.with_name(f"{target.name}.tmp-{_shared_token(engine)}")
    if coll.rank == 0:
        tmp.mkdir(parents=True)
    coll.barrier()
    engine.grads.drain()
    largest = max((home.nbytes for g in engine.groups for _, home, _ in _homes(g)), default=1)
    buf = aligned_empty(max(largest, 1))
    records: List[_Record] = []
    path = tmp / _rank_file(coll.rank)
    with open(path, "wb") as f:
        offset = 0
        for group in engine.groups:
            for kind, home, start in _homes(group):
                data = _read_home(engine, home, buf)
                raw = data.view(torch.uint8).numpy()
                f.write(memoryview(raw))
                records.append(
                    _Record(group.index, kind, start, home.numel, _dtype_name(home.dtype), offset, zlib.crc32(raw))
                )
                offset += home.nbytes
        f.flush()
        os.fsync(f.fileno())
    part = {
        "file": _rank_file(coll.rank),
        "records": [r.as_dict() for r in records],
        "optimizer_steps": {str(k): v.tolist() for k, v in engine.optimizer.steps.items()},
    }
    (tmp / f"rank{coll.rank:05d}.json").write_text(json.dumps(part))
    coll.barrier()
    if coll.rank == 0:
        ranks = [json.loads((tmp / f"rank{r:05d}.json").read_text()) for r in range(coll.world_size)]
        manifest = {
            "format": FORMAT,
            "step": engine.global_step,
            "world_size": coll.world_size,
            "config": engine.config.to_dict(),
            "params": _model_layout(engine),
            "loss_scale": engine.scaler.state_dict(),
            "schedule": engine.schedule.state_dict(),
            "ranks": ranks,
            "extra": extra or {},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        for r in range(coll.world_size):
            (tmp / f"rank{r:05d}.json").unlink()
        with open(tmp / MANIFEST, "rb") as f:
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        os.rename(tmp, target)
        _fsync_dir(target.parent)
    coll.barrier()
    return target


def _shared_token(engine: "Engine") -> str:
    """A temporary-directory suffix all ranks agree on (rank 0's pid)."""
    pid = torch.tensor([os.getpid()], dtype=torch.int64)
    if engine.collectives.world_size > 1:
        torch.distributed.broadcast(pid, src=0, group=engine.collectives.group)
    return str(int(pid))


def _model_layout(engine: "Engine") -> List[Dict[str, Any]]:
    return [
        {"name": s.name, "shape": list(s.shape), "group": g.index, "offset": s.offset_numel, "requires_grad": s.requires_grad}
        for g in engine.plan.groups
        for s in g.params
    ]


def _load_manifest(directory: Path) -> Dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a checkpoint: it has no {MANIFEST} (an interrupted save leaves *.tmp-*)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is corrupted: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}; this version reads format {FORMAT}")
    return manifest


def _check_same_model(engine: "Engine", manifest: Dict[str, Any], directory: Path) -> None:
    mine = _model_layout(engine)
    theirs = manifest["params"]
    if len(mine) != len(theirs):
        raise CheckpointError(
            f"{directory} is a checkpoint of another model: it has {len(theirs)} parameters, this model {len(mine)}"
        )
    for a, b in zip(mine, theirs):
        if a != b:
            raise CheckpointError(
                f"{directory} is a checkpoint of another model: its parameter {b['name']!r} {b['shape']} "
                f"(group {b['group']}) meets this model's {a['name']!r} {a['shape']} (group {a['group']})"
            )
    kinds = set(engine.memory_plan.optimizer_states)
    saved = {r["kind"] for part in manifest["ranks"] for r in part["records"]} - {"param"}
    if saved and saved != kinds:
        raise CheckpointError(
            f"{directory} holds optimizer states {sorted(saved)} but this engine keeps {sorted(kinds)}; "
            "load it with the optimizer kind and precision it was saved with"
        )


def load(engine: "Engine", directory: "str | os.PathLike[str]") -> Dict[str, Any]:
    """Restore `engine` from a checkpoint saved by any number of ranks; returns its `extra`. Collective."""
    directory = Path(directory)
    manifest = _load_manifest(directory)
    _check_same_model(engine, manifest, directory)
    by_key: Dict[Tuple[int, str], List[Tuple[Path, Dict[str, Any]]]] = {}
    for part in manifest["ranks"]:
        for r in part["records"]:
            by_key.setdefault((r["group"], r["kind"]), []).append((directory / part["file"], r))
    _verify(by_key)

    engine.scheduler.evict_all()
    largest = max((home.nbytes for g in engine.groups for _, home, _ in _homes(g)), default=1)
    buf = aligned_empty(max(largest, 1))
    for group in engine.groups:
        for kind, home, start in _homes(group):
            target = buf.view(torch.uint8)[: home.nbytes].view(home.dtype)
            target.zero_()
            _gather_range(by_key.get((group.index, kind), []), start, target, directory, kind, group.index)
            home.write(engine.tiers, target)
        group.begin_step()
    steps = [{int(k): v for k, v in part["optimizer_steps"].items()} for part in manifest["ranks"]]
    for gi, mine in engine.optimizer.steps.items():
        saved = [torch.tensor(s[gi], dtype=torch.float32) for s in steps if gi in s]
        if saved:
            mine.copy_(torch.stack(saved).amax(dim=0))
    engine.scaler.load_state_dict(manifest["loss_scale"])
    engine.schedule.load_state_dict(manifest["schedule"])
    engine.global_step = int(manifest["step"])
    engine.grads.begin_step()
    engine.collectives.barrier()
    return dict(manifest["extra"])


def _verify(by_key: Dict[Tuple[int, str], List[Tuple[Path, Dict[str, Any]]]]) -> None:
    """Check every record's size and CRC32 before anything is loaded."""
    for records in by_key.values():
        for path, r in records:
            nbytes = r["numel"] * torch.empty((), dtype=_DTYPES[r["dtype"]]).element_size()
            try:
                with open(path, "rb") as f:
                    f.seek(r["offset"])
                    data = f.read(nbytes)
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
            if len(data) != nbytes:
                raise CheckpointError(
                    f"{path} is truncated: group {r['group']} {r['kind']} needs {nbytes} bytes at offset "
                    f"{r['offset']}, found {len(data)}"
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
    count) and keep the zeros `target` starts with."""
    if not records:
        raise CheckpointError(f"{directory} has no {kind} for group {group}")
    end = start + target.numel()
    esize = target.element_size()
    for path, r in records:
        lo, hi = max(start, r["start"]), min(end, r["start"] + r["numel"])
        if lo >= hi:
            continue
        with open(path, "rb") as f:
            f.seek(r["offset"] + (lo - r["start"]) * esize)
            f.readinto(memoryview(target[lo - start : hi - start].view(torch.uint8).numpy()))
