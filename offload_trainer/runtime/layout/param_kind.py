"""ParamKind: what a parameter is for weight decay, decided by its shape and its modules' types.

The common rule (nanoGPT's `configure_optimizers`, the HF Trainer's `get_decay_parameter_names`):
matrices decay; biases, norm weights and every other tensor with fewer than two dimensions do not,
whatever they are called (GPT-2's `ln_1.weight` is a LayerNorm weight, though its name says
neither "norm" nor "bias"). Both decay embeddings; optimizer.decay_embeddings can turn that off.
A parameter held by several modules (tied weights) takes the first that applies of: no decay
(any holder is a norm), embedding (any holder is an embedding), matrix.
"""

from __future__ import annotations

import enum
import re
from typing import Dict

from torch import nn

_NORM_NAME = re.compile(r"Norm(\d[dD])?$")
"""LayerNorm, RMSNorm, GroupNorm, BatchNorm2d, and HF's own (LlamaRMSNorm, T5LayerNorm, ...)."""
_EMBEDDING_NAME = re.compile(r"Embeddings?$")
"""nn.Embedding, HF's scaled embeddings, and modules holding position or class embeddings (ViTEmbeddings)."""


class ParamKind(enum.Enum):
    """A parameter's role for weight decay."""

    MATRIX = "matrix"
    """Two or more dimensions, in no norm and no embedding: decays."""
    EMBEDDING = "embedding"
    """Two or more dimensions, held by an embedding module: decays if optimizer.decay_embeddings."""
    NO_DECAY = "no_decay"
    """Fewer than two dimensions (biases, norm weights, scales), or held by a norm module: never decays."""


def _is_a(module: nn.Module, pattern: "re.Pattern[str]") -> bool:
    return any(pattern.search(klass.__name__) for klass in type(module).__mro__ if klass is not nn.Module)


def param_kinds(model: nn.Module) -> Dict[int, ParamKind]:
    """id(parameter) -> its ParamKind, for every parameter of the model (tied ones once)."""
    kinds: Dict[int, ParamKind] = {}
    rank = {ParamKind.MATRIX: 0, ParamKind.EMBEDDING: 1, ParamKind.NO_DECAY: 2}
    for module in model.modules():
        if _is_a(module, _NORM_NAME):
            holder = ParamKind.NO_DECAY
        elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or _is_a(module, _EMBEDDING_NAME):
            holder = ParamKind.EMBEDDING
        else:
            holder = ParamKind.MATRIX
        for p in module.parameters(recurse=False):
            kind = ParamKind.NO_DECAY if p.dim() < 2 else holder
            if id(p) not in kinds or rank[kind] > rank[kinds[id(p)]]:
                kinds[id(p)] = kind
    return kinds
