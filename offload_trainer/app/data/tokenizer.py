"""Tokenizers as the data pipeline sees them: byte tokens, or a Hugging Face tokenizer.

    tok = ByteTokenizer()                      # UTF-8 bytes; documents joined with byte 0
    tok = HFTokenizer(AutoTokenizer.from_pretrained(path))
    tok.encode("text"), tok.eos_id, tok.bos_ids, tok.fingerprint()

A document becomes `bos_ids + encode(text)`, and documents are joined with `eos_id`: the token the
model learns to end a document with. `bos_ids` is what the tokenizer itself puts before a text when
asked for special tokens (Llama's `<s>`; nothing for GPT-2 or Qwen), so a model sees documents
start as it did in pre-training. `fingerprint()` names the tokenizer for the token cache: equal
fingerprints give equal tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

SEPARATOR_ID = 0
"""ByteTokenizer's token between two documents: byte 0, which text almost never holds."""


CHAT_RULES = "chat-3"
"""What render_chat accepts and marks, in the fingerprint: cached corpora of an older rendering are tokenized
again (chat-2: a reply that renders to no tokens is refused, where chat-1 trained its end of turn alone;
chat-3: a miscased or misspelt role, "Assistant", is refused, where chat-2 trained such a reply as prompt)."""


class Tokenizer(Protocol):
    """What the data pipeline needs of a tokenizer.

    Optional attributes, read with getattr: `eos_id` (the token between documents; 0 when absent),
    `bos_ids` (tokens before each document; none when absent), `fingerprint()` (the token cache's
    key; without it the corpus is not cached) and `render_chat(messages)` (chat documents)."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab_size 256, no special tokens needed (documents are separated by byte 0).

    Text that cannot be encoded (a lone surrogate, as a JSON "\\ud800" escape gives) becomes "?";
    bytes that are not valid UTF-8 decode to U+FFFD. Neither raises.
    """

    vocab_size: int = 256
    eos_id: int = SEPARATOR_ID
    bos_ids: Tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return list(self.encode_bytes(text))

    def encode_bytes(self, text: str) -> bytes:
        """The tokens as a bytes object: no Python int per token."""
        return text.encode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "bytes-utf8-v1"

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


class HFTokenizer:
    """A Hugging Face tokenizer as the data pipeline's Tokenizer.

    `encode` adds no special tokens; `bos_ids` are the ones the tokenizer adds in front of a text by
    itself (found by encoding a probe with and without special tokens), `eos_id` its eos_token.
    `what` names the tokenizer in messages (model.hf_path=...)."""

    def __init__(self, tokenizer: Any, what: str = "the tokenizer", files: Optional[Path] = None) -> None:
        """`files`: the directory the tokenizer was loaded from, if any (its tokenizer.json is checked
        for the eos_token: _check_eos_in_files)."""
        self.hf = tokenizer
        self.what = what
        # Ids need not be dense (a vocabulary with gaps, an added token far out): the largest one bounds
        # the model's embeddings and the stream's dtype, not the count of tokens.
        ids = tokenizer.get_vocab().values() if hasattr(tokenizer, "get_vocab") else ()
        self.vocab_size = max(len(tokenizer), max(ids, default=-1) + 1)
        eos = getattr(tokenizer, "eos_token_id", None)
        if not isinstance(eos, int):
            raise ValueError(
                f"{what} has no eos_token, so documents cannot be joined with one and the model would never "
                "learn to stop: set \"eos_token\" in its tokenizer_config.json (e.g. \"</s>\" or \"<|endoftext|>\")"
            )
        self.eos_id: int = eos
        if files is not None:
            _check_eos_in_files(tokenizer, files, what)
        probe = "a"
        plain = list(self.encode(probe))
        if not plain:  # every document would give 0 tokens, refused as "too little data" in the corpus
            raise ValueError(
                f"{what} turns text into no tokens ({probe!r} gave none): its vocabulary is missing (tokenizer.json, "
                "or the tokenizer.model or vocab files that tokenizer_config.json needs beside it); copy the "
                "tokenizer files from the model's source"
            )
        with self._library_failure():
            special = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
        start = _find(special, plain)
        self.bos_ids: Tuple[int, ...] = tuple(special[:start]) if start >= 0 else ()

    def encode(self, text: str) -> List[int]:
        """A whole document's ids. verbose=False: transformers otherwise warns, for a document longer than
        the tokenizer's model_max_length, that running it through the model "will result in indexing
        errors"; documents are packed into data.seq_len-token sequences, which the run checks against the
        model's positions, so that never happens (Hugging Face's run_clm.py says to ignore it)."""
        with self._library_failure():
            return self.hf(text, add_special_tokens=False, verbose=False)["input_ids"]

    @contextlib.contextmanager
    def _library_failure(self) -> Iterator[None]:
        """A tokenizer whose files load but cannot encode (a WordLevel vocabulary without its unknown
        token: the tokenizers library raises a bare Exception) is the files' fault: one ValueError."""
        try:
            yield
        except (ValueError, TypeError):
            raise  # one line already (describe_user_error)
        except Exception as exc:  # noqa: BLE001 - the library's kinds for a broken vocabulary or model
            raise ValueError(
                f"{self.what} cannot tokenize text ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); fix "
                "or replace its tokenizer files"
            ) from None

    def fingerprint(self) -> str:
        """A hash of everything that decides the tokens: the vocabulary and rules, the special tokens
        around documents and the chat template."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        rules = backend.to_str() if backend is not None else json.dumps(sorted(self.hf.get_vocab().items()))
        parts = [type(self.hf).__name__, rules, repr(self.eos_id), repr(self.bos_ids),
                 repr(getattr(self.hf, "chat_template", None)), CHAT_RULES]
        return "hf-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> Tuple[List[int], List[bool]]:
        """A conversation as tokens through the tokenizer's chat template, and for each token whether
        the loss trains on it: the assistant's replies (and what ends them), not the prompts."""
        from offload_trainer.app.data.chat import render_chat

        return render_chat(self.hf, messages, self.what)


_END_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>", "<eos>", "<|end|>", "[SEP]")
"""End tokens vocabularies commonly hold: offered as the fix when the eos_token is not in one."""


def _check_eos_in_files(tokenizer: Any, directory: Path, what: str) -> None:
    """ValueError naming the fix when the eos_token is not in the vocabulary `directory`'s tokenizer.json
    defines (its model's vocabulary or its added tokens). transformers adds such a token (an eos_token in
    tokenizer_config.json that the vocabulary lacks) as a new id on load, with no word said: its embedding
    row, where the model has one, was never trained, and a run taught the model to end every document with it.
    A directory without tokenizer.json (a sentencepiece tokenizer.model converted on load) is not checked."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return
    try:
        from tokenizers import Tokenizer as RawTokenizer

        raw = RawTokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - transformers loaded the files; what it read is checked elsewhere
        return
    eos = tokenizer.eos_token
    if raw.token_to_id(eos) is not None:
        return
    have = [t for t in _END_TOKENS if raw.token_to_id(t) is not None]
    offer = f" (it has {', '.join(repr(t) for t in have)})" if have else ""
    raise ValueError(
        f"{what}: its eos_token {eos!r} is not in its vocabulary ({path}), so transformers adds it as a new "
        f"token (id {tokenizer.eos_token_id}) whose embedding the model never trained, and the run would teach "
        f"the model to end documents with it: set \"eos_token\" in tokenizer_config.json to the end token the "
        f"vocabulary has{offer}"
    )


def _find(haystack: List[int], needle: List[int]) -> int:
    for start in range(len(haystack) - len(needle) + 1):
        if haystack[start : start + len(needle)] == needle:
            return start
    return -1


def tokenizer_fingerprint(tokenizer: object) -> Optional[str]:
    """The tokenizer's fingerprint(), or None when it has none (its corpus is then not cached)."""
    fingerprint = getattr(tokenizer, "fingerprint", None)
    return fingerprint() if callable(fingerprint) else None
