"""The corpus offload-train trains on: data.path read, tokenized once, cached beside it, memory-mapped.

    data = load_corpus(cfg.data, lm.tokenizer)        # a PackedDataset

The first start tokenizes the documents into the token cache (token_cache.py) next to the data
(`.offload-cache/` in the corpus's parent directory, or `data.cache_dir`); later starts with the
same files and tokenizer map that entry and tokenize nothing. The default corpus (the standard
library), and a corpus whose directory cannot be written, are cached in the user's cache directory.
A write that fails on the way (a full disk, a quota) moves on to the next directory, and at last to
memory, with a warning: the cache saves time, and losing it is no reason to stop a run.
A tokenizer without a fingerprint() is not cached. Either way the stream, and so the resumable
order of batches, is the same. When documents are tokenized (no entry found), `say` gets a line
before and after (a large corpus takes minutes).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Callable, ContextManager, List, Optional

from offload_trainer.app.data.documents import Fields, corpus_files, default_corpus_dir, iter_documents
from offload_trainer.app.data.packed_dataset import PackedDataset
from offload_trainer.app.data.token_cache import (
    CacheWriteError,
    TokenCache,
    beside,
    corpus_key,
    user_cache_dir,
    writable,
)
from offload_trainer.app.data.token_stream import TokenStream, tokenize_to_memory
from offload_trainer.app.data.tokenizer import Tokenizer, tokenizer_fingerprint
from offload_trainer.app.progress import phase
from offload_trainer.app.run_config import DataConfig


def load_corpus(
    data: DataConfig, tokenizer: Tokenizer, say: Optional[Callable[[str], None]] = None
) -> PackedDataset:
    """The PackedDataset of `data` (its path, fields, seq_len, eval_fraction, max_tokens) under `tokenizer`;
    `say` gets the lines around a tokenization."""
    path = Path(data.path) if data.path is not None else default_corpus_dir()
    fields = Fields(data.text_field, data.messages_field)
    files = corpus_files(path)
    fingerprint = tokenizer_fingerprint(tokenizer)

    def tokenizing() -> ContextManager[None]:
        if say is None:
            return contextlib.nullcontext()
        mib = sum(f.stat().st_size for f in files) / 2**20
        return phase(say, f"tokenizing {path} ({len(files)} file(s), {mib:,.1f} MiB)", "tokenized the corpus")

    if fingerprint is None:
        with tokenizing():
            stream = tokenize_to_memory(iter_documents(path, fields), tokenizer, data.max_tokens)
    else:
        key = corpus_key(files, fingerprint, fields, data.max_tokens)
        explicit = data.cache_dir is not None
        stream = _cached(cache_dirs(data, path), key, path, fields, tokenizer, data.max_tokens, explicit, tokenizing)
    return PackedDataset.from_stream(stream, tokenizer.vocab_size, data.seq_len, data.eval_fraction, data.max_tokens)


def max_tokens_note(data: DataConfig, dataset: PackedDataset) -> "str | None":
    """A line saying that data.max_tokens cut the corpus (the run trains on a prefix of it), or None.
    Tokenization stops at the cut, so the corpus's full size is not known."""
    if data.path is None or data.max_tokens is None or dataset.num_tokens < data.max_tokens:
        return None  # the default corpus (the standard library) is cut by design: the default run's size
    return (
        f"data.max_tokens={data.max_tokens} cut the corpus: the run trains on the first {data.max_tokens:,} tokens of "
        f"data.path={data.path!r} (its files in sorted order); raise data.max_tokens, or set it to none for every token"
    )


def cache_dirs(data: DataConfig, path: Path) -> List[Path]:
    """Where the corpus's entry is looked for, and written in the first that can be written (none:
    the user has no home directory and the corpus is the default one)."""
    if data.cache_dir is not None:
        return [Path(data.cache_dir)]
    user = [] if (home := user_cache_dir()) is None else [home]
    if data.path is None:
        return user
    return [beside(path), *user]


def _cached(
    directories: List[Path], key: str, path: Path, fields: Fields, tokenizer: Tokenizer, max_tokens: "int | None",
    explicit: bool, tokenizing: Callable[[], ContextManager[None]],
) -> TokenStream:
    """The entry found in `directories`, or built in the first writable one; in memory if none is
    (a ValueError if that one was data.cache_dir, `explicit`)."""
    for directory in directories:
        stream = TokenCache(directory, key).load()
        if stream is not None:
            return stream
    failed: List[str] = []  # "DIR (why)" of each directory whose write failed
    unwritable: List[str] = []  # "DIR (not writable)": said only if no directory could take the entry
    for directory in directories:
        made = not os.path.lexists(directory)
        if not writable(directory):
            unwritable.append(f"{directory} (not writable)")
        else:
            cache = TokenCache(directory, key, source=str(path.resolve()))  # evicts the older entries of `path`
            try:
                with tokenizing():
                    stream = cache.build(iter_documents(path, fields), tokenizer, max_tokens)
            except BaseException as exc:
                if not isinstance(exc, CacheWriteError):  # a refused corpus, an interruption: the run ends
                    if made:  # without an empty .offload-cache left beside the user's data
                        with contextlib.suppress(OSError):
                            directory.rmdir()  # only if empty: another process's entries stay
                    raise
                # A full disk, a quota: the cache's trouble, not the run's.
                if explicit:
                    raise ValueError(
                        f"data.cache_dir={str(directory)!r}: the token cache could not be written there "
                        f"({exc.strerror}); free space there, or name another directory (or leave data.cache_dir "
                        "out to cache beside the data)"
                    ) from exc
                failed.append(f"{directory} ({exc.strerror})")
                continue
            _warn_failed(failed, f"so it was written in {directory}")
            return stream
    if explicit:
        raise ValueError(
            f"data.cache_dir={str(directories[0])!r} cannot be written: name a writable directory for the token "
            "cache, or leave it out to cache beside the data"
        )
    # Unwritable ones too: with a read-only corpus directory and an unwritable home (a container's),
    # every start tokenized the whole corpus again and nothing said why.
    _warn_failed(failed + unwritable, "so the corpus is tokenized again at each start")
    with tokenizing():
        return tokenize_to_memory(iter_documents(path, fields), tokenizer, max_tokens)  # nowhere to cache


def _warn_failed(failed: List[str], outcome: str) -> None:
    if failed:
        warnings.warn(
            f"the token cache could not be written in {' or '.join(failed)}, {outcome}; free space there (or make it "
            "writable), or set data.cache_dir to a writable directory with room",
            stacklevel=3,
        )
