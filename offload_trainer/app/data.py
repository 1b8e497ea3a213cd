"""The trainer's data pipeline: text files -> byte tokens -> packed sequences -> resumable batches.

    docs = read_documents(default_corpus_dir())           # or a directory of .txt/.md/.py/.jsonl
    data = PackedDataset(docs, ByteTokenizer(), seq_len=256, max_tokens=4_000_000)
    stream = BatchStream(data, batch_size=8, seed=0)
    inputs, targets = stream.next_batch()                 # LongTensor [8, 256] each
    saved = stream.state_dict()                           # {"epoch", "position", "seed"}, JSON-safe
    for inputs, targets in data.eval_batches(8): ...      # the held-out tail, same for every seed

The default corpus is the Python standard library's own source, so a run needs no download.
The token stream is held as one compact tensor (uint8 for byte tokens: one byte a token), so a
few hundred MB of text fits in memory; batches are gathered from it with one indexing op.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import stat
from dataclasses import dataclass
from typing import Iterator, Mapping, Protocol, Sequence

import torch

SEPARATOR_ID = 0
"""The token between two documents. For byte tokens it is byte 0, which text almost never holds."""

TEXT_SUFFIXES = (".txt", ".md", ".py")
"""Files read whole, as one document each."""
JSONL_SUFFIXES = (".jsonl",)
"""Files read as one JSON object a line, the document in its "text" field."""
ACCEPTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES

SKIPPED_DIR_NAMES = frozenset({"__pycache__", "site-packages", "dist-packages"})
"""Directories never descended into (nor are hidden ones, whose names start with "."). Installed
packages live in site-packages under the standard library's directory: skipping them keeps the
default corpus the standard library alone, not every package that happens to be installed."""


class Tokenizer(Protocol):
    """What PackedDataset needs of a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab_size 256, no special tokens needed (documents are separated by byte 0).

    Text that cannot be encoded (a lone surrogate, as a JSON "\\ud800" escape gives) becomes "?";
    bytes that are not valid UTF-8 decode to U+FFFD. Neither raises.
    """

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        return list(self.encode_bytes(text))

    def encode_bytes(self, text: str) -> bytes:
        """The tokens as a bytes object: what PackedDataset uses, with no Python int per token."""
        return text.encode("utf-8", errors="replace")

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        try:
            raw = bytes(ids)
        except (ValueError, TypeError) as error:
            bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < self.vocab_size][:5]
            raise ValueError(
                f"ByteTokenizer.decode takes byte tokens, ints in [0, 256); got {bad!r} among the ids. "
                "Decode only ids this tokenizer (or a model with vocab_size 256) produced."
            ) from error
        return raw.decode("utf-8", errors="replace")


def default_corpus_dir() -> pathlib.Path:
    """A corpus present on every machine without a download: the Python standard library's own
    source directory (the directory of the `os` module), whose *.py files are the documents.

    read_documents skips its site-packages, so the corpus does not depend on what is installed.
    About 30 MB of source on CPython 3.11 with its test suite; builds that ship the standard
    library only as .pyc files have no usable file here, and read_documents says so.
    """
    return pathlib.Path(os.__file__).resolve().parent


class CorpusNotFoundError(ValueError, FileNotFoundError):
    """The corpus path does not exist. A ValueError (the user named it) and a FileNotFoundError."""


@dataclass(frozen=True)
class Document:
    """One document and where it came from."""

    text: str
    path: pathlib.Path | None = None
    """The file it was read from; None for text given directly."""
    line: int | None = None
    """The 1-based line of a .jsonl file it was read from; None for whole-file documents."""


def read_documents(path: str | os.PathLike) -> list[str]:
    """Every document under `path` (a directory, read recursively in sorted order, or one file).

    *.txt, *.md and *.py files are one document each (*.py so that the default corpus works);
    *.jsonl files give one document per line, taken from its "text" field (blank lines are
    skipped; a line without the field, or bad JSON, raises ValueError naming the file, the line
    number and the fix). Files with other suffixes are ignored. Sorted order is by path relative
    to `path`, compared part by part (a directory's files before those of a later sibling
    directory). Hidden files and directories, __pycache__, site-packages and dist-packages are
    skipped; symlinked directories are not followed. Bytes that are not UTF-8 are replaced (a
    leading BOM is dropped).

    Raises CorpusNotFoundError (a ValueError and a FileNotFoundError) if `path` does not exist,
    and ValueError if it holds no file with an accepted suffix, or if `path` or one of its files
    with an accepted suffix is not a regular file (a FIFO would block the read forever; a dangling
    symlink has nothing to read).
    """
    return [document.text for document in load_documents(path)]


def load_documents(path: str | os.PathLike) -> list[Document]:
    """read_documents, keeping each document's file (and line, for .jsonl)."""
    root = pathlib.Path(path)
    if not root.exists():
        raise CorpusNotFoundError(
            f"no corpus at {str(root)!r}: expected a directory of (or one) {_suffix_list()} files. "
            "Check the path, or leave it out to train on the default corpus (the Python standard library)."
        )
    if not root.is_dir():
        _check_regular(root)
    if root.is_file():
        if root.suffix not in ACCEPTED_SUFFIXES:
            raise ValueError(
                f"cannot read {str(root)!r} as a corpus: its suffix {root.suffix!r} is not one of "
                f"{_suffix_list()}. Rename it, or convert it to .jsonl with one {{\"text\": ...}} object a line."
            )
        files = [root]
    else:
        files = _corpus_files(root)
        if not files:
            raise ValueError(
                f"the directory {str(root)!r} holds no usable file: documents are read from files ending in "
                f"{_suffix_list()} (hidden, __pycache__, site-packages and dist-packages directories are "
                "skipped). Point at a directory that has some."
            )
    for file in files:
        _check_regular(file)
    documents: list[Document] = []
    for file in files:
        if file.suffix in JSONL_SUFFIXES:
            documents.extend(_read_jsonl(file))
        else:
            documents.append(Document(text=_read_text(file), path=file))
    return documents


def _check_regular(file: pathlib.Path) -> None:
    """A corpus file must be a regular file (or a symlink to one): reading a FIFO blocks forever."""
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        raise ValueError(
            f"cannot read {str(file)!r}: it is a symbolic link to {os.readlink(file)!r}, which does not exist. "
            "Fix or remove the link."
        ) from None
    if not stat.S_ISREG(mode):
        what = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise ValueError(
            f"cannot read {str(file)!r} as a corpus: it is {what}, not a regular file. Remove it from the corpus, "
            "or point data.path at regular files."
        )


def _suffix_list() -> str:
    return ", ".join(ACCEPTED_SUFFIXES)


def _corpus_files(root: pathlib.Path) -> list[pathlib.Path]:
    found: list[pathlib.Path] = []
    for dir_path, dir_names, file_names in os.walk(root, followlinks=False):
        # Pruning in place is how os.walk is told not to descend.
        dir_names[:] = [d for d in dir_names if not d.startswith(".") and d not in SKIPPED_DIR_NAMES]
        for name in file_names:
            if not name.startswith(".") and os.path.splitext(name)[1] in ACCEPTED_SUFFIXES:
                found.append(pathlib.Path(dir_path, name))
    return sorted(found, key=lambda file: file.relative_to(root).parts)


def _read_text(file: pathlib.Path) -> str:
    return file.read_bytes().decode("utf-8-sig", errors="replace")


def _read_jsonl(file: pathlib.Path) -> list[Document]:
    documents: list[Document] = []
    # Split on "\n" only: str.splitlines would also split on U+2028, which JSON strings may hold raw.
    for line_number, line in enumerate(_read_text(file).split("\n"), start=1):
        if not line.strip():
            continue
        fix = 'Each line must be one JSON object with a string "text" field, e.g. {"text": "..."}.'
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{file}:{line_number}: bad JSON ({error.msg} at column {error.colno}). {fix}") from None
        if not isinstance(record, dict) or "text" not in record:
            raise ValueError(f'{file}:{line_number}: no "text" field in {line[:80]!r}. {fix}')
        if not isinstance(record["text"], str):
            raise ValueError(
                f'{file}:{line_number}: the "text" field is not a string but {type(record["text"]).__name__} '
                f"{record['text']!r:.40}. {fix}"
            )
        documents.append(Document(text=record["text"], path=file, line=line_number))
    return documents


class PackedDataset:
    """All documents tokenized, joined with a separator token (0), cut into fixed-length
    sequences of seq_len + 1 tokens (inputs and targets shifted by one), packed without padding.

    Sequence i is tokens [i * (seq_len + 1), (i + 1) * (seq_len + 1)) of the stream; the tail
    that does not fill a sequence is dropped. `max_tokens` cuts the stream (separators included)
    to at most that many tokens, and documents past the cut are never tokenized.

    A held-out split: the last `eval_fraction` of the sequences (rounded down, but at least 1 when
    there are >= 2 sequences and eval_fraction > 0) is the eval set, decided before any shuffling
    so it never changes with the seed. At least 2 training sequences must remain.

    The stream is one tensor of the smallest dtype that holds vocab_size ids: uint8 for byte
    tokens, int16 up to 32768, else int32. Token ids from a tokenizer other than ByteTokenizer
    must lie in [0, vocab_size).
    """

    def __init__(
        self,
        documents: Sequence[str],
        tokenizer: Tokenizer,
        seq_len: int,
        eval_fraction: float = 0.05,
        max_tokens: int | None = None,
    ) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1 (tokens a model sees at once); got {seq_len!r}.")
        if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not (
            0.0 <= eval_fraction < 1.0
        ):
            raise ValueError(
                f"eval_fraction must be a number in [0, 1) (the share of sequences held out; 0 for none); "
                f"got {eval_fraction!r}."
            )
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an int >= 1, or None for every token; got {max_tokens!r}.")
        if isinstance(documents, str):
            raise ValueError("documents must be a sequence of strings, not one string: wrap it as [text].")
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"the tokenizer must have an int vocab_size >= 1; {tokenizer!r} has {vocab_size!r}.")

        self.seq_len = seq_len
        self.eval_fraction = float(eval_fraction)
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        if isinstance(tokenizer, ByteTokenizer):
            tokens = _pack_bytes(documents, tokenizer, max_tokens)
        else:
            tokens = _pack_ids(documents, tokenizer, max_tokens, _token_dtype(vocab_size))

        sequence_numel = seq_len + 1
        num_sequences = tokens.numel() // sequence_numel
        num_eval = _num_eval_sequences(num_sequences, self.eval_fraction)
        if num_sequences - num_eval < 2:
            needed_sequences = _min_sequences(self.eval_fraction)
            cut = f" (cut to max_tokens={max_tokens}: raise it)" if max_tokens is not None else ""
            raise ValueError(
                f"too little data: the documents give {tokens.numel()} tokens{cut}, but seq_len={seq_len} with "
                f"eval_fraction={eval_fraction} needs at least {needed_sequences * sequence_numel} tokens "
                f"({needed_sequences} sequences of seq_len + 1 = {sequence_numel}: 2 to train on, "
                f"{needed_sequences - 2} held out). Give more text, or a smaller seq_len or eval_fraction."
            )
        self.num_tokens = tokens.numel()
        """Tokens in the stream, separators included, after max_tokens; the sequences use a prefix."""
        self.num_train_sequences = num_sequences - num_eval
        self.num_eval_sequences = num_eval
        # Views into the one stream: [num_sequences, seq_len + 1], no copy.
        sequences = tokens[: num_sequences * sequence_numel].view(num_sequences, sequence_numel)
        self._train = sequences[: self.num_train_sequences]
        self._eval = sequences[self.num_train_sequences :]

    @property
    def dtype(self) -> torch.dtype:
        """How the stream is stored (uint8 for byte tokens)."""
        return self._train.dtype

    def train_sequence(self, i: int) -> torch.Tensor:
        """Training sequence i as a LongTensor [seq_len + 1]: inputs are [:-1], targets [1:]."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_train_sequences:
            raise IndexError(f"training sequence {i!r} does not exist: i must be in [0, {self.num_train_sequences}).")
        return self._train[i].long()

    def train_sequences(self, indices: torch.Tensor) -> torch.Tensor:
        """The training sequences at `indices` (a 1-D integer tensor) as a LongTensor [len, seq_len + 1]."""
        return self._train[indices].long()

    def eval_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs [B, seq_len], targets [B, seq_len]) LongTensors over every eval sequence, in order;
        the last batch may be smaller. Yields nothing when eval_fraction is 0."""
        _check_batch_size(batch_size)
        # Checked above, not in the generator, so that a bad batch_size raises at the call.
        return self._eval_batches(batch_size)

    def _eval_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, self.num_eval_sequences, batch_size):
            yield _split(self._eval[start : start + batch_size].long())


class BatchStream:
    """A deterministic, resumable order over the training sequences.

    Epoch e uses a permutation of the training sequences drawn from a torch.Generator seeded with
    a hash of (seed, e). Batches are consecutive slices of the endless concatenation of the
    epochs' permutations: every batch holds exactly batch_size sequences, one that crosses an
    epoch's end takes its rest from the next epoch, and every sequence is seen once per epoch.

    state_dict() -> {"epoch", "position", "seed"} (plain ints, JSON-serialisable): the epoch and
    the index in its permutation of the next sequence to hand out. load_state_dict() restores it
    exactly (the saved seed included), so a resumed run sees the same batches as an
    uninterrupted one.
    """

    def __init__(self, dataset: PackedDataset, batch_size: int, seed: int) -> None:
        if not isinstance(dataset, PackedDataset):
            raise TypeError(f"BatchStream reads a PackedDataset; got a {type(dataset).__name__}.")
        _check_batch_size(batch_size)
        _check_int("seed", seed, minimum=None)
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._permutation: torch.Tensor | None = None
        """The current epoch's order, drawn when first needed; None after the epoch changes."""

    @property
    def tokens_per_batch(self) -> int:
        """Tokens a batch trains on: batch_size * seq_len (the targets)."""
        return self.batch_size * self.dataset.seq_len

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B, seq_len], targets [B, seq_len]) LongTensors, new tensors each call (a caller
        may keep or move them while the next batch is made)."""
        num_sequences = self.dataset.num_train_sequences
        parts: list[torch.Tensor] = []
        needed = self.batch_size
        while needed:
            if self._permutation is None:
                self._permutation = self._draw_permutation(self.epoch)
            taken = min(needed, num_sequences - self.position)
            parts.append(self._permutation[self.position : self.position + taken])
            self.position += taken
            needed -= taken
            if self.position == num_sequences:
                self.epoch += 1
                self.position = 0
                self._permutation = None
        indices = parts[0] if len(parts) == 1 else torch.cat(parts)
        return _split(self.dataset.train_sequences(indices))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a state_dict() (possibly after a JSON round trip). Everything is checked before
        anything changes."""
        if not isinstance(state, Mapping):
            raise ValueError(
                f"a BatchStream state is a dict with epoch, position and seed; got a {type(state).__name__}."
            )
        expected = {"epoch", "position", "seed"}
        missing, unexpected = sorted(expected - state.keys()), sorted(set(state.keys()) - expected)
        if missing or unexpected:
            raise ValueError(
                f"a BatchStream state has exactly the keys {sorted(expected)}; this one lacks {missing} and has "
                f"unexpected {unexpected}. Pass what BatchStream.state_dict() returned."
            )
        _check_int("state['epoch']", state["epoch"], minimum=0)
        _check_int("state['seed']", state["seed"], minimum=None)
        position = state["position"]
        _check_int("state['position']", position, minimum=0)
        if position >= self.dataset.num_train_sequences:
            raise ValueError(
                f"state['position'] is {position}, but the dataset has {self.dataset.num_train_sequences} training "
                "sequences: the state was saved over different data. Rebuild the dataset with the same "
                "documents, seq_len, eval_fraction and max_tokens as the saved run."
            )
        self.epoch, self.position, self.seed = state["epoch"], position, state["seed"]
        self._permutation = None

    def _draw_permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(self.dataset.num_train_sequences, generator=generator)


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash, not seed + epoch, so that (seed, epoch + 1) and (seed + 1, epoch) draw unrelated orders.
    digest = hashlib.sha256(f"{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _split(sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Contiguous, so that callers may .view() them (a shifted slice of a row is not).
    return sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous()


def _pack_bytes(documents: Sequence[str], tokenizer: ByteTokenizer, max_tokens: int | None) -> torch.Tensor:
    stream = bytearray()
    for index, text in enumerate(documents):
        if max_tokens is not None and len(stream) >= max_tokens:
            break
        _check_document(index, text)
        if index:
            stream.append(SEPARATOR_ID)
        stream += tokenizer.encode_bytes(text)
    if max_tokens is not None:
        del stream[max_tokens:]
    if not stream:
        return torch.empty(0, dtype=torch.uint8)
    # frombuffer shares the bytearray's memory: the stream is never copied.
    return torch.frombuffer(stream, dtype=torch.uint8)


def _pack_ids(
    documents: Sequence[str], tokenizer: Tokenizer, max_tokens: int | None, dtype: torch.dtype
) -> torch.Tensor:
    chunks: list[torch.Tensor] = []
    num_tokens = 0
    separator = torch.tensor([SEPARATOR_ID], dtype=dtype)
    for index, text in enumerate(documents):
        if max_tokens is not None and num_tokens >= max_tokens:
            break
        _check_document(index, text)
        ids = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
            raise ValueError(
                f"document {index}: the tokenizer gave ids in [{int(ids.min())}, {int(ids.max())}], outside "
                f"[0, vocab_size={tokenizer.vocab_size}). Fix the tokenizer's encode or its vocab_size."
            )
        if index:
            chunks.append(separator)
            num_tokens += 1
        chunks.append(ids.to(dtype))
        num_tokens += ids.numel()
    tokens = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype)
    return tokens[:max_tokens].clone() if max_tokens is not None and tokens.numel() > max_tokens else tokens


def _check_document(index: int, text: object) -> None:
    if not isinstance(text, str):
        hint = " (pass document.text, or use read_documents)" if isinstance(text, Document) else ""
        raise ValueError(f"document {index} is a {type(text).__name__}, not a str{hint}.")


def _token_dtype(vocab_size: int) -> torch.dtype:
    if vocab_size <= 2**8:
        return torch.uint8
    if vocab_size <= 2**15:
        return torch.int16
    return torch.int32


def _num_eval_sequences(num_sequences: int, eval_fraction: float) -> int:
    if num_sequences < 2 or eval_fraction == 0.0:
        return 0
    # The epsilon keeps 100 * 0.29 = 28.999999999999996 from rounding down to 28.
    return max(1, math.floor(num_sequences * eval_fraction + 1e-9))


def _min_sequences(eval_fraction: float) -> int:
    num_sequences = 2
    while num_sequences - _num_eval_sequences(num_sequences, eval_fraction) < 2:
        num_sequences += 1
    return num_sequences


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1 (sequences a batch holds); got {batch_size!r}.")


def _check_int(name: str, value: object, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int; got {value!r} ({type(value).__name__}).")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}.")
