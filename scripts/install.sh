#!/usr/bin/env bash
# Installs offload-trainer, its test tools and the Hugging Face extra into the current Python,
# keeping any torch already there.
# Where no torch is installed it takes torch==2.13.0, which on this project's machines is a local CPU
# wheel; an unpinned `pip install torch` would pull several GB of CUDA packages instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[dev,hf]"
# The optional extras, so that CI tests parquet/datasets input, LoRA and the TensorBoard logger.
"$PY" -m pip install -q -e ".[data,lora,tensorboard]"
