"""planning/json_cache.py: a cache write killed at any moment leaves the old file or the new one,
and nothing that stays: the next write removes a killed writer's temporary once it is stale."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path

import pytest

from io_engine.atomic_file import STALE_TEMPORARY_S, TEMP_MARKER
from offload_trainer.planning import json_cache
from offload_trainer.planning.json_cache import read_cache, store_entry
from tests.forked_kill import killed_at


def test_a_write_killed_at_any_moment_leaves_a_whole_file_and_no_temporary_for_good(tmp_path: Path) -> None:
    kills = 0
    for n in range(1, 20):
        path = tmp_path / f"trial{n}" / "machine.json"
        path.parent.mkdir()
        assert store_entry(path, "a", {"key": {"a": 1}}, "test cache")
        if not killed_at(n, lambda: store_entry(path, "b", {"key": {"b": 1}}, "test cache")):
            break
        kills += 1
        assert set(read_cache(path)) in ({"a"}, {"a", "b"}), f"killed before change {n}"
        long_ago = time.time() - STALE_TEMPORARY_S - 60
        for left in path.parent.iterdir():
            os.utime(left, (long_ago, long_ago))
        assert store_entry(path, "c", {"key": {"c": 1}}, "test cache")  # the next write, later
        assert sorted(p.name for p in path.parent.iterdir()) == ["machine.json"], f"killed before change {n}"
        assert "c" in json.loads(path.read_text())["entries"]
    assert kills >= 2, "the sweep never reached the write"


def test_a_live_writers_temporary_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "machine.json"
    live = tmp_path / "machine.json.tmp-0123456789abcdef"  # another process writing now
    other = tmp_path / "notes.json.tmp-0123456789abcdef"  # not this file's
    live.write_text("{")
    other.write_text("{")
    long_ago = time.time() - STALE_TEMPORARY_S - 60
    os.utime(other, (long_ago, long_ago))
    os.utime(live, (long_ago, long_ago))  # however old: its writer holds its lock (as atomic_open does)
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        store_entry(path, "a", {"key": {"a": 1}}, "test cache")
    assert live.exists() and other.exists()


def test_a_cache_that_cannot_be_written_is_named_not_its_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OFFLOAD_TRAINER_CACHE=/proc/m.json warned "(... No such file or directory: '/proc/m.json.tmp-5caf...')":
    the temporary beside the cache, a name the user never gave."""
    path = tmp_path / "m.json"

    def fail(target: object, text: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", f"{target}{TEMP_MARKER}5caf688659190e19")

    monkeypatch.setattr(json_cache, "write_atomic", fail)
    with pytest.warns(UserWarning) as record:
        assert not json_cache.store_entry(path, "k", {"v": 1}, "machine-rate cache")
    (message,) = [str(w.message) for w in record]
    assert message == f"could not write the machine-rate cache {path} (No space left on device); it is measured again next time"
