"""How much each micro-batch's mean loss weighs in a step's loss (or an eval's): by the targets it
trains on, so that the step's loss is the mean cross entropy over every target token of the step,
on every rank, whatever the split into micro-batches and ranks.

    weights = target_weights([targets for _, targets in batches], engine.collectives)
    loss_m = lm.loss(engine, inputs_m, targets_m) * weights[m]      # then backward(loss_m / accum)

A micro-batch's loss is the mean over its own targets that are not IGNORE_INDEX (a chat prompt's).
Averaging those means over micro-batches (loss / accum) and ranks (the gradients' mean) weighed a
micro-batch of 5 trained tokens as much as one of 500: with chat data, `data.batch_size 4` and
`data.batch_size 2 --grad_accum_steps 2` trained to different weights and logged different losses
(Hugging Face's Trainer had the same fault, fixed in transformers 4.46 with `num_items_in_batch`).
The weight of micro-batch m is n_m / n_mean, its targets over the mean number a micro-batch of the
step has (over every rank): the mean of the weighted means is then the mean over all tokens. Where
every micro-batch has as many targets (text packed into full sequences) each weight is exactly 1.0,
so the step computes bitwise what it did before weights existed.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from offload_trainer.app.data import IGNORE_INDEX
from offload_trainer.runtime.collectives import Collectives


def trained_tokens(targets: Sequence[torch.Tensor]) -> int:
    """The targets the loss trains on in these micro-batches (not IGNORE_INDEX): what `trained_tokens_per_s`
    counts, as torchtune's tokens/s counts the labels its loss does not ignore."""
    return sum(int((t != IGNORE_INDEX).sum()) for t in targets)


def target_weights(targets: Sequence[torch.Tensor], collectives: Optional[Collectives] = None) -> List[float]:
    """The weight of each micro-batch whose targets (host tensors) are given, over this step's micro-batches
    on every rank of `collectives` (one all-reduce of an int when there are several; None: this process
    alone). 1.0 each where no target of the step is trained (their losses are zero anyway)."""
    counts = [int((t != IGNORE_INDEX).sum()) for t in targets]
    total, world = sum(counts), 1
    if collectives is not None and collectives.world_size > 1:
        world = collectives.world_size
        summed = torch.tensor([total], dtype=torch.int64)  # a host tensor: gloo carries it beside NCCL
        collectives.all_reduce_sum(summed)
        total = int(summed.item())
    if total == 0:
        return [1.0] * len(counts)
    mean_count = total / (world * len(counts))
    return [n / mean_count for n in counts]
