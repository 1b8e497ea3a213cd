"""The causal LM offload-train trains: the built-in decoder, or a local Hugging Face model.

Either way the model is built with its parameters on the meta device and materialised by the
engine into their homes; a Hugging Face model then gets its weights from the directory's
safetensors shards, streamed into the shards one stored tensor (or one fused parameter) at a time,
through the same name and layout conversion `from_pretrained` applies (app/hf_weights.py: Mixtral's
per-expert tensors become its fused expert parameters, say). It brings its tokenizer when the
directory has one (byte-level tokens otherwise). The loss is the same for both: cross entropy of
the logits against the next tokens. Export writes model.safetensors, and for a Hugging Face model
a directory `from_pretrained` loads (config, tokenizer files, and weights in the layout
`save_pretrained` writes for that architecture).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from offload_trainer.app.run_config import RunConfig
from offload_trainer.config import ComputeDtype
from offload_trainer.app.data import ByteTokenizer, Tokenizer
from offload_trainer.app.run_dir import copy_atomic
from offload_trainer.app.hf_weights import HFCheckpoint
from offload_trainer.runtime.persist.export import StoredAs
from offload_trainer.runtime.persist.materialize import parameters_on_meta
from offload_trainer.runtime.persist.safetensors_load import WeightSource
from offload_trainer.models.decoder import DecoderConfig, DecoderLM, init_weights

if TYPE_CHECKING:
    from offload_trainer.runtime.engine import Engine

_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")


class HFTokenizer:
    """A Hugging Face tokenizer as the data pipeline's Tokenizer (no special tokens added)."""

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = len(tokenizer)  # type: ignore[arg-type]

    def encode(self, text: str) -> List[int]:
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator,index]


def zero_init(module: nn.Module) -> None:
    """Placeholder initialisation for weights that are loaded from files right after."""
    for p in module._parameters.values():
        if p is not None:
            p.data.zero_()


@dataclass
class CausalLM:
    model: nn.Module
    init_fn: Callable[[nn.Module], None]
    tokenizer: Tokenizer
    weight_files: Union[List[Path], WeightSource]
    """What engine.load_safetensors loads after initialize: safetensors shards, or a source that
    converts a checkpoint's layout (a Hugging Face model's weights: an HFCheckpoint); empty for none."""
    hf_dir: Optional[Path]
    stored_as: Optional[StoredAs] = None
    """How export stores the parameters (a Hugging Face model's on-disk layout); the model's names if None."""

    def loss(self, engine: "Engine", inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_of(engine(inputs), targets)

    @staticmethod
    def loss_of(out: object, targets: torch.Tensor) -> torch.Tensor:
        """Cross entropy of the model's output (logits, or an output with .logits) against the next tokens."""
        logits = out.logits if hasattr(out, "logits") else out  # type: ignore[attr-defined]
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def export(self, engine: "Engine", out_dir: Path, export_dtype: str) -> Path:
        dtype = ComputeDtype(export_dtype).torch_dtype
        if self.hf_dir is None:
            return engine.export_safetensors(out_dir / "model.safetensors", dtype)
        target = out_dir / "hf"
        engine.export_safetensors(target / "model.safetensors", dtype, stored_as=self.stored_as)
        for name in _HF_SIDE_FILES:
            if (self.hf_dir / name).is_file():
                copy_atomic(self.hf_dir / name, target / name)  # never through a symlink planted at the target
        return target


def build_causal_lm(cfg: RunConfig) -> CausalLM:
    if cfg.model.hf_path is None:
        mcfg = DecoderConfig.preset(cfg.model.preset, max_seq_len=max(cfg.data.seq_len, 1))
        with torch.device("meta"):
            model = DecoderLM(mcfg, activation_checkpointing=cfg.model.activation_checkpointing)
        tokenizer: Tokenizer = ByteTokenizer()
        _check_vocab(mcfg.vocab_size, tokenizer, f"model.preset={cfg.model.preset!r}")
        return CausalLM(model, init_weights, tokenizer, [], None)
    return _hugging_face(Path(cfg.model.hf_path), cfg)


def _hugging_face(path: Path, cfg: RunConfig) -> CausalLM:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ValueError(
            "model.hf_path needs the transformers package: pip install 'offload-trainer[hf]'"
        ) from None
    if not (path / "config.json").is_file():
        raise ValueError(f"model.hf_path={str(path)!r} is not a Hugging Face model directory (no config.json there)")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ValueError(
            f"model.hf_path={str(path)!r} has no *.safetensors weights; convert the checkpoint to safetensors "
            "(model.save_pretrained(dir) writes them)"
        )
    hf_config = AutoConfig.from_pretrained(path)
    _check_positions(hf_config, path, cfg.data.seq_len)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(hf_config)
    checkpoint = HFCheckpoint(model, weights)  # reads headers only; the engine loads it after initialize
    checkpoint.load_buffers()  # persistent buffers, if the files hold any, before initialize moves them
    if cfg.model.activation_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    has_tokenizer = any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    tokenizer: Tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(path)) if has_tokenizer else ByteTokenizer()
    _check_vocab(model.get_input_embeddings().num_embeddings, tokenizer, f"model.hf_path={str(path)!r}")
    return CausalLM(model, zero_init, tokenizer, checkpoint, path, stored_as=checkpoint.stored_as)


def _check_positions(hf_config: object, path: Path, seq_len: int) -> None:
    """Refuse sequences longer than the model's position table (learned positions would index past
    it; rotary ones would run past what the model was trained for)."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    max_positions = getattr(text_config, "max_position_embeddings", None)
    if isinstance(max_positions, int) and seq_len > max_positions:
        raise ValueError(
            f"data.seq_len={seq_len} is longer than model.hf_path={str(path)!r} allows: its config.json has "
            f"max_position_embeddings={max_positions}; set data.seq_len to at most {max_positions}"
        )


def _check_vocab(model_vocab: int, tokenizer: Tokenizer, what: str) -> None:
    if model_vocab < tokenizer.vocab_size:
        raise ValueError(
            f"{what} has {model_vocab} token embeddings but its tokenizer has {tokenizer.vocab_size} tokens "
            "(byte-level tokens need at least 256)"
        )
