"""JSON cache files: entries keyed by a short id of what they were measured for.

The machine rates (machine.py) and the compute probe's timings (compute_probe.py) are slow to
measure and cheap to keep, so each is kept in one JSON file of this layout:

    {"format": 1, "entries": {"<key id>": {"key": {...}, ...}, ...}}

    key_id = cache_key_id(key)                    # the same key always gives the same id
    entry = read_cache(path, "compute-time cache").get(key_id)
    store_entry(path, key_id, {"key": key, "times": ...}, "compute-time cache")

A cache file of another format (an older version's) is ignored with a warning that names what
it is and its path, and is replaced on the next write. A file that is not a cache file at all (not
JSON, not UTF-8, or JSON of another layout: $OFFLOAD_TRAINER_CACHE pointed at a file of the
user's) is ignored with a warning and never written over: replacing it would lose the user's data
for a cache. One that cannot be written (HOME not writable, a read-only file system) is warned
about and left: a cache is never worth stopping for. Writes go through
io_engine.atomic_file.write_atomic, so a crash leaves the old file or the new one, never a torn one,
and the temporary of a writer killed before its rename (`<name>.tmp-<random>`) is removed by the
next write ([Note: What a killed writer leaves] there): one more was left in ~/.cache for good at
each such kill.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from io_engine.atomic_file import TEMP_MARKER, write_atomic

from offload_trainer.config import json_text

CACHE_FORMAT = 1
"""Version of the cache file's layout; a cache file of another version is ignored (and replaced)."""


def cache_key_id(key: dict[str, Any]) -> str:
    """The short id an entry is stored under in a cache file (read_cache / write_cache)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def read_cache(path: Path, what: str = "machine-rate cache") -> dict[str, Any]:
    """The cache's entries by key id; {} (with a warning naming `what` and the path) if the file is unreadable."""
    entries, problem, _ = _read(path, what)
    if problem is not None:
        # stacklevel 3: the warning points at whoever asked for the cached value, not at this file.
        warnings.warn(problem, stacklevel=3)
    return entries


def _read(path: Path, what: str) -> tuple[dict[str, Any], str | None, bool]:
    """(entries, why the file is ignored or None, whether a write may replace the file). The why is
    one sentence naming `what`, the path and the fix; only no file, an empty one and a cache file
    (of any format) may be replaced."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a write says why it cannot make it)
        return {}, None, True
    except OSError as exc:
        return {}, f"ignoring the {what} {path}: cannot read it ({exc})", False
    if not data.strip():  # empty (a `touch`): nothing in it to lose
        return {}, None, True
    try:
        parsed = json_text.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        return {}, _foreign(path, what, f"not JSON: {exc}"), False
    ours = (
        isinstance(parsed, dict) and isinstance(parsed.get("format"), int) and isinstance(parsed.get("entries"), dict)
    )
    if not ours:
        return {}, _foreign(path, what, "JSON, but not an object of format and entries"), False
    if parsed["format"] != CACHE_FORMAT:
        return {}, (
            f"ignoring the {what} {path}: a format-{parsed['format']} cache file, this version reads format "
            f"{CACHE_FORMAT}; it is replaced on the next write"
        ), True
    return parsed["entries"], None, True


def _foreign(path: Path, what: str, why: str) -> str:
    return (
        f"ignoring the {what} {path}: it is not a cache file offload-trainer wrote ({why}), so it is left as it is "
        "and nothing is cached there; move it away, or set OFFLOAD_TRAINER_CACHE to another file"
    )


def write_cache(path: Path, entries: dict[str, Any]) -> None:
    """Replace the cache file with `entries` all at once (io_engine.atomic_file.write_atomic),
    making its directory if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"format": CACHE_FORMAT, "entries": entries}, indent=2, sort_keys=True) + "\n"
    write_atomic(path, text)


def store_entry(path: Path, key_id: str, entry: dict[str, Any], what: str) -> bool:
    """Add `entry` under `key_id` to the cache file, keeping the entries other processes wrote
    meanwhile (the file is read again just before writing). False, with a warning naming `what`,
    the path and the error, where the file cannot be written, and where it is not a cache file
    (read_cache has warned about that): a file of the user's is never written over."""
    entries, _, replaceable = _read(path, what)
    if not replaceable:
        return False
    entries[key_id] = entry
    try:
        write_cache(path, entries)
    except OSError as exc:
        # stacklevel 3: the warning points at whoever asked for the cached value, not at this file.
        # Not str(exc): it named `path`'s temporary (path.tmp-<hex>), removed by now, as the file that failed.
        failed = exc.filename if exc.filename is not None and TEMP_MARKER not in os.path.basename(exc.filename) else None
        reason = (exc.strerror or str(exc)) + (f": {failed}" if failed is not None and failed != str(path) else "")
        warnings.warn(f"could not write the {what} {path} ({reason}); it is measured again next time", stacklevel=3)
        return False
    return True


__all__ = ["CACHE_FORMAT", "cache_key_id", "read_cache", "store_entry", "write_cache"]
