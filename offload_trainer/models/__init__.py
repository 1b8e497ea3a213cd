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
from offload_trainer.models.moe import MoEConfig, MoEDecoderLM, MoEFeedForward

__all__ = [
    "PRESETS",
    "Attention",
    "DecoderBlock",
    "DecoderConfig",
    "DecoderLM",
    "MoEConfig",
    "MoEDecoderLM",
    "MoEFeedForward",
    "RMSNorm",
    "SwiGLU",
    "init_weights",
    "num_params",
]
