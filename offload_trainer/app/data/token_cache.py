"""The tokenized corpus on disk, memory-mapped: a second start reads it instead of tokenizing.

    cache = TokenCache(directory, corpus_key(files, tokenizer_fingerprint, fields, max_tokens))
    stream = cache.load()                       # a memory-mapped TokenStream, or None
    stream = stream or cache.build(documents, tokenizer, max_tokens)

An entry is three files named by the key: `<key>.tokens` (the ids, raw, in the stream's dtype),
`<key>.trained` (one byte a token, only for corpora with chat prompts) and `<key>.json` (the count
and dtype), each written through io_engine's atomic files, the JSON last: an entry is complete when
its JSON exists, and a killed writer leaves only `*.tmp-*` files. The key hashes the tokenizer's
fingerprint, every corpus file's path, size and modification time, the fields read and max_tokens,
so a changed file or tokenizer makes a new entry (old ones are left for the user to remove).

The tokens are memory-mapped copy-on-write (numpy `mode="c"`): pages are read when a batch touches
them, so a corpus larger than memory works, and the file is never written through the mapping.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import IO, Iterable, List, Optional, Union

import numpy as np
import torch

from io_engine.atomic_file import atomic_open, write_atomic

from offload_trainer.app.data.documents import Document, Fields
from offload_trainer.app.data.token_stream import TokenStream, token_dtype, tokenize
from offload_trainer.app.data.tokenizer import Tokenizer

CACHE_DIR_NAME = ".offload-cache"
"""The directory beside the corpus that holds its cache entries (hidden: never read as a document)."""
FORMAT = 1
"""Bumped whenever the stream a corpus gives changes, so old entries are not read as new ones."""


def corpus_key(files: List[Path], fingerprint: str, fields: Fields, max_tokens: Optional[int]) -> str:
    """The cache key of a corpus read with a tokenizer (see the module docstring)."""
    described = []
    for file in files:
        st = os.stat(file)
        described.append([str(file.resolve()), st.st_size, st.st_mtime_ns])
    blob = json.dumps(
        {"format": FORMAT, "tokenizer": fingerprint, "files": described, "text_field": fields.text,
         "messages_field": fields.messages, "max_tokens": max_tokens},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def user_cache_dir() -> Path:
    """The per-user cache ($XDG_CACHE_HOME or ~/.cache)/offload-trainer/tokens: for the default corpus,
    and for corpora whose own directory cannot be written."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "offload-trainer" / "tokens"


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


class TokenCache:
    """One corpus's entry in a cache directory."""

    def __init__(self, directory: Path, key: str) -> None:
        self.directory = directory
        self.key = key
        self.tokens_path = directory / f"{key}.tokens"
        self.trained_path = directory / f"{key}.trained"
        self.meta_path = directory / f"{key}.json"

    def load(self) -> Optional[TokenStream]:
        """The entry, memory-mapped; None when there is none or it is incomplete or inconsistent."""
        try:
            meta = json.loads(self.meta_path.read_text())
            num_tokens, dtype, has_trained = int(meta["num_tokens"]), np.dtype(meta["dtype"]), bool(meta["trained"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        tokens = _map(self.tokens_path, dtype, num_tokens)
        trained = _map(self.trained_path, np.dtype(np.uint8), num_tokens) if has_trained else None
        if tokens is None or (has_trained and trained is None):
            return None
        return TokenStream(tokens, trained)

    def build(
        self, documents: Iterable[Union[str, Document]], tokenizer: Tokenizer, max_tokens: Optional[int]
    ) -> TokenStream:
        """Tokenize `documents` into the entry (chunk by chunk, never the whole stream in memory),
        then map it."""
        dtype = token_dtype(tokenizer.vocab_size)
        with contextlib.ExitStack() as stack:
            sink = _FileSink(stack, self.tokens_path, self.trained_path)
            num_tokens = tokenize(documents, tokenizer, max_tokens, sink)
        meta = {"num_tokens": num_tokens, "dtype": dtype.name, "trained": sink.marking, "format": FORMAT}
        write_atomic(self.meta_path, json.dumps(meta) + "\n")
        stream = self.load()
        if stream is None:  # written a moment ago: only a concurrent writer of another content could do this
            raise OSError(f"the token cache entry {self.meta_path} was changed while it was written")
        return stream


def _map(path: Path, dtype: np.dtype, count: int) -> Optional[torch.Tensor]:
    try:
        size = os.stat(path).st_size
    except OSError:
        return None
    if size != count * dtype.itemsize:
        return None
    if count == 0:
        return torch.empty(0, dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype)
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c", shape=(count,)))


class _FileSink:
    """tokenize()'s chunks appended to the entry's files; the marks file opened at the first marks,
    with ones back-filled for the tokens before them."""

    def __init__(self, stack: contextlib.ExitStack, tokens_path: Path, trained_path: Path) -> None:
        self._stack = stack
        self._tokens: IO[bytes] = stack.enter_context(atomic_open(tokens_path))
        self._trained_path = trained_path
        self._trained: Optional[IO[bytes]] = None
        self._num_unmarked = 0
        self.marking = False

    def write(self, tokens: np.ndarray, trained: Optional[np.ndarray]) -> None:
        self._tokens.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        if trained is None:
            self._num_unmarked += tokens.size
            return
        if self._trained is None:
            self._trained = self._stack.enter_context(atomic_open(self._trained_path))
            ones = np.ones(1 << 20, dtype=np.uint8)
            while self._num_unmarked:
                n = min(self._num_unmarked, ones.size)
                self._trained.write(memoryview(ones[:n]))
                self._num_unmarked -= n
            self.marking = True
        self._trained.write(memoryview(np.ascontiguousarray(trained, dtype=np.uint8)))
