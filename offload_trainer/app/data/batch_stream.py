"""BatchStream: the deterministic, resumable order of a PackedDataset's training sequences.

    stream = BatchStream(data, batch_size=8, seed=0)
    inputs, targets, position_ids = stream.next_batch()   # LongTensor [8, seq_len] each (position_ids: None
                                                          # for a text corpus: packed_dataset.Batch)
    saved = stream.state_dict()                           # {"epoch", "position", "seed"}, JSON-safe
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch

from offload_trainer.app.data.packed_dataset import Batch, PackedDataset, _check_batch_size, _check_int


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

    @property
    def epochs_done(self) -> float:
        """The passes over the training sequences handed out so far (1.5: one epoch and half the next), as
        the Hugging Face Trainer logs `epoch`."""
        return self.epoch + self.position / self.dataset.num_train_sequences

    def next_batch(self) -> Batch:
        """The next Batch (inputs, targets, position_ids), new tensors each call (a caller may keep or
        move them while the next batch is made)."""
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
        return self.dataset.train_batch(indices)

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

