"""Everything of a Hugging Face export but the weights, through the libraries' own save_pretrained.

    write_hf_files(out / "hf", model=model, dtype=torch.bfloat16, tokenizer=tok, came_with=hf_dir)
    engine.export_safetensors(out / "hf" / "model.safetensors", torch.bfloat16, stored_as=...)

The weights are the engine's (consolidated and streamed one group at a time by the runtime's
export); the rest is what the libraries write themselves, so nothing is listed by hand here:
`model.save_pretrained(state_dict={})` writes the config (with `dtype`, and `torch_dtype` under
transformers 4, set to the export's, so a bf16 export loads as bf16), the generation config and any
custom code; the tokenizer's `save_pretrained` writes its files with the chat template; PEFT's
config writes adapter_config.json. Every other file the model came with (a README, a license,
custom code) is copied. Each is rendered into a temporary directory, then copied into the target
through io_engine's atomic files (never through a symlink planted there). The target is the export's
new directory beside out_dir/hf, swapped into place whole once the weights are in it as well
(causal_lm.export, io_engine/atomic_dir.py). Rank 0 alone calls this.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from io_engine.atomic_file import write_atomic

from offload_trainer.app.run_dir import copy_atomic

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
"""Files of a model directory that hold weights: the export writes its own, so none is copied."""
WEIGHT_INDEXES = (".safetensors.index.json", ".bin.index.json")


def write_hf_files(
    target: Path,
    model: Any = None,
    dtype: Optional[torch.dtype] = None,
    tokenizer: Any = None,
    came_with: Optional[Path] = None,
    peft_model: Any = None,
) -> None:
    """Write into `target` (made if missing) what is given: the files `came_with` holds besides weights,
    the model's config files (with `dtype`), the tokenizer's files, a PEFT model's adapter config."""
    target.mkdir(parents=True, exist_ok=True)
    if came_with is not None:
        for file in sorted(came_with.iterdir()):
            if file.is_file() and not file.name.startswith(".") and not _is_weights(file.name):
                copy_atomic(file, target / file.name)
    if model is not None:
        with _rendered(target) as tmp:
            with _quiet_transformers():
                model.save_pretrained(tmp, state_dict={}, safe_serialization=True)
            if dtype is not None:
                _set_dtype(tmp / "config.json", dtype)
            _copy_rendered(tmp, target)
    if tokenizer is not None:
        with _rendered(target) as tmp:
            tokenizer.save_pretrained(tmp)
            _copy_rendered(tmp, target)
    if peft_model is not None:
        with _rendered(target) as tmp:
            for name, config in peft_model.peft_config.items():
                saved_in = tmp if name == "default" else tmp / name
                training, config.inference_mode = config.inference_mode, True  # as PeftModel.save_pretrained saves it
                try:
                    config.save_pretrained(saved_in)
                finally:
                    config.inference_mode = training
                _sort_sets(saved_in / "adapter_config.json", config)
            _copy_rendered(tmp, target)


def _is_weights(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(WEIGHT_INDEXES)


@contextlib.contextmanager
def _rendered(target: Path) -> Iterator[Path]:
    """A temporary directory beside `target` (removed after) for a library to save_pretrained into."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _copy_rendered(tmp: Path, target: Path) -> None:
    for file in sorted(tmp.rglob("*")):
        if file.is_file() and not _is_weights(file.name):
            destination = target / file.relative_to(tmp)
            destination.parent.mkdir(parents=True, exist_ok=True)
            copy_atomic(file, destination)


def _sort_sets(config_json: Path, config: Any) -> None:
    """PEFT keeps lora.target_modules (and its other fields of module names) as a set and writes it in
    the set's order, which changes from process to process (str hashes are seeded per process): a
    resumed run's adapter_config.json differed from the uninterrupted run's. Written sorted here."""
    keys = [key for key, value in vars(config).items() if isinstance(value, (set, frozenset))]
    if not keys or not config_json.is_file():
        return
    saved = json.loads(config_json.read_text(encoding="utf-8"))
    for key in keys:
        if isinstance(saved.get(key), list):
            saved[key] = sorted(saved[key], key=str)
    write_atomic(config_json, json.dumps(saved, indent=2, sort_keys=True) + "\n")


def _set_dtype(config_json: Path, dtype: torch.dtype) -> None:
    """The export's dtype in config.json, under the key the installed transformers writes."""
    config = json.loads(config_json.read_text(encoding="utf-8"))
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = name
    write_atomic(config_json, json.dumps(config, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No "Writing model shards" progress bar for the empty state dict."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
