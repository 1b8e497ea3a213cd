"""A path setting that does not exist but reads as a Hugging Face Hub name ("meta-llama/Llama-3.2-1B"):
offload-train reads local directories only (its machines need no network), so the error says how to
download the model or dataset first."""

from __future__ import annotations

import os
import re

_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def looks_like_hub_name(value: str) -> bool:
    """`owner/name`, relative, and nothing at that path."""
    return bool(_HUB_NAME.fullmatch(value)) and not os.path.lexists(value)


def model_download_hint(value: str, setting: str = "model.hf_path") -> str:
    """For `setting` (model.hf_path, --hf-config): how to get a Hub model as a local directory ("" unless
    `value` reads as a Hub name)."""
    local = value.split("/")[-1]
    how = f"download it first, e.g. `huggingface-cli download {value} --local-dir {local}`"
    return _hint(value, "directories", how, setting)


def dataset_download_hint(value: str) -> str:
    """For data.path: how to get a Hub dataset saved locally ("" unless it reads as a Hub name)."""
    local = value.split("/")[-1]
    how = f"save it first, e.g. `datasets.load_dataset({value!r}, split='train').save_to_disk({local!r})`"
    return _hint(value, "data", how, "data.path")


def _hint(value: str, reads: str, how: str, setting: str) -> str:
    if not looks_like_hub_name(value):
        return ""
    local = value.split("/")[-1]
    return (
        f" ({value!r} reads as a Hugging Face Hub name, and offload-train reads local {reads} only: {how}, then "
        f"give {setting} {local})"
    )
