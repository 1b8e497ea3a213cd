"""offload-train's config resolution: its defaults, then the file, then the command line."""

from __future__ import annotations

import pytest

from offload_trainer.app.cli import resolve_config
from offload_trainer.app.run_config import DEFAULT_RUN


def test_a_file_may_rely_on_the_run_defaults(tmp_path) -> None:
    # nvme on its own is valid only with DEFAULT_RUN's nvme_dir in place: the file is validated
    # together with the defaults, not alone.
    path = tmp_path / "run.toml"
    path.write_text('[tiers]\nparams = "nvme"\n[optimizer]\nlr = 0.01\n')
    cfg = resolve_config(str(path), {"train.steps": "7"})
    assert cfg.tiers.nvme_dir == DEFAULT_RUN["tiers"]["nvme_dir"]
    assert cfg.tiers.params.nvme == 1.0 and cfg.tiers.optimizer.nvme == 1.0  # file key, default key
    assert cfg.optimizer.lr == 0.01 and cfg.optimizer.grad_clip_norm == DEFAULT_RUN["optimizer"]["grad_clip_norm"]
    assert cfg.train.steps == 7


def test_file_errors_still_name_the_file(tmp_path) -> None:
    path = tmp_path / "run.json"
    path.write_text('{"optimizer": {"lr": -1}}')
    with pytest.raises(ValueError, match=f"config file {path}: optimizer.lr"):
        resolve_config(str(path), {})
