"""JSON cache files: entries keyed by a short id of what they were measured for.

The machine rates (machine.py) and the compute probe's timings (compute_probe.py) are slow to
measure and cheap to keep, so each is kept in one JSON file of this layout:

    {"format": 1, "entries": {"<key id>": {"key": {...}, ...}, ...}}

    key_id = cache_key_id(key)                    # the same key always gives the same id
    entry = read_cache(path, "compute-time cache").get(key_id)
    store_entry(path, key_id, {"key": key, "times": ...}, "compute-time cache")

A file that cannot be read, is not JSON, or has another layout or format is ignored with a
warning that names what it is and its path, and is replaced on the next write; one that cannot be
written (HOME not writable, a read-only file system) is warned about and left: a cache is never
worth stopping for. Writes go through io_engine.atomic_file.write_atomic, so a crash leaves the
old file or the new one, never a torn one, and the temporary of a writer killed before its rename
(`<name>.tmp-<random>`), which each write removes once it is older than STALE_TEMPORARY_S (a live
writer's is a fraction of a second old): one more was left in ~/.cache for good at each such kill.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

from io_engine.atomic_file import TEMP_MARKER, write_atomic

CACHE_FORMAT = 1
"""Version of the cache file's layout; a file of another version is ignored (and replaced)."""
STALE_TEMPORARY_S = 60.0
"""Age past which a cache file's temporary is a killed writer's, never a live one's."""


def cache_key_id(key: dict[str, Any]) -> str:
    """The short id an entry is stored under in a cache file (read_cache / write_cache)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def read_cache(path: Path, what: str = "machine-rate cache") -> dict[str, Any]:
    """The cache's entries by key id; {} (with a warning naming `what` and the path) if the file is unreadable."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        # stacklevel 3: the warning points at whoever asked for the cached value, not at this file.
        warnings.warn(f"ignoring the {what} {path}: cannot read it ({exc})", stacklevel=3)
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        warnings.warn(
            f"ignoring the {what} {path}: not valid JSON ({exc}); it is replaced on the next write",
            stacklevel=3,
        )
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("entries"), dict):
        warnings.warn(
            f"ignoring the {what} {path}: not a format-{CACHE_FORMAT} cache file; it is replaced "
            "on the next write",
            stacklevel=3,
        )
        return {}
    return data["entries"]


def write_cache(path: Path, entries: dict[str, Any]) -> None:
    """Replace the cache file with `entries` all at once (io_engine.atomic_file.write_atomic),
    making its directory if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"format": CACHE_FORMAT, "entries": entries}, indent=2, sort_keys=True) + "\n"
    write_atomic(path, text)
    _remove_stale_temporaries(path)


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries of `path` that killed writers left (older than STALE_TEMPORARY_S)."""
    now = time.time()
    prefix = path.name + TEMP_MARKER
    for entry in os.scandir(path.parent):
        try:
            if entry.name.startswith(prefix) and now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMPORARY_S:
                os.unlink(entry.path)
        except OSError:
            continue  # removed by another writer meanwhile, or not ours to remove: upkeep never fails a write


def store_entry(path: Path, key_id: str, entry: dict[str, Any], what: str) -> bool:
    """Add `entry` under `key_id` to the cache file, keeping the entries other processes wrote
    meanwhile (the file is read again just before writing). False, with a warning naming `what`,
    the path and the error, where the file cannot be written."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # whoever read it first has warned, if it was unreadable then
            entries = read_cache(path, what)
        entries[key_id] = entry
        write_cache(path, entries)
    except OSError as exc:
        # stacklevel 3: the warning points at whoever asked for the cached value, not at this file.
        warnings.warn(f"could not write the {what} {path} ({exc}); it is measured again next time", stacklevel=3)
        return False
    return True


__all__ = ["CACHE_FORMAT", "cache_key_id", "read_cache", "store_entry", "write_cache"]
