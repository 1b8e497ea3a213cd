"""Documents from local files: text files, JSONL, parquet and Hugging Face datasets saved to disk.

    for document in iter_documents("/data/corpus", text_field="text"):   # lazily, in a fixed order
        document.text or document.messages

A document is either text or a conversation (`messages`, rendered later with the tokenizer's chat
template). What is read:

- `*.txt`, `*.md`, `*.py`: one document a file (`*.py` so that the default corpus works);
- `*.jsonl`: one a line, from its `text_field` (default "text") or, lacking it, its `messages_field`
  (default "messages": a chat conversation);
- `*.parquet` (the `data` extra, pyarrow): one a row, from the column of the same name;
- a directory written by `datasets`' `save_to_disk` (the `data` extra; a DatasetDict's "train"
  split): one a row, likewise.

The default corpus is the Python standard library's own source, so a run needs no download.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import pathlib
import re
import stat
from dataclasses import dataclass
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

from offload_trainer.config import json_text
from offload_trainer.app.data.chat import check_messages
from offload_trainer.app.hub_names import dataset_download_hint

TEXT_SUFFIXES = (".txt", ".md", ".py")
"""Files read whole, as one document each."""
JSONL_SUFFIXES = (".jsonl",)
"""Files read as one JSON object a line, the document in its text (or messages) field."""
PARQUET_SUFFIXES = (".parquet",)
"""Files read a row at a time (pyarrow), the document in the text (or messages) column."""
ACCEPTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES

COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
"""Compressions offload-train does not read: a corpus file under one (data.jsonl.gz) is refused, not skipped."""

SAVED_DATASET_FILES = ("dataset_info.json", "state.json")
"""A directory holding both was written by datasets' Dataset.save_to_disk."""
SAVED_DATASET_DICT_FILE = "dataset_dict.json"
"""A directory holding this was written by datasets' DatasetDict.save_to_disk."""
DATASET_SPLIT = "train"
"""The split read from a saved DatasetDict."""

SKIPPED_DIR_NAMES = frozenset({"__pycache__", "site-packages", "dist-packages"})
"""Directories never descended into (nor are hidden ones, whose names start with "."). Installed
packages live in site-packages under the standard library's directory: skipping them keeps the
default corpus the standard library alone, not every package that happens to be installed."""

_ROWS_PER_BATCH = 1024
"""Rows read at once from parquet files and saved datasets."""


def default_corpus_dir() -> pathlib.Path:
    """A corpus present on every machine without a download: the Python standard library's own
    source directory (the directory of the `os` module), whose *.py files are the documents.

    Its site-packages are skipped, so the corpus does not depend on what is installed. About 30 MB
    of source on CPython 3.11 with its test suite; builds that ship the standard library only as
    .pyc files have no usable file here, and reading it says so.
    """
    return pathlib.Path(os.__file__).resolve().parent


class CorpusNotFoundError(ValueError, FileNotFoundError):
    """The corpus path does not exist. A ValueError (the user named it) and a FileNotFoundError."""


@dataclass(frozen=True)
class Document:
    """One document and where it came from: text, or a conversation."""

    text: str = ""
    path: pathlib.Path | None = None
    """The file (or saved dataset directory) it was read from; None for text given directly."""
    line: int | None = None
    """The 1-based line of a .jsonl file, or row of a parquet file or dataset; None for whole files."""
    messages: Optional[Tuple[Mapping[str, Any], ...]] = None
    """A chat conversation ({"role", "content"} objects) instead of text; None for text documents."""


@dataclass(frozen=True)
class Fields:
    """Which field of a record holds a document."""

    text: str = "text"
    messages: str = "messages"


def read_documents(path: str | os.PathLike, fields: Fields = Fields()) -> list[str]:
    """The text of every document under `path` (a directory, read recursively in sorted order, or
    one file); see load_documents."""
    return [document.text for document in iter_documents(path, fields)]


def load_documents(path: str | os.PathLike, fields: Fields = Fields()) -> list[Document]:
    """Every document under `path`, with its file (and line or row).

    Sorted order is by path relative to `path`, compared part by part (a directory's files before
    those of a later sibling directory). Hidden files and directories, __pycache__, site-packages
    and dist-packages are skipped; symlinked directories are not followed. Stray bytes that are not
    UTF-8 are replaced (a leading BOM is dropped); a .txt, .md, .py or .jsonl file holding a NUL byte
    is binary, not text, and one with more bytes that are not UTF-8 than characters beyond ASCII that
    are is in another encoding (Latin-1, cp1252): both are refused (ValueError), except in the
    default corpus, whose encoding test fixtures are replaced as before.

    Raises CorpusNotFoundError (a ValueError and a FileNotFoundError) if `path` does not exist,
    and ValueError if it holds no file with an accepted suffix, if `path` or one of its files with
    an accepted suffix is not a regular file (a FIFO would block the read forever; a dangling
    symlink has nothing to read), or if a record lacks its field (naming the file, the line and
    the fix).
    """
    return list(iter_documents(path, fields))


def iter_documents(path: str | os.PathLike, fields: Fields = Fields()) -> Iterator[Document]:
    """load_documents one document at a time (a corpus larger than memory is never held whole).
    The files are listed and checked before the first document is yielded."""
    root = pathlib.Path(path)
    files = corpus_files(root)
    if is_saved_dataset(root):
        return _read_saved_dataset(root, fields)
    # The standard library holds encoding test fixtures (Latin-1, KOI8-R, Big5, ...) on purpose: the
    # default corpus keeps replacing their bytes, as it always has (its stream and orders unchanged).
    other_encodings = OtherEncodings.REPLACED if _is_default_corpus(root) else OtherEncodings.REFUSED
    return _iter_files(files, fields, other_encodings)


class OtherEncodings(enum.Enum):
    """What reading a text file does with one that is not UTF-8 (see _read_text)."""

    REFUSED = "refused"
    """ValueError naming the file, the first byte that is not UTF-8 and how to convert it."""
    REPLACED = "replaced"
    """Its bytes that are not UTF-8 become U+FFFD (the default corpus: the standard library)."""


def _is_default_corpus(root: pathlib.Path) -> bool:
    try:
        return root.resolve() == default_corpus_dir()
    except OSError:
        return False


def _iter_files(files: List[pathlib.Path], fields: Fields, other_encodings: OtherEncodings) -> Iterator[Document]:
    for file in files:
        if file.suffix in JSONL_SUFFIXES:
            yield from _read_jsonl(file, fields, other_encodings)
        elif file.suffix in PARQUET_SUFFIXES:
            yield from _read_parquet(file, fields)
        else:
            yield Document(text=_read_text(file, other_encodings), path=file)


def is_saved_dataset(root: pathlib.Path) -> bool:
    """Whether `root` is a directory written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return root.is_dir() and (
        all((root / n).is_file() for n in SAVED_DATASET_FILES) or (root / SAVED_DATASET_DICT_FILE).is_file()
    )


def corpus_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The files the documents under `root` are read from, in reading order, each checked to be a
    regular file (a saved dataset's: every file in it). Raises as load_documents does."""
    if not root.exists():
        raise CorpusNotFoundError(
            f"no corpus at {str(root)!r}: expected a directory of (or one) {_suffix_list()} files, or a "
            "Hugging Face dataset saved with save_to_disk. Check the path, or leave it out to train on the "
            f"default corpus (the Python standard library).{dataset_download_hint(str(root))}"
        )
    if not root.is_dir():
        _check_regular(root)
    if is_saved_dataset(root):
        files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.relative_to(root).parts)
    elif root.is_file():
        if root.suffix not in ACCEPTED_SUFFIXES:
            raise ValueError(
                f"cannot read {str(root)!r} as a corpus: its suffix {root.suffix!r} is not one of "
                f"{_suffix_list()}. Rename it, or convert it to .jsonl with one {{\"text\": ...}} object a line."
            )
        files = [root]
    else:
        files = _walk(root)
        if not files:
            raise ValueError(
                f"the directory {str(root)!r} holds no usable file: documents are read from files ending in "
                f"{_suffix_list()} (hidden, __pycache__, site-packages and dist-packages directories are "
                "skipped), or from a dataset saved with save_to_disk. Point at a directory that has some."
            )
    for file in files:
        _check_regular(file)
    return files


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


def _walk(root: pathlib.Path) -> list[pathlib.Path]:
    found: list[pathlib.Path] = []
    compressed: list[pathlib.Path] = []
    for dir_path, dir_names, file_names in os.walk(root, followlinks=False):
        # Pruning in place is how os.walk is told not to descend.
        dir_names[:] = [d for d in dir_names if not d.startswith(".") and d not in SKIPPED_DIR_NAMES]
        for name in file_names:
            if name.startswith("."):
                continue
            stem, suffix = os.path.splitext(name)
            if suffix in ACCEPTED_SUFFIXES:
                found.append(pathlib.Path(dir_path, name))
            elif suffix in COMPRESSED_SUFFIXES and os.path.splitext(stem)[1] in ACCEPTED_SUFFIXES:
                compressed.append(pathlib.Path(dir_path, name))
    if compressed:
        # Skipped as a README or a .csv is, the corpus's data (train.jsonl.gz beside a notes.txt) was left out
        # without a word, the run training on what remained.
        first = min(compressed, key=lambda file: file.relative_to(root).parts)
        raise ValueError(
            f"{str(first)!r} is a compressed {os.path.splitext(first.stem)[1]} file ({first.suffix}), which "
            f"offload-train does not read ({len(compressed)} such file(s) in data.path): decompress it, keeping "
            f"the name it had (e.g. {_DECOMPRESS[first.suffix]} {first.name}), or move it out of data.path"
        )
    return sorted(found, key=lambda file: file.relative_to(root).parts)


_DECOMPRESS = {".gz": "gunzip", ".bz2": "bunzip2", ".xz": "unxz", ".zst": "unzstd", ".lz4": "unlz4"}
"""The command that decompresses each of COMPRESSED_SUFFIXES in place."""


def _read_text(file: pathlib.Path, other_encodings: OtherEncodings) -> str:
    """The file as text: UTF-8, stray bytes that are not replaced (U+FFFD), a leading BOM dropped.
    A NUL byte is never text: the file is binary (an archive, an image, UTF-16) under a text suffix,
    and its replaced bytes would be trained on as if they were the corpus (ValueError). Nor is a
    file in another encoding (Latin-1, cp1252, ...), whose every accented letter would become U+FFFD:
    more bytes that are not UTF-8 than characters beyond ASCII that are (ValueError, unless
    `other_encodings` says they are replaced)."""
    data = file.read_bytes()
    at = data.find(b"\0")
    if at >= 0:
        raise ValueError(
            f"{file} holds a NUL byte (at offset {at}): it is binary data (or UTF-16), not UTF-8 text; remove it "
            "from data.path, or convert it to UTF-8 text"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        first = exc
    if other_encodings is OtherEncodings.REFUSED:
        # Each byte that is not UTF-8 becomes one lone surrogate (U+DC80..U+DCFF), which no UTF-8 decodes to.
        escaped = data.decode("utf-8-sig", errors="surrogateescape")
        foreign = len(_FOREIGN_BYTE.findall(escaped))
        well_formed = len(_BEYOND_ASCII.findall(escaped))
        if foreign > well_formed:
            offset = first.start + (len(data) - len(data.removeprefix(b"\xef\xbb\xbf")))
            raise ValueError(
                f"{file} is not UTF-8 text: byte 0x{data[offset]:02x} at offset {offset} is not UTF-8, nor are "
                f"{foreign - 1} more, against {well_formed} characters beyond ASCII that are (Latin-1, cp1252 or "
                "another encoding, whose letters would all become U+FFFD); convert it to UTF-8 (iconv -f latin1 "
                f"-t utf-8 {file.name} > {file.stem}.utf8{file.suffix}), or remove it from data.path"
            )
    return data.decode("utf-8-sig", errors="replace")


_FOREIGN_BYTE = re.compile("[\udc80-\udcff]")
"""A byte that is not UTF-8, as errors="surrogateescape" decodes it."""
_BEYOND_ASCII = re.compile("[^\x00-\x7f\udc80-\udcff]")
"""A well-formed UTF-8 character beyond ASCII."""


def _record_document(record: object, fields: Fields, file: pathlib.Path, number: int, fix: str) -> Document:
    """The document in one JSON record or table row: its text field, or else its messages field."""
    where = f"{file}:{number}"
    if isinstance(record, Mapping) and fields.text in record:
        text = record[fields.text]
        if not isinstance(text, str):
            raise ValueError(
                f'{where}: the "{fields.text}" field is not a string but {type(text).__name__} {text!r:.40}. {fix}'
            )
        return Document(text=text, path=file, line=number)
    if isinstance(record, Mapping) and record.get(fields.messages) is not None:
        messages = check_messages(record[fields.messages], where)
        return Document(path=file, line=number, messages=tuple(messages))
    shown = json.dumps(record)[:80] if not isinstance(record, Mapping) else repr(dict(record))[:80]
    raise ValueError(f'{where}: no "{fields.text}" field in {shown!r} (nor "{fields.messages}"). {fix}')


def _read_jsonl(file: pathlib.Path, fields: Fields, other_encodings: OtherEncodings) -> Iterator[Document]:
    fix = (
        f'Each line must be one JSON object with a string "{fields.text}" field, e.g. {{"{fields.text}": "..."}}, '
        f'or a "{fields.messages}" list (a chat); data.text_field and data.messages_field name other fields.'
    )
    # Split on "\n" only: str.splitlines would also split on U+2028, which JSON strings may hold raw.
    for line_number, line in enumerate(_read_text(file, other_encodings).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json_text.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{file}:{line_number}: bad JSON ({error.msg} at column {error.colno}). {fix}") from None
        yield _record_document(record, fields, file, line_number, fix)


def _column(names: Sequence[str], fields: Fields, where: str) -> str:
    for name in (fields.text, fields.messages):
        if name in names:
            return name
    raise ValueError(
        f'{where} has no "{fields.text}" column (nor "{fields.messages}"); its columns are {list(names)}. '
        f"Set data.text_field (or data.messages_field) to the column that holds the documents."
    )


def _read_parquet(file: pathlib.Path, fields: Fields) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"reading {str(file)!r} needs pyarrow: pip install 'offload-trainer[data]' (or convert it to .jsonl)"
        ) from None
    import pyarrow

    unreadable = f"{file} is not a readable parquet file"
    with _refusing(pyarrow.ArrowException, unreadable, "convert it again, or remove it from the corpus"):
        parquet = pq.ParquetFile(file)
    column = _column(parquet.schema_arrow.names, fields, str(file))
    fix = f'Every row\'s "{column}" must hold a document.'
    row = 0
    with _refusing(pyarrow.ArrowException, unreadable, "convert it again, or remove it from the corpus"):
        for batch in parquet.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[column]):
            for value in batch.column(0).to_pylist():
                row += 1
                yield _record_document({column: value}, fields, file, row, fix)


@contextlib.contextmanager
def _refusing(kinds: Any, what: str, fix: str) -> Iterator[None]:
    """A reader library's error on a corpus file (pyarrow's, datasets') as one ValueError naming the file
    (the library's own message names none). `kinds` are the library's errors only: our own ValueErrors
    from within (a record's missing field) must not be among them."""
    try:
        yield
    except kinds as exc:
        raise ValueError(f"{what} ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); {fix}") from None


def _read_saved_dataset(root: pathlib.Path, fields: Fields) -> Iterator[Document]:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{str(root)!r} is a Hugging Face dataset saved with save_to_disk; reading it needs the datasets "
            "package: pip install 'offload-trainer[data]'"
        ) from None
    with _refusing(
        (ValueError, OSError, KeyError, TypeError), f"{root} looks like a dataset saved with save_to_disk but cannot "
        "be loaded", "save it again with save_to_disk, or point data.path at its files",
    ):
        dataset = datasets.load_from_disk(str(root))
    if isinstance(dataset, datasets.DatasetDict):
        if DATASET_SPLIT not in dataset:
            raise ValueError(
                f"the saved DatasetDict at {str(root)!r} has no {DATASET_SPLIT!r} split (it has {sorted(dataset)}); "
                f"save the split to train on as its own dataset, or name it {DATASET_SPLIT!r}"
            )
        dataset = dataset[DATASET_SPLIT]
    column = _column(dataset.column_names, fields, f"the dataset at {str(root)!r}")
    fix = f'Every row\'s "{column}" must hold a document.'
    row = 0
    for batch in dataset.select_columns([column]).iter(batch_size=_ROWS_PER_BATCH):
        for value in batch[column]:
            row += 1
            yield _record_document({column: value}, fields, root, row, fix)
