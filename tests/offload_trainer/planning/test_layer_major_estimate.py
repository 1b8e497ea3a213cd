"""offload-plan under train.micro_batch_order = "layer_major" reports the schedule's activations
(every block's input for every micro-batch) and its parameter bytes per step: 1/M of
micro-batch-major's, a little more with tied embeddings (the tied group fetched once more)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest

from offload_trainer.app import plan_cli

MICRO_BATCH = ["--data.batch_size", "2", "--data.seq_len", "16", "--grad_accum_steps", "4"]
HOST = ["--tiers.params", "host", "--tiers.grads", "host", "--tiers.optimizer", "host"]


def plan(capsys: pytest.CaptureFixture, args: List[str]) -> dict:
    code = plan_cli.main([*args, *MICRO_BATCH, *HOST, "--no-measure", "--json", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1]) | {"_text": out}


def per_micro_batch_fetches(result: dict) -> int:
    return result["phases"]["forward"]["copy_bytes"] + result["phases"]["backward"]["copy_bytes"]


def test_layer_major_moves_a_quarter_of_the_parameter_bytes_with_four_micro_batches(capsys) -> None:
    plain = plan(capsys, ["--model.preset", "tiny"])
    assert "layer_major" not in plain and "layer-major schedule" not in plain["_text"]
    result = plan(capsys, ["--model.preset", "tiny", "--train.micro_batch_order", "layer_major"])
    lm = result["layer_major"]
    fetched = per_micro_batch_fetches(result)
    assert fetched > 0
    assert lm["micro_batch_major_param_bytes_per_step"] == 4 * fetched
    assert lm["param_bytes_per_step"] == fetched and lm["param_bytes_ratio"] == 0.25
    assert lm["tied"] is False
    one = 2 * 16 * 64 * 4  # [2, 16, 64] fp32: one boundary of the tiny preset
    assert lm["boundary_bytes"] == 2 * 4 * one  # 2 blocks x 4 micro-batches
    # one micro-batch checkpointed (one boundary per block), its boundaries replaced by the step's
    assert lm["activation_bytes"] == result["checkpointed_activation_bytes"] - 2 * one + lm["boundary_bytes"]
    assert lm["micro_batch_major_activation_bytes"] == result["activation_bytes"]
    assert "parameter bytes fetched per step" in result["_text"] and "ratio 0.250" in result["_text"]


def test_tied_embeddings_add_one_boundary_and_one_fetch_of_the_tied_group(tmp_path: Path, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    ).save_pretrained(tmp_path)
    result = plan(capsys, ["--hf-config", str(tmp_path), "--train.micro_batch_order", "layer_major"])
    lm = result["layer_major"]
    fetched = per_micro_batch_fetches(result)
    embedding = 256 * 64 * 4
    assert lm["tied"] is True
    assert lm["boundary_bytes"] == (2 + 1) * 4 * (2 * 16 * 64 * 4)
    assert fetched < lm["param_bytes_per_step"] <= fetched + embedding + 4096  # the tied group: embedding (+ small)
    assert lm["param_bytes_ratio"] < 1 / 3
