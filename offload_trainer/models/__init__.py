"""Built-in models: a Llama-style decoder LM and its mixture-of-experts variant."""

from offload_trainer.models.decoder import (
    PRESETS,
    Attention,
    DecoderBlock,
    DecoderConfig,
    DecoderLM,
    RMSNorm,
    SwiGLU,
    init_weights,
    num_params,
)
from offload_trainer.models.hf_block_stack import HFBlockStack, hf_block_stack
from offload_trainer.models.moe import MoEConfig, MoEDecoderLM, MoEFeedForward

__all__ = [
    "PRESETS",
    "Attention",
    "DecoderBlock",
    "DecoderConfig",
    "DecoderLM",
    "HFBlockStack",
    "MoEConfig",
    "MoEDecoderLM",
    "MoEFeedForward",
    "RMSNorm",
    "SwiGLU",
    "hf_block_stack",
    "init_weights",
    "num_params",
]
