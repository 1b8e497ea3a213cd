"""Models and training loops plain PyTorch trains, through the engine API, round 12 (rounds 1-10:
test_model_zoo.py to test_model_zoo_10.py, whose settings and helpers this file shares): each trains
bitwise equal to plain PyTorch in fp32 on one rank, or is refused with one line naming what and the fix.

| probed                                                              | result                      |
|---------------------------------------------------------------------|-----------------------------|
| one op reading two parameters of a group no hook made resident      | fixed: AttributeError       |
| (`F.linear(x, self.proj.weight, self.proj.bias)` in a checkpointed  | "type object 'HeldParameter'|
| closure at the root, recomputed in backward)                        | has no attribute '_fetch'"  |
| resume from a checkpoint (2 of 4 steps, host/CPU and NVMe/simulated)| held (probed, not kept)     |
| of parametrizations (spectral_norm, weight_norm, orthogonal with and|                             |
| without trivialization, one with two originals), the old hook       |                             |
| spectral_norm, an int buffer reassigned in forward, BatchNorm, LSTM,|                             |
| tied embeddings                                                     |                             |
| weight_norm parametrization of a tied head (its original1 shares    | refused by name (held)      |
| the embedding's memory)                                             |                             |
| layer-major (test_layer_major.py, test_hf_block_stack.py): F.dropout| fixed: refused (generators' |
| in a block or the embedding or head, HF Mixtral's router jitter     | states); was silently wrong |
| BatchNorm in training in the begin, a block or the end              | fixed: refused (buffers'    |
|                                                                     | versions); was silently     |
|                                                                     | wrong (stats updated twice) |
| a block adding to a memory tensor of its micro-batch's context      | fixed: refused (context     |
| (in place)                                                          | versions); was silently     |
|                                                                     | wrong (up to 0.04)          |
| a root's norm applied in every block by stack_block                 | fixed: refused (gradients in|
|                                                                     | two units); was last bits   |
| stack_block reading the block's weights (F.linear(n, block.weight)) | fixed: the blocks trained in|
|                                                                     | the first step only         |
| a hidden state that is not row-major (a ViT's transposed patches)   | fixed: last bits (gradient  |
|                                                                     | layout, boundary strides)   |
| layer-major HF Llama under HF gradient checkpointing (reentrant and | held (probed, not kept)     |
| not), Qwen2-MoE, Phi-3, OLMo2, Gemma, Granite (multipliers), Falcon,|                             |
| BLOOM, on NVMe homes and the simulated accelerator                  |                             |
| layer-major HF GPT-NeoX (final_layer_norm), OPT (decoder.layers)    | refused by the adapter, one |
|                                                                     | line (not supported)        |
| layer-major HF Mixtral with output_router_logits: the end gives the | loud (AttributeError in the |
| logits alone, so a loss_fn reading out.aux_loss fails               | user's loss_fn), left       |

The fix: UnresidentParameter.__torch_function__ fetched each unbound parameter among an op's arguments
in turn, but the first fetch binds its whole group, so the second (the bias) was bound by then and no
longer had the unbound class's `_fetch`.
(Layer-major faults found in this round are in test_layer_major.py and test_hf_block_stack.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from tests.offload_trainer.runtime.test_model_zoo import DIM
from tests.offload_trainer.runtime.test_model_zoo_5 import some
from tests.offload_trainer.runtime.test_model_zoo_6 import BlocksLM, train_and_compare


class RootLinearClosureLM(BlocksLM):
    """A non-reentrant checkpoint of a closure at the root applying a child Linear's weight and bias in one
    op: its recomputation runs when backward reaches it, after the blocks' acquisitions let the group go."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        project = lambda x: torch.tanh(F.linear(x, self.proj.weight, self.proj.bias))  # noqa: E731
        h = checkpoint(project, self.emb(ids), use_reentrant=False)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.mark.parametrize("setting", some((0, 3)))
def test_one_op_reading_two_unbound_parameters(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    train_and_compare(RootLinearClosureLM, tmp_path, setting)
