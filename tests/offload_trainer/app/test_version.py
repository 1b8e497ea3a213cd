"""Every command says its version (and torch's), and every checkpoint records the versions that wrote it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import offload_trainer as ot
from offload_trainer.app import cli, plan_cli
from offload_trainer.app.bench import bench_io, bench_offload, many_layers, tune_prefetch
from offload_trainer.models import DecoderConfig, DecoderLM


@pytest.mark.parametrize("main", [cli.main, plan_cli.main, bench_io.main, bench_offload.main, tune_prefetch.main, many_layers.main])
def test_every_command_prints_its_version(main, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f" {ot.__version__} (torch {torch.__version__})" in out, out


def test_a_checkpoint_records_the_versions_that_wrote_it(tmp_path: Path) -> None:
    cfg = ot.OffloadConfig(tiers={"params": "host", "grads": "host", "optimizer": "host"})
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg, device="cpu") as engine:
        engine.save_checkpoint(tmp_path / "ckpt")
        manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
        assert manifest["written_by"] == {"offload_trainer": ot.__version__, "torch": torch.__version__}
        engine.load_checkpoint(tmp_path / "ckpt")
