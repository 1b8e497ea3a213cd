"""Documents -> one stream of token ids (and which of them the loss trains on), written to a sink.

    stream = tokenize_to_memory(documents, tokenizer, max_tokens)      # a TokenStream in memory
    tokenize(documents, tokenizer, max_tokens, sink)                   # or to files (token_cache.py)

The stream is `bos_ids + tokens(doc_0)`, `eos_id`, `bos_ids + tokens(doc_1)`, ... (chat documents:
their template's rendering, which brings its own start tokens), cut to `max_tokens`; documents past
the cut are never tokenized; documents that are all empty are refused (their stream would be end-of-document
tokens alone). `trained` marks each token the loss may predict: all of them, except the
prompt tokens of chat documents. It is None (all trained) while the corpus has no chat document.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterable, List, Optional, Protocol, Union

import numpy as np
import torch

from offload_trainer.app.data.documents import Document
from offload_trainer.app.data.tokenizer import SEPARATOR_ID, Tokenizer


@dataclass
class TokenStream:
    """A corpus's tokens, one 1-D tensor, and which ones are trained on (None: all)."""

    tokens: torch.Tensor
    trained: Optional[torch.Tensor] = None
    """uint8 marks: bit TRAINED where the loss may predict the token (not chat prompts), bit STARTS on a
    document's first token; None when all are trained and nothing restarts (a text corpus)."""


TRAINED = 1
"""The marks' bit of a token the loss may predict (clear for a chat prompt's tokens)."""
STARTS = 2
"""The marks' bit of a document's first token (after the EOS that ends the document before it): its
position restarts there, so a conversation attends to itself alone."""


_CRC_CHUNK_BYTES = 64 << 20
"""Bytes checksummed at a time: a memory-mapped corpus larger than memory is read through, never held."""


def crc32_of(tensor: torch.Tensor, crc: int = 0, bits: Optional[int] = None) -> int:
    """CRC32 of a contiguous tensor's bytes (continuing `crc`), read a chunk at a time; with `bits`, of each
    byte's `bits` alone (a uint8 tensor's, the marks' TRAINED bit: a chunk's copy at a time)."""
    raw = tensor.numpy().reshape(-1).view(np.uint8)
    for start in range(0, raw.size, _CRC_CHUNK_BYTES):
        chunk = raw[start : start + _CRC_CHUNK_BYTES]
        crc = zlib.crc32(memoryview(chunk if bits is None else chunk & np.uint8(bits)), crc)
    return crc


class TokenSink(Protocol):
    """Where tokenize() writes: chunks of tokens, and (from the first chat document on) their marks."""

    def write(self, tokens: np.ndarray, trained: Optional[np.ndarray]) -> None: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds ids below vocab_size (uint8 for byte tokens)."""
    if vocab_size <= 2**8:
        return np.dtype(np.uint8)
    if vocab_size <= 2**15:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


def tokenize(
    documents: Iterable[Union[str, Document]], tokenizer: Tokenizer, max_tokens: Optional[int], sink: TokenSink
) -> int:
    """Write the corpus's stream to `sink` (see the module docstring); returns the tokens written.
    Chunks come with marks only from the first chat document on: the sink back-fills TRAINED before it."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = getattr(tokenizer, "eos_id", SEPARATOR_ID)
    bos = list(getattr(tokenizer, "bos_ids", ()))
    num_tokens = 0
    num_documents = 0
    first = ""  # where the first document came from, for the refusal of a corpus of empty documents
    any_text = False  # a document of one token or more of its own (not only its bos_ids)
    marking = False
    for index, document in enumerate(documents):
        if max_tokens is not None and num_tokens >= max_tokens:
            break
        ids, trained = _document_tokens(index, document, tokenizer, bos)
        num_documents += 1
        if num_documents == 1 and isinstance(document, Document) and document.path is not None:
            first = f" (the first in {document.path})"
        any_text = any_text or ids.size > (0 if trained is not None or not bos else len(bos))
        if index:
            separator = np.array([eos], dtype=np.uint8 if ids.dtype == np.uint8 and eos < 256 else np.int64)
            ids = np.concatenate([separator, ids.astype(separator.dtype, copy=False)])
            if trained is not None:
                trained = np.concatenate([np.ones(1, dtype=np.uint8), trained])
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
            raise ValueError(
                f"document {index}: the tokenizer gave ids in [{int(ids.min())}, {int(ids.max())}], outside "
                f"[0, vocab_size={tokenizer.vocab_size}). Fix the tokenizer's encode or its vocab_size."
            )
        if max_tokens is not None and num_tokens + ids.size > max_tokens:
            ids = ids[: max_tokens - num_tokens]
            trained = None if trained is None else trained[: ids.size]
        marking = marking or trained is not None  # from the first chat document on (module docstring)
        if marking and trained is None:
            trained = np.ones(ids.size, dtype=np.uint8)
        if marking:
            begins = 1 if index else 0  # after the separator, which ends the document before (and is trained)
            if trained.size > begins:
                trained = trained.copy()
                trained[begins] |= STARTS
        sink.write(ids.astype(dtype, copy=False), trained if marking else None)
        num_tokens += ids.size
    if num_documents > 1 and not any_text:
        raise ValueError(
            f"the corpus's {num_documents} documents{first} are all empty (no text in any), so its stream would hold only "
            f"the {num_documents - 1} end-of-document tokens between them, and the run would train the model to "
            "repeat those: point data.path at documents with text (a JSONL record's text is in the field "
            "data.text_field names)"
        )
    return num_tokens


def _document_tokens(
    index: int, document: object, tokenizer: Tokenizer, bos: List[int]
) -> "tuple[np.ndarray, Optional[np.ndarray]]":
    if isinstance(document, Document) and document.messages is not None:
        render = getattr(tokenizer, "render_chat", None)
        where = f"{document.path}:{document.line}" if document.path is not None else f"document {index}"
        if render is None:
            raise ValueError(
                f"{where} is a chat conversation (\"messages\"), which needs a tokenizer with a chat template; "
                "byte tokens have none: set model.hf_path to a model whose tokenizer has one"
            )
        try:
            ids, trained = render(document.messages)
        except ValueError as exc:  # which conversation the template refused
            raise ValueError(f"{where}: {exc}") from None
        return np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=np.uint8)
    text = document.text if isinstance(document, Document) else document
    if not isinstance(text, str):
        raise ValueError(f"document {index} is a {type(text).__name__}, not a str or a Document.")
    encode_bytes = getattr(tokenizer, "encode_bytes", None)
    if encode_bytes is not None and not bos:
        return np.frombuffer(encode_bytes(text), dtype=np.uint8), None
    return np.asarray(bos + list(tokenizer.encode(text)), dtype=np.int64), None


class MemorySink:
    """Chunks kept in memory, joined into one TokenStream at the end."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self._tokens: List[np.ndarray] = []
        self._trained: List[np.ndarray] = []
        self._num_unmarked = 0

    def write(self, tokens: np.ndarray, trained: Optional[np.ndarray]) -> None:
        self._tokens.append(tokens)
        if trained is None:
            self._num_unmarked += tokens.size
        else:
            if not self._trained and self._num_unmarked:
                self._trained.append(np.ones(self._num_unmarked, dtype=np.uint8))
            self._trained.append(trained)

    def stream(self) -> TokenStream:
        tokens = np.concatenate(self._tokens) if self._tokens else np.empty(0, dtype=self.dtype)
        trained = np.concatenate(self._trained) if self._trained else None
        return TokenStream(
            torch.from_numpy(tokens.astype(self.dtype, copy=False)),
            None if trained is None else torch.from_numpy(trained),
        )


def tokenize_to_memory(
    documents: Iterable[Union[str, Document]], tokenizer: Tokenizer, max_tokens: Optional[int]
) -> TokenStream:
    """The corpus's stream in memory (tokenize() into a MemorySink)."""
    sink = MemorySink(token_dtype(tokenizer.vocab_size))
    tokenize(documents, tokenizer, max_tokens, sink)
    return sink.stream()
