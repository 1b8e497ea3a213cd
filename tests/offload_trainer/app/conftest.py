"""Shared by the app tests that start a tiny offload-train run in-process or as a subprocess."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List

import pytest

from tests.command_lines import argv_with

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40


@pytest.fixture
def tiny_run_args(tmp_path: Path) -> Callable[..., List[str]]:
    """offload-train's arguments for a 2-step tiny run in tmp_path (corpus, out, swap), checkpointing
    every step; extra arguments come last, so they override."""

    def make(*extra: str) -> List[str]:
        corpus = tmp_path / "corpus"
        corpus.mkdir(exist_ok=True)
        (corpus / "a.py").write_text(TEXT)
        return argv_with([
            "--model.preset", "tiny", "--data.path", str(corpus), "--data.seq_len", "32", "--data.batch_size", "4",
            "--train.steps", "2", "--train.checkpoint_every", "1", "--train.eval_batches", "1",
            "--train.out_dir", str(tmp_path / "out"), "--tiers.nvme_dir", str(tmp_path / "swap"), "--no-progress",
        ], *extra)

    return make
