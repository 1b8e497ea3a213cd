"""Random token batches for the benchmarks: (inputs, targets) of every micro-batch of every step, made once.

    steps = random_token_batches(vocab_size=256, batch_size=2, seq_len=32, micro_batches=4, num_steps=3, seed=7)
    inputs, targets = steps[0][0]                 # LongTensor [2, 32] each; targets are inputs shifted by one

The same seed gives the same batches, so an engine run and its in-memory baseline (bench_offload), or
every point of a tuning grid (tune_prefetch), train on identical data.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

Batch = Tuple[torch.Tensor, torch.Tensor]


def random_token_batches(
    vocab_size: int, batch_size: int, seq_len: int, micro_batches: int, num_steps: int, seed: int
) -> List[List[Batch]]:
    """`num_steps` steps of `micro_batches` (inputs, targets) pairs of random token ids in [0, vocab_size)."""
    g = torch.Generator().manual_seed(seed % 2**64)
    steps = []
    for _ in range(num_steps):
        micro = []
        for _ in range(micro_batches):
            seq = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
            micro.append((seq[:, :-1], seq[:, 1:]))
        steps.append(micro)
    return steps
