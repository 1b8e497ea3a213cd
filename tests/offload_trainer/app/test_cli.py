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


def test_resume_by_name_is_found_in_the_out_dir_and_a_missing_one_says_so(tmp_path, monkeypatch) -> None:
    from offload_trainer.app.run_checks import resume_path

    out_dir = tmp_path / "run"
    (out_dir / "ckpt-000004").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # not the out dir: the name is still found there
    assert resume_path("ckpt-000004", out_dir) == out_dir / "ckpt-000004"
    with pytest.raises(ValueError, match=r"neither .*ckpt-000007 nor .* exists; the checkpoints in .* are ckpt-000004"):
        resume_path("ckpt-000007", out_dir)
    with pytest.raises(ValueError, match=r"/no/such/ckpt does not exist"):
        resume_path("/no/such/ckpt", out_dir)
    # with no checkpoint at all, --resume latest is no way on (it was suggested): a fresh run is
    with pytest.raises(ValueError, match=r"has no checkpoint \(start without --resume, or say --resume auto\)$"):
        resume_path("ckpt-000007", tmp_path / "empty")


def test_help_lists_every_config_field_with_type_default_and_doc(capsys) -> None:
    import dataclasses

    from offload_trainer.app.cli import build_parser
    from offload_trainer.app.run_config import RunConfig

    text = build_parser().format_help()
    cfg = RunConfig.from_dict(DEFAULT_RUN)
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        keys = [f"{section.name}.{f.name}" for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else [section.name]
        for key in keys:
            assert f"  --{key}  " in text, key
    assert "--train.keep_last  an int  (default 3)" in text
    # string fields of a fixed list of names show the names, as enum fields do (they said "a string")
    assert "--model.preset  one of 'tiny', 'small', '125m', '350m', '1b', '7b', '13b', '70b'  (default small)" in text
    assert "--train.export_dtype  one of 'fp32', 'bf16', 'fp16' or None  (default fp32)" in text
    assert "--tiers.host_budget_bytes  byte size or None  (default none)" in text
    assert "--optimizer.lr  a number  (default 0.002)\n      Peak learning rate" in text
    # a one-tier placement as a file writes it, not as {"device": 0.0, "host": 0.0, "nvme": 1.0}
    assert "--tiers.params  a tier name ('device', 'host', 'nvme') or a table of tier fractions  (default nvme)" in text
    assert "--tiers.grads  a tier name ('device', 'host', 'nvme') or a table of tier fractions  (default host)" in text
    assert "'16G'" in text and "powers of 1024" in text and "powers of 1000" in text


def test_every_flag_of_offload_train_is_in_its_readme_section() -> None:
    import re

    from offload_trainer.app.cli import build_parser
    from tests.test_docs import README

    section = README[README.index("## offload-train\n") :]
    section = section[: section.index("\n## ", 1)]
    flags = sorted(set(re.findall(r"\[(--[a-z][a-z-]*)", build_parser().format_usage())) - {"--help"})
    assert "--resume" in flags
    missing = [f for f in flags if not re.search(rf"{f}\b", section)]
    assert not missing, f"README's offload-train section does not mention {missing}"


def test_the_help_names_modules_the_built_in_decoder_has() -> None:
    """--help said the built-in decoder's LoRA targets were ["wq", "wv"], which it has not (PEFT: "Target
    modules {'wq', 'wv'} not found"); and that train.export_dtype writes out_dir/model.safetensors, which a
    Hugging Face model's run never does (out_dir/hf/)."""
    import re

    import torch

    from offload_trainer.app.cli import build_parser
    from offload_trainer.models.decoder import DecoderConfig, DecoderLM

    text = " ".join(build_parser().format_help().split())
    named = re.search(r"needed for the built-in decoder: e\.g\. \[([^\]]*)\]", text)
    assert named is not None, "the help gives the built-in decoder's LoRA targets"
    linears = {name.rsplit(".", 1)[-1] for name, m in DecoderLM(DecoderConfig.preset("tiny")).named_modules()
               if isinstance(m, torch.nn.Linear)}
    assert set(re.findall(r'"(\w+)"', named.group(1))) <= linears
    assert "out_dir/hf/ for a Hugging Face model" in text
