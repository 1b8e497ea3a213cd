"""PackedDataset: a token stream cut into fixed-length sequences, a held-out tail for the eval loss.

    data = PackedDataset(documents, tokenizer, seq_len=256, max_tokens=4_000_000)
    data = PackedDataset.from_stream(cache.load(), tokenizer.vocab_size, seq_len=256)   # memory-mapped
    inputs, targets, position_ids = data.train_batch(torch.tensor([3, 1]))
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Iterator, NamedTuple, Optional, Sequence, Union

import torch

from offload_trainer.app.data.documents import Document
from offload_trainer.app.data.token_stream import STARTS, TRAINED, TokenStream, crc32_of, tokenize_to_memory
from offload_trainer.app.data.tokenizer import Tokenizer

IGNORE_INDEX = -100
"""The target of a token the loss does not train on (a chat prompt's); torch's cross entropy skips it."""


class Batch(NamedTuple):
    """A batch of sequences: LongTensors [B, seq_len] each."""

    inputs: torch.Tensor
    targets: torch.Tensor
    """The next tokens; IGNORE_INDEX where the loss does not train (chat prompts)."""
    position_ids: Optional[torch.Tensor]
    """Each input's position in its document, restarting at 0 at each document's first token and at each
    row's, for a corpus with chat documents: a Hugging Face model given them attends within each
    conversation alone (transformers turns restarting positions into a block-causal mask), so the
    conversations packed into a row train as they would one to a row. None for a text corpus, whose
    documents attend to those before them in the row (as Hugging Face's run_clm packs)."""


class PackedDataset:
    """All documents tokenized, joined with the tokenizer's EOS (byte tokens: 0), cut into fixed-length
    sequences of seq_len + 1 tokens (inputs and targets shifted by one), packed without padding.

    Sequence i is tokens [i * (seq_len + 1), (i + 1) * (seq_len + 1)) of the stream; the tail
    that does not fill a sequence is dropped. `max_tokens` cuts the stream (separators included)
    to at most that many tokens, and documents past the cut are never tokenized.

    A held-out split: the last `eval_fraction` of the sequences (rounded down, but at least 1 when
    there are >= 2 sequences and eval_fraction > 0) is the eval set, decided before any shuffling
    so it never changes with the seed. At least 2 training sequences must remain.

    The stream is one tensor of the smallest dtype that holds vocab_size ids: uint8 for byte
    tokens, int16 up to 32768, else int32. Token ids from a tokenizer other than ByteTokenizer
    must lie in [0, vocab_size). Chat documents' prompt tokens are never targets: their targets
    are IGNORE_INDEX (-100), which cross entropy skips. `documents` may be strings or Documents.
    """

    def __init__(
        self,
        documents: Sequence[Union[str, Document]],
        tokenizer: Tokenizer,
        seq_len: int,
        eval_fraction: float = 0.05,
        max_tokens: int | None = None,
        *,
        stream: TokenStream | None = None,
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
        if isinstance(documents, (str, Document)):
            raise ValueError("documents must be a sequence of strings, not one string: wrap it as [text].")
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"the tokenizer must have an int vocab_size >= 1; {tokenizer!r} has {vocab_size!r}.")

        self.seq_len = seq_len
        self.eval_fraction = float(eval_fraction)
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self._set_stream(stream if stream is not None else tokenize_to_memory(documents, tokenizer, max_tokens))

    @classmethod
    def from_stream(
        cls, stream: TokenStream, vocab_size: int, seq_len: int, eval_fraction: float = 0.05,
        max_tokens: int | None = None,
    ) -> "PackedDataset":
        """The dataset over an already tokenized stream (a memory-mapped cache entry, say), cut to
        max_tokens if it is longer; validated as the constructor validates."""
        vocab = SimpleNamespace(vocab_size=vocab_size)
        return cls([], vocab, seq_len, eval_fraction, max_tokens, stream=stream)  # type: ignore[arg-type]

    def _set_stream(self, stream: TokenStream) -> None:
        tokens, trained = stream.tokens, stream.trained
        if self.max_tokens is not None and tokens.numel() > self.max_tokens:
            tokens = tokens[: self.max_tokens]
            trained = None if trained is None else trained[: self.max_tokens]
        seq_len, eval_fraction, max_tokens = self.seq_len, self.eval_fraction, self.max_tokens
        sequence_numel = seq_len + 1
        num_sequences = tokens.numel() // sequence_numel
        num_eval = _num_eval_sequences(num_sequences, self.eval_fraction)
        if num_sequences - num_eval < 2:
            needed_sequences = _min_sequences(self.eval_fraction)
            was_cut = max_tokens is not None and tokens.numel() >= max_tokens  # else max_tokens is not the cause
            cut = f" (cut to max_tokens={max_tokens}: raise it)" if was_cut else ""
            raise ValueError(
                f"too little data: the documents give {tokens.numel()} tokens{cut}, but seq_len={seq_len} with "
                f"eval_fraction={eval_fraction:g} needs at least {needed_sequences * sequence_numel} tokens "
                f"({needed_sequences} sequences of seq_len + 1 = {sequence_numel}: 2 to train on, "
                f"{needed_sequences - 2} held out). Give more text, or a smaller seq_len or eval_fraction."
            )
        self.num_tokens = tokens.numel()
        """Tokens in the stream, separators included, after max_tokens; the sequences use a prefix."""
        self.num_train_sequences = num_sequences - num_eval
        self.num_eval_sequences = num_eval
        # Views into the one stream: [num_sequences, seq_len + 1], no copy (of a memory map: no read).
        sequences = tokens[: num_sequences * sequence_numel].view(num_sequences, sequence_numel)
        self._train = sequences[: self.num_train_sequences]
        self._eval = sequences[self.num_train_sequences :]
        self._train_marks: Optional[torch.Tensor] = None
        self._eval_marks: Optional[torch.Tensor] = None
        if trained is not None:
            marks = trained[: num_sequences * sequence_numel].view(num_sequences, sequence_numel)
            self._train_marks, self._eval_marks = marks[: self.num_train_sequences], marks[self.num_train_sequences :]

    def train_crc32(self) -> int:
        """CRC32 of the training sequences' tokens, and their loss marks (the TRAINED bit) where there are
        any: the data a checkpoint's position counts in (data_identity.py). Reads them all once. The
        STARTS bit is left out: it follows from the same documents, and a chat run's checkpoint saved
        before conversations were kept apart (marks of 0 and 1) counts its position in the same data."""
        crc = crc32_of(self._train)
        if self._train_marks is None:
            return crc
        return crc32_of(self._train_marks, crc, bits=TRAINED)

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

    @property
    def restarts_positions(self) -> bool:
        """Whether batches carry position ids that restart at each document (a corpus with chat documents)."""
        return self._train_marks is not None

    def train_batch(self, indices: torch.Tensor) -> Batch:
        """The Batch of the training sequences at `indices`; targets the loss must not train on (chat
        prompts) are IGNORE_INDEX."""
        marks = None if self._train_marks is None else self._train_marks[indices]
        return _split(self._train[indices].long(), marks)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """Batches of every eval sequence, in order; the last batch may be smaller. Yields nothing when
        eval_fraction is 0."""
        _check_batch_size(batch_size)
        # Checked above, not in the generator, so that a bad batch_size raises at the call.
        return self._eval_batches(batch_size)

    def _eval_batches(self, batch_size: int) -> Iterator[Batch]:
        for start in range(0, self.num_eval_sequences, batch_size):
            marks = None if self._eval_marks is None else self._eval_marks[start : start + batch_size]
            yield _split(self._eval[start : start + batch_size].long(), marks)


def _split(sequences: torch.Tensor, marks: Optional[torch.Tensor] = None) -> Batch:
    # Contiguous, so that callers may .view() them (a shifted slice of a row is not). Copies, never views of
    # `sequences`: a batch of one row is contiguous already, so .contiguous() shared its storage between
    # inputs and targets, and masking the targets below wrote IGNORE_INDEX into the inputs.
    inputs = sequences[:, :-1].clone(memory_format=torch.contiguous_format)
    targets = sequences[:, 1:].clone(memory_format=torch.contiguous_format)
    if marks is None:
        return Batch(inputs, targets, None)
    targets[(marks[:, 1:] & TRAINED) == 0] = IGNORE_INDEX
    return Batch(inputs, targets, _position_ids((marks[:, :-1] & STARTS) != 0))


def _position_ids(starts: torch.Tensor) -> torch.Tensor:
    """Each token's distance from the last document start at or before it in its row (a row's first token
    starts one): [[s, -, -, s, -]] -> [[0, 1, 2, 0, 1]]."""
    starts = starts.clone()
    starts[:, 0] = True
    index = torch.arange(starts.shape[1]).expand_as(starts)
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start


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
