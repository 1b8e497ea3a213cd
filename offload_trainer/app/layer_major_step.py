"""offload-train's step under train.micro_batch_order = "layer_major": all of a step's micro-batches
through each block in turn (runtime/layer_major.py), the same batches, loss and result as
trainer.train_step's micro-batch-major loop, with each parameter group fetched once per step each way."""

from __future__ import annotations

from typing import Tuple

from torch import nn

from offload_trainer.app.causal_lm import CausalLM, mean_on_host, to_device
from offload_trainer.app.data import BatchStream
from offload_trainer.app.target_weights import target_weights, trained_tokens
from offload_trainer.models.hf_block_stack import hf_block_stack
from offload_trainer.runtime.engine import Engine
from offload_trainer.runtime.layer_major import BlockStack


def block_stack_of(model: nn.Module) -> BlockStack:
    """The built-in decoder declares its own; a Hugging Face decoder-only model gets the adapter."""
    return model if isinstance(model, BlockStack) else hf_block_stack(model)


def train_step_layer_major(engine: Engine, lm: CausalLM, stream: BatchStream, accum: int) -> Tuple[float, int]:
    """One optimizer step over `accum` micro-batches, layer-major; returns this rank's share of the step's
    loss, each micro-batch weighed by its targets as train_step weighs them (target_weights.py), and the
    targets this rank trained on, as train_step does."""
    batches = [stream.next_batch() for _ in range(accum)]
    weights = target_weights([batch.targets for batch in batches], engine.collectives)
    losses = engine.forward_backward_layer_major(
        [to_device(batch.inputs, engine.device) for batch in batches],
        lambda out, m: lm.loss_of(out, batches[m].targets) * weights[m],
        stack=block_stack_of(lm.model),
    )
    engine.step()
    return mean_on_host(losses), trained_tokens([batch.targets for batch in batches])  # read once, after step()
