"""offload-train over chat data (a tiny Llama whose tokenizer has a chat template, built offline): what a
run reports of the tokens it trains on, against a replay of its batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from offload_trainer.app.data import IGNORE_INDEX, BatchStream, load_corpus  # noqa: E402
from offload_trainer.app.causal_lm import build_causal_lm  # noqa: E402
from offload_trainer.app.trainer import run  # noqa: E402

from tests.offload_trainer.app.test_export_and_lora import config, tiny_llama_with_chat  # noqa: E402


CONVERSATION = {"messages": [{"role": "user", "content": "hi?"}, {"role": "assistant", "content": "hello!"}]}


def test_a_chat_run_reports_its_trained_tokens_beside_the_tokens_it_ran(tmp_path: Path) -> None:
    """tokens_per_s counted the prompt tokens, which chat data never trains on: a user comparing with
    torchtune (whose tokens/s counts the labels its loss does not ignore) read a rate several times the
    trained one. Each row now has `trained_tokens` and `trained_tokens_per_s` beside them, counted from
    the step's own targets."""
    model_dir = tmp_path / "llama"
    tiny_llama_with_chat(model_dir)
    chats = tmp_path / "chats"
    chats.mkdir()
    (chats / "chat.jsonl").write_text((json.dumps(CONVERSATION) + "\n") * 30)
    cfg = config(tmp_path, model_dir, **{"train.steps": "3", "data.path": str(chats)})
    summary = run(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    stream = BatchStream(load_corpus(cfg.data, build_causal_lm(cfg).tokenizer), cfg.data.batch_size, cfg.seed)
    expected = [int((stream.next_batch()[1] != IGNORE_INDEX).sum()) for _ in rows]
    assert [r["trained_tokens"] for r in rows] == expected
    assert all(0 < r["trained_tokens"] < r["tokens"] == 4 * 16 for r in rows)
    for r in rows:
        assert r["trained_tokens_per_s"] == r["trained_tokens"] / r["step_s"]
        assert r["tokens_per_s"] == r["tokens"] / r["step_s"]
    assert summary.trained_tokens == sum(expected) and summary.tokens == 3 * 4 * 16
