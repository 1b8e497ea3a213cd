"""The token cache's upkeep ([Note: Token cache eviction] in app/data/token_cache.py): a directory
keeps the most recently used entries of each corpus and removes the older ones when a new one is
complete, never one another reader has mapped or a temporary a live writer holds.

Run: pytest tests/offload_trainer/app/data/test_token_cache.py
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import signal
import time
from pathlib import Path
from typing import Iterator, List

import pytest
import torch

from offload_trainer.app.data import ByteTokenizer, load_corpus
from offload_trainer.app.data.token_cache import CACHE_DIR_NAME, KEEP_PER_SOURCE, STALE_TEMPORARY_S, TokenCache
from offload_trainer.app.run_config import DataConfig
from tests.forked_kill import killed_at

SOURCE = "/data/corpus"


def _key(i: int) -> str:
    return f"{i:032x}"


def _build(directory: Path, i: int, source: str = SOURCE) -> torch.Tensor:
    """Build entry i (its text says i) and return a copy of its tokens (the mapping is dropped)."""
    stream = TokenCache(directory, _key(i), source).build([f"document {i} " * 20], ByteTokenizer(), None)
    tokens = stream.tokens.clone()
    del stream
    gc.collect()
    return tokens


def _complete(directory: Path) -> List[str]:
    return sorted(p.stem for p in directory.glob("*.json"))


def test_a_directory_keeps_the_most_recently_used_entries_of_a_source(tmp_path: Path) -> None:
    assert KEEP_PER_SOURCE == 2
    _build(tmp_path, 90, source="/data/other")  # another corpus: never evicted for this one
    (tmp_path / f"{_key(91)}.json").write_text(json.dumps({"num_tokens": 0, "dtype": "uint8", "trained": False}))
    (tmp_path / f"{_key(91)}.tokens").write_bytes(b"")  # an entry written before entries named their source
    _build(tmp_path, 1)
    _build(tmp_path, 2)
    assert _complete(tmp_path) == [_key(1), _key(2), _key(90), _key(91)]
    os.utime(tmp_path / f"{_key(1)}.json", (time.time() - 60, time.time() - 60))
    os.utime(tmp_path / f"{_key(2)}.json", (time.time() - 30, time.time() - 30))
    assert TokenCache(tmp_path, _key(1), SOURCE).load() is not None  # entry 1 used after entry 2
    gc.collect()
    tokens_3 = _build(tmp_path, 3)
    assert _complete(tmp_path) == [_key(1), _key(3), _key(90), _key(91)]
    assert not list(tmp_path.glob(f"{_key(2)}.*")), "every file of the evicted entry is gone"
    loaded = TokenCache(tmp_path, _key(3), SOURCE).load()
    assert loaded is not None and torch.equal(loaded.tokens, tokens_3)


def test_an_entry_mapped_by_a_reader_is_never_evicted(tmp_path: Path) -> None:
    tokens_1 = _build(tmp_path, 1)
    held = TokenCache(tmp_path, _key(1), SOURCE).load()  # another run training on entry 1
    assert held is not None
    view = held.tokens[5:]  # what a dataset keeps: views of the mapping
    del held
    os.utime(tmp_path / f"{_key(1)}.json", (time.time() - 60, time.time() - 60))
    for i in (2, 3, 4):
        _build(tmp_path, i)
    # The newest two (3, 4), and entry 1, older but in use; entry 2 went when entry 3 was built.
    assert _complete(tmp_path) == [_key(1), _key(3), _key(4)]
    assert torch.equal(view, tokens_1[5:])
    del view
    gc.collect()  # the reader is done: its lock is gone with its last mapping
    _build(tmp_path, 5)
    assert _complete(tmp_path) == [_key(4), _key(5)]


def test_a_load_during_an_eviction_treats_the_entry_as_missing(tmp_path: Path) -> None:
    _build(tmp_path, 1)
    fd = os.open(tmp_path / f"{_key(1)}.json", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what an eviction holds while it removes the entry
        assert TokenCache(tmp_path, _key(1), SOURCE).load() is None
    finally:
        os.close(fd)
    assert TokenCache(tmp_path, _key(1), SOURCE).load() is not None


def test_only_unlocked_old_temporaries_are_removed(tmp_path: Path) -> None:
    old = time.time() - STALE_TEMPORARY_S - 60
    killed = tmp_path / f"{_key(7)}.tokens.tmp-0123456789abcdef"  # a writer killed long ago
    writing = tmp_path / f"{_key(8)}.tokens.tmp-fedcba9876543210"  # a slow live writer, holding its lock
    fresh = tmp_path / f"{_key(9)}.json.tmp-00112233445566ff"  # a writer that has not locked yet
    other = tmp_path / "notes.txt.tmp-1"  # not the cache's
    for path in (killed, writing, fresh, other):
        path.write_bytes(b"x" * 100)
    for path in (killed, writing, other):
        os.utime(path, (old, old))
    with open(writing, "rb") as live:
        fcntl.flock(live.fileno(), fcntl.LOCK_EX)
        _build(tmp_path, 1)
    assert not killed.exists()
    assert writing.exists() and fresh.exists() and other.exists()


def _killed_build(directory: Path, key: str) -> None:
    """A writer SIGKILLed halfway through tokenizing (a forked child: what a preempted job leaves)."""
    pid = os.fork()
    if pid == 0:  # the child never returns: it is killed in the middle of its build
        def documents() -> Iterator[str]:
            for i in range(1000):
                if i == 500:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield f"document {i} " * 50

        try:
            TokenCache(directory, key, SOURCE).build(documents(), ByteTokenizer(), None)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_build_first_removes_what_killed_builds_left_even_if_it_never_completes(tmp_path: Path) -> None:
    # A job preempted again and again while it tokenizes a large corpus: each attempt is killed
    # minutes in, and none completes an entry. Each left its partial tokens; the next attempt's
    # start removes them (they once stayed until a build completed an hour later: without bound).
    # (Two entries: a write of one entry's file first removes its own killed writers' temporaries.)
    _killed_build(tmp_path, _key(1))
    _killed_build(tmp_path, _key(2))
    left = sorted(tmp_path.glob("*.tmp-*"))
    assert len(left) == 2 and all(p.stat().st_size > 0 for p in left)
    minutes_ago = time.time() - 300
    for path in left:
        os.utime(path, (minutes_ago, minutes_ago))

    def interrupted() -> Iterator[str]:
        yield "document " * 50
        raise RuntimeError("preempted again")

    with pytest.raises(RuntimeError, match="preempted again"):
        TokenCache(tmp_path, _key(1), SOURCE).build(interrupted(), ByteTokenizer(), None)
    assert sorted(tmp_path.glob("*.tmp-*")) == []


def test_a_start_that_loads_the_entry_removes_what_a_build_killed_just_before_it_left(tmp_path: Path) -> None:
    # A job killed while it tokenizes and restarted at once: its temporary is seconds old when the
    # restart's build starts, so that build keeps it (a live writer's could be as young), and
    # completes the entry. Every later start loads the entry without building: the temporary, as
    # large as the corpus's tokens, once stayed for good. A load removes it once it is stale. (The
    # killed build is of another entry: a write of the same entry's file removes an unlocked one at once.)
    _killed_build(tmp_path, _key(2))
    _build(tmp_path, 1)
    left = sorted(tmp_path.glob("*.tmp-*"))
    assert len(left) == 1, left  # too young to be told from a live writer's
    long_ago = time.time() - STALE_TEMPORARY_S - 60
    os.utime(left[0], (long_ago, long_ago))
    stream = TokenCache(tmp_path, _key(1)).load()  # the next start: nothing to build
    assert stream is not None
    assert sorted(tmp_path.glob("*.tmp-*")) == []


def test_editing_a_corpus_again_and_again_leaves_a_bounded_cache(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    cfg = DataConfig(path=str(corpus), seq_len=8, batch_size=2)
    for edit in range(4):
        (corpus / "a.txt").write_text(f"edit {edit} of the text\n" * (20 + edit))
        data = load_corpus(cfg, ByteTokenizer())
        assert data.num_tokens > 0
        del data
        gc.collect()
    assert len(_complete(tmp_path / CACHE_DIR_NAME)) == KEEP_PER_SOURCE


def test_a_build_whose_entry_another_writer_replaces_meanwhile_loads_theirs(tmp_path: Path, monkeypatch) -> None:
    """Two ranks of one run tokenize the same corpus into the same entry. Rank 1's copy of the JSON
    was renamed into place between rank 0's write and its load's open and stat (seen in CI: "the
    token cache entry ... was changed while it was written", exit 2). The copy holds the same
    tokens: build() now loads again (a few times) before it gives up."""
    real = TokenCache.load
    misses = [2]

    def load_after_a_rename(self: TokenCache):
        if misses[0]:
            misses[0] -= 1
            fd, tmp = os.open(tmp_path / "tmp.json", os.O_CREAT | os.O_WRONLY, 0o644), tmp_path / "tmp.json"
            os.write(fd, self.meta_path.read_bytes())
            os.close(fd)
            os.replace(tmp, self.meta_path)  # the other writer's copy: a new inode, the same bytes
            return None
        return real(self)

    monkeypatch.setattr(TokenCache, "load", load_after_a_rename)
    stream = TokenCache(tmp_path, _key(5), SOURCE).build(["document 5 " * 20], ByteTokenizer(), None)
    assert bytes(stream.tokens.tolist()) == ("document 5 " * 20).encode()
    monkeypatch.setattr(TokenCache, "load", lambda self: None)  # a load that never finds it: still an error
    with pytest.raises(OSError, match="was changed while it was written"):
        TokenCache(tmp_path, _key(6), SOURCE).build(["document 6"], ByteTokenizer(), None)


def test_an_eviction_killed_at_any_moment_leaves_nothing_that_stays_for_good(tmp_path: Path) -> None:
    """SIGKILL before each rename or removal of a build that evicts an entry: the next start leaves
    complete entries only. Killed after the build renamed its tokens into place and before its JSON,
    or after the eviction removed the JSON and before the tokens, the entry's tokens (as large as
    the corpus's) stayed for good under a name no upkeep looked at."""
    kills = 0
    for n in range(1, 50):
        directory = tmp_path / f"trial{n}"
        directory.mkdir()
        _build(directory, 1)
        _build(directory, 2)
        long_ago = time.time() - STALE_TEMPORARY_S - 60
        for path in directory.iterdir():
            os.utime(path, (long_ago, long_ago))
        if not killed_at(n, lambda: _build(directory, 3), lambda event, args: event in ("os.rename", "os.remove") and str(directory) in str(args[0])):
            break
        kills += 1
        for path in directory.iterdir():  # the next start comes after the stale delay
            os.utime(path, (long_ago, long_ago))
        stream = TokenCache(directory, _key(2), SOURCE).load()  # the next start: entry 2 loads
        assert stream is not None
        del stream
        gc.collect()
        complete = set(_complete(directory))
        left = [p.name for p in directory.iterdir() if p.name.partition(".")[0] not in complete]
        assert left == [], f"killed before change {n}: left for good {left}"
    assert kills >= 4, "the sweep never reached the eviction"
