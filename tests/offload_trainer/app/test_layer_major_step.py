"""train.micro_batch_order = "layer_major" trains to bitwise the same losses as micro-batch-major."""

from __future__ import annotations

from pathlib import Path

import pytest

from offload_trainer.app.run_config import DataConfig, MicroBatchOrder, ModelConfig, RunConfig, TrainConfig
from offload_trainer.app.trainer import run

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def _config(tmp_path: Path, order: str) -> RunConfig:
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for i in range(3):
        (corpus / f"doc{i}.py").write_text(f"# document {i}\n" + TEXT)
    return RunConfig(
        grad_accum_steps=3,
        tiers={"params": "nvme", "grads": "host", "optimizer": "host", "nvme_dir": str(tmp_path / "swap")},
        model=ModelConfig(preset="tiny"),
        data=DataConfig(path=str(corpus), seq_len=16, batch_size=2),
        train=TrainConfig(
            steps=2, out_dir=str(tmp_path / order), checkpoint_every=0, eval_batches=1, export_dtype=None,
            micro_batch_order=MicroBatchOrder(order),
        ),
    )


def test_layer_major_run_matches_micro_batch_major(tmp_path) -> None:
    (tmp_path / "swap").mkdir()
    plain = run(_config(tmp_path, "micro_batch_major"), progress=False)
    layered = run(_config(tmp_path, "layer_major"), progress=False)
    assert layered.first_loss == plain.first_loss and layered.last_loss == plain.last_loss
    assert layered.eval_loss == plain.eval_loss


def test_unknown_order_is_refused() -> None:
    with pytest.raises(ValueError, match="micro_batch_order"):
        TrainConfig(micro_batch_order="layers_first")  # type: ignore[arg-type]
