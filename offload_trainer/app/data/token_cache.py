"""The tokenized corpus on disk, memory-mapped: a second start reads it instead of tokenizing.

    cache = TokenCache(directory, corpus_key(files, tokenizer_fingerprint, fields, max_tokens), source)
    stream = cache.load()                       # a memory-mapped TokenStream, or None
    stream = stream or cache.build(documents, tokenizer, max_tokens)

An entry is three files named by the key: `<key>.tokens` (the ids, raw, in the stream's dtype),
`<key>.trained` (one byte of marks a token, token_stream.py's TRAINED and STARTS bits, only for corpora
with chat documents) and `<key>.json` (the count,
dtype, source and the CRC32 of each of the other two), each written through io_engine's atomic
files, the JSON last: an entry is complete when its JSON exists, and a killed writer leaves only
`*.tmp-*` files. A load reads the whole entry once to check its CRC32s: an entry whose bytes changed
on disk (a bit flip, a bad sector, an edit) would otherwise train on tokens the corpus does not
hold, silently; such an entry, or one written before entries carried CRC32s, counts as missing and
is built again (with a warning for a corrupted one). The key hashes the
tokenizer's fingerprint, every corpus file's path, inode, size, modification time and status-change
time, the fields read and max_tokens, so a changed file or tokenizer makes a new entry. The
status-change time (st_ctime) is there because the others can stay the same over an edit: a tool
that restores the modification time (`touch -r`, `cp -p` over the file, an rsync of equal-sized
files) left the entry of the old text in use, and the run trained on tokens the corpus no longer
held; no user tool can set st_ctime.

[Note: Token cache eviction]
Without upkeep every edit of a corpus file and every tokenizer tried would leave a whole tokenized
corpus behind for good. So when build() completes an entry, the directory keeps the KEEP_PER_SOURCE
most recently used complete entries of the same source (the corpus path, data.path; "used": built
or loaded, the JSON's mtime) and removes the older ones of that source; entries of other corpora,
and those written before entries named their source, are left alone. Nothing another process may
be using or writing is removed:
- A process that loaded an entry holds a shared flock on its JSON for as long as the mapping
  lives; eviction takes the lock exclusively without waiting and skips the entry if it cannot. A
  load that finds the lock taken (an eviction under way) or its JSON replaced meanwhile treats the
  entry as missing and builds it again.
- A writer holds an exclusive flock on its temporary files while it writes them (atomic_open
  takes it: [Note: What a killed writer leaves] in io_engine/atomic_file.py). Temporaries
  (`*.tmp-*`) of killed writers, and an entry's tokens or marks without its JSON (a build killed
  after renaming them into place, an eviction killed after removing the JSON), are removed when a
  build starts and whenever an entry is loaded
  (which a build ends with too), once no one holds that lock and they are older than
  STALE_TEMPORARY_S (the unlocked moment between creating a temporary and locking it, and the
  JSON's short-lived one, are far younger). When a build starts, not only when it completes: a job
  preempted again and again while it tokenizes a large corpus never completes one, and each
  attempt left its partial copy of the tokens for good. When an entry is loaded too: a job killed
  while it tokenized and restarted at once (its temporary seconds old) completed the entry, and
  every later start loaded it without building, so that temporary, as large as the corpus's
  tokens, stayed for good.
On a file system without flock nothing is evicted. Eviction never fails a run: it is upkeep, and
an error in it is ignored.

The tokens are memory-mapped copy-on-write (numpy `mode="c"`): pages are read when a batch touches
them, so a corpus larger than memory works, and the file is never written through the mapping.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import time
import warnings
import weakref
import zlib
from pathlib import Path
from typing import IO, Iterable, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch

from io_engine.atomic_file import TEMP_MARKER, atomic_open, write_atomic

from offload_trainer.config import json_text
from offload_trainer.app.data.documents import Document, Fields
from offload_trainer.app.data.token_stream import TokenStream, crc32_of, token_dtype, tokenize
from offload_trainer.app.data.tokenizer import Tokenizer

CACHE_DIR_NAME = ".offload-cache"
"""The directory beside the corpus that holds its cache entries (hidden: never read as a document)."""
FORMAT = 2
"""Bumped whenever the stream a corpus gives changes, so old entries are not read as new ones."""
LOAD_ATTEMPTS_AFTER_BUILD = 5
"""Loads build() tries of the entry it has just written (another writer of it may be renaming its copy)."""
KEEP_PER_SOURCE = 2
"""Complete entries of one source a directory keeps: the newest and the one used before it, so that
going back and forth between two tokenizers does not tokenize again ([Note: Token cache eviction])."""
STALE_TEMPORARY_S = 60.0
"""Age after which an unlocked temporary of a cache directory is a killed writer's and is removed (a
live writer locks its temporary a moment after creating it, and holds the lock until it is renamed)."""
_KEY = re.compile(r"^[0-9a-f]{32}$")


def corpus_key(files: List[Path], fingerprint: str, fields: Fields, max_tokens: Optional[int]) -> str:
    """The cache key of a corpus read with a tokenizer (see the module docstring)."""
    described = []
    for file in files:
        st = os.stat(file)
        described.append([str(file.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    blob = json.dumps(
        {"format": FORMAT, "tokenizer": fingerprint, "files": described, "text_field": fields.text,
         "messages_field": fields.messages, "max_tokens": max_tokens},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def user_cache_dir() -> Optional[Path]:
    """The per-user cache ($XDG_CACHE_HOME or ~/.cache)/offload-trainer/tokens: for the default corpus,
    and for corpora whose own directory cannot be written. None when the user has no home (HOME unset
    and no entry in the password database, as for a container's arbitrary user id): "~" would
    otherwise stay "~", a directory of that name made in the working directory. A relative
    XDG_CACHE_HOME is ignored, as the XDG spec says."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "offload-trainer" / "tokens"
    home = os.path.expanduser("~")
    if not os.path.isabs(home):
        return None
    return Path(home) / ".cache" / "offload-trainer" / "tokens"


def beside(corpus: Path) -> Path:
    """The cache directory next to a corpus file or directory: `.offload-cache` in its parent."""
    return corpus.resolve().parent / CACHE_DIR_NAME


def writable(directory: Path) -> bool:
    """Whether entries can be written in `directory` (made if missing)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


class CacheWriteError(OSError):
    """Writing a cache entry failed (a full disk, a quota, a file system gone read-only): trouble of
    the cache's directory, not of the corpus, so load_corpus caches elsewhere or tokenizes into memory.
    Carries the errno and the path of the file written."""


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """An OSError inside is a failed write of the cache file `path` (CacheWriteError)."""
    try:
        yield
    except CacheWriteError:
        raise
    except OSError as exc:
        raise CacheWriteError(exc.errno, exc.strerror or str(exc), str(path)) from exc


class TokenCache:
    """One corpus's entry in a cache directory. `source`: what the corpus is (its path), written
    into the entry; with it, build() evicts the older entries of the same source ([Note: Token
    cache eviction]); None evicts nothing."""

    def __init__(self, directory: Path, key: str, source: Optional[str] = None) -> None:
        self.directory = directory
        self.key = key
        self.source = source
        self.tokens_path = directory / f"{key}.tokens"
        self.trained_path = directory / f"{key}.trained"
        self.meta_path = directory / f"{key}.json"

    def load(self) -> Optional[TokenStream]:
        """The entry, memory-mapped; None when there is none or it is incomplete or inconsistent, or
        being evicted. Holds a shared lock on the entry while the mapping lives, and marks it used."""
        try:
            fd = os.open(self.meta_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        lock = _EntryLock(fd)
        stream = self._map_locked(fd, lock)
        if stream is None:
            lock.release()
            return None
        with contextlib.suppress(OSError):  # used now (a directory the user cannot write keeps the old time)
            os.utime(self.meta_path)
        with contextlib.suppress(OSError):  # upkeep: never fails a load
            _remove_stale_temporaries(self.directory)
        return stream

    def _map_locked(self, fd: int, lock: "_EntryLock") -> Optional[TokenStream]:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # an eviction holds it: the entry is on its way out
        except OSError:
            pass  # no flock here: nothing is evicted on this file system either
        try:
            if os.fstat(fd).st_ino != os.stat(self.meta_path).st_ino:
                return None  # evicted (or replaced) between the open and the lock
            with os.fdopen(os.dup(fd), "rb") as f:
                meta = json_text.loads(f.read().decode("utf-8"))
            num_tokens, dtype, has_trained = int(meta["num_tokens"]), np.dtype(meta["dtype"]), bool(meta["trained"])
            crcs = (int(meta["tokens_crc32"]), int(meta["trained_crc32"]) if has_trained else None)
        except (OSError, ValueError, KeyError, TypeError):
            return None  # incomplete, or written before entries carried CRC32s: built again
        tokens = _map(self.tokens_path, dtype, num_tokens, lock)
        trained = _map(self.trained_path, np.dtype(np.uint8), num_tokens, lock) if has_trained else None
        if tokens is None or (has_trained and trained is None):
            return None
        for path, mapped, crc in ((self.tokens_path, tokens, crcs[0]), (self.trained_path, trained, crcs[1])):
            if mapped is not None and crc32_of(mapped) != crc:
                warnings.warn(
                    f"the token cache entry {path} is corrupted (its bytes fail the CRC32 its {self.meta_path.name} "
                    "records), so it was not used: the corpus is tokenized again and the entry replaced; if this "
                    "recurs, check that disk"
                )
                return None
        return TokenStream(tokens, trained)

    def build(
        self, documents: Iterable[Union[str, Document]], tokenizer: Tokenizer, max_tokens: Optional[int]
    ) -> TokenStream:
        """Tokenize `documents` into the entry (chunk by chunk, never the whole stream in memory),
        then map it."""
        with contextlib.suppress(OSError):  # upkeep: never fails a build
            _remove_stale_temporaries(self.directory)
        dtype = token_dtype(tokenizer.vocab_size)
        tokenized = False
        try:
            with contextlib.ExitStack() as stack:
                sink = _FileSink(stack, self.tokens_path, self.trained_path)
                num_tokens = tokenize(documents, tokenizer, max_tokens, sink)  # a corpus error passes as it is
                tokenized = True
        except OSError as exc:
            if tokenized and not isinstance(exc, CacheWriteError):  # the temporaries' flush, fsync or rename
                raise CacheWriteError(exc.errno, exc.strerror or str(exc), str(self.tokens_path)) from exc
            raise
        meta = {
            "num_tokens": num_tokens, "dtype": dtype.name, "trained": sink.marking, "format": FORMAT,
            "source": self.source, "tokens_crc32": sink.tokens_crc32, "trained_crc32": sink.trained_crc32,
        }
        with _writing(self.meta_path):
            write_atomic(self.meta_path, json.dumps(meta) + "\n")
        # Written a moment ago, yet a load may miss it: another process building the same entry (the
        # ranks of one run, each tokenizing the same corpus) renamed its own copy into place between
        # this write and the load's open and stat, or an eviction of another build held its lock
        # for an instant. Its copy holds the same tokens, so a later load takes it.
        stream = None
        for attempt in range(LOAD_ATTEMPTS_AFTER_BUILD):
            stream = self.load()
            if stream is not None:
                break
            time.sleep(0.05 * (attempt + 1))
        if stream is None:
            raise OSError(f"the token cache entry {self.meta_path} was changed while it was written")
        if self.source is not None:
            with contextlib.suppress(OSError):
                evict(self.directory, self.source, self.key)
        return stream


def evict(directory: Path, source: str, newest_key: str) -> List[str]:
    """Remove the entries of `source` in `directory` beyond the KEEP_PER_SOURCE most recently used
    (`newest_key`'s always kept); returns the keys removed. Entries in use are left ([Note: Token
    cache eviction])."""
    entries: List[Tuple[float, str]] = []
    for name in os.listdir(directory):
        key, dot, suffix = name.partition(".")
        if suffix == "json" and _KEY.match(key) and key != newest_key:
            try:
                path = directory / name
                meta = json_text.loads(path.read_text(encoding="utf-8"))
                if isinstance(meta, dict) and meta.get("source") == source:
                    entries.append((os.stat(path).st_mtime, key))
            except (OSError, ValueError):
                continue
    entries.sort(reverse=True)
    return [key for _, key in entries[KEEP_PER_SOURCE - 1 :] if _remove_entry(directory, key)]


def _remove_entry(directory: Path, key: str) -> bool:
    """Remove entry `key` unless another process (or this one) holds it; True if removed."""
    meta_path = directory / f"{key}.json"
    try:
        fd = os.open(meta_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # in use (EWOULDBLOCK), or no flock on this file system: leave it
        if os.fstat(fd).st_ino != os.stat(meta_path).st_ino:
            return False  # written again since it was listed
        # The JSON first: from here on no one sees a complete entry, whatever else a kill leaves.
        os.unlink(meta_path)
        for suffix in ("tokens", "trained"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / f"{key}.{suffix}")
        return True
    finally:
        os.close(fd)


def _remove_stale_temporaries(directory: Path) -> None:
    """Remove what killed writers and evictions left (unlocked, older than STALE_TEMPORARY_S): their
    temporaries, and an entry's tokens or marks without its JSON. An eviction removes the JSON
    first and a build renames its tokens into place before it writes the JSON: a kill between the
    two left `<key>.tokens`, as large as the corpus's tokens, under a name no upkeep looked at."""
    now = time.time()
    names = set(os.listdir(directory))
    for name in names:
        key, _, suffix = name.partition(".")
        if not _KEY.match(key):
            continue
        orphan = suffix in ("tokens", "trained") and f"{key}.json" not in names
        if TEMP_MARKER not in name and not orphan:
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < STALE_TEMPORARY_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: a live writer holds it (or no flock)
            if orphan and os.path.exists(directory / f"{key}.json"):
                continue  # its JSON was written meanwhile: a complete entry now
            os.unlink(path)
        except OSError:
            continue
        finally:
            os.close(fd)


class _EntryLock:
    """The descriptor of an entry's JSON holding a shared flock, closed (the lock dropped) once
    every mapping of the entry that references this object is gone."""

    def __init__(self, fd: int) -> None:
        self._finalizer = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        """Close the descriptor now (idempotent)."""
        self._finalizer()


def _map(path: Path, dtype: np.dtype, count: int, lock: _EntryLock) -> Optional[torch.Tensor]:
    try:
        size = os.stat(path).st_size
    except OSError:
        return None
    if size != count * dtype.itemsize:
        return None
    if count == 0:
        return torch.empty(0, dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype)
    mapped = np.memmap(path, dtype=dtype, mode="c", shape=(count,))
    mapped._entry_lock = lock  # type: ignore[attr-defined]  # the tensor keeps the memmap, which keeps the lock
    return torch.from_numpy(mapped)


class _FileSink:
    """tokenize()'s chunks appended to the entry's files, and the CRC32 of each as it grows; the marks
    file opened at the first marks, with ones back-filled for the tokens before them."""

    def __init__(self, stack: contextlib.ExitStack, tokens_path: Path, trained_path: Path) -> None:
        self._stack = stack
        with _writing(tokens_path):
            self._tokens: IO[bytes] = stack.enter_context(atomic_open(tokens_path))
        self._tokens_path = tokens_path
        self._trained_path = trained_path
        self._trained: Optional[IO[bytes]] = None
        self._num_unmarked = 0
        self.marking = False
        self.tokens_crc32 = 0
        self.trained_crc32: Optional[int] = None
        """None until the first marks: no marks file."""

    def write(self, tokens: np.ndarray, trained: Optional[np.ndarray]) -> None:
        with _writing(self._tokens_path):  # the entry's files share one directory: the one the user acts on
            self._write(tokens, trained)

    def _write(self, tokens: np.ndarray, trained: Optional[np.ndarray]) -> None:
        raw = memoryview(np.ascontiguousarray(tokens)).cast("B")
        self._tokens.write(raw)
        self.tokens_crc32 = zlib.crc32(raw, self.tokens_crc32)
        if trained is None:
            self._num_unmarked += tokens.size
            return
        if self._trained is None:
            self._trained = self._stack.enter_context(atomic_open(self._trained_path))
            self.trained_crc32 = 0
            ones = np.ones(1 << 20, dtype=np.uint8)
            while self._num_unmarked:
                n = min(self._num_unmarked, ones.size)
                self._write_marks(memoryview(ones[:n]))
                self._num_unmarked -= n
            self.marking = True
        self._write_marks(memoryview(np.ascontiguousarray(trained, dtype=np.uint8)))

    def _write_marks(self, raw: memoryview) -> None:
        assert self._trained is not None and self.trained_crc32 is not None
        self._trained.write(raw)
        self.trained_crc32 = zlib.crc32(raw, self.trained_crc32)
