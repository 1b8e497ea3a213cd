"""A config file's "~/scratch" is the user's scratch directory, not a directory named "~" in the working
directory (nothing expanded it: a shell does so only on a command line)."""

from __future__ import annotations

import pwd
from pathlib import Path

import pytest

from offload_trainer.app.run_config import RunConfig
from offload_trainer.config.path_setting import path_setting


def test_every_path_setting_of_a_run_config_expands_a_leading_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\nhf_path = "~/model"\n[data]\npath = "~/corpus"\ncache_dir = "~/cache"\n'
        '[train]\nout_dir = "~/run"\n[tiers]\nnvme_dir = "~/swap"\n'
    )
    cfg = RunConfig.from_file(config)
    assert cfg.model.hf_path == str(tmp_path / "model")
    assert (cfg.data.path, cfg.data.cache_dir) == (str(tmp_path / "corpus"), str(tmp_path / "cache"))
    assert cfg.train.out_dir == str(tmp_path / "run") and cfg.tiers.nvme_dir == str(tmp_path / "swap")
    assert RunConfig().with_overrides({"tiers.nvme_dir": "~/other"}).tiers.nvme_dir == str(tmp_path / "other")


def test_paths_without_a_tilde_are_kept_as_given(tmp_path: Path) -> None:
    assert path_setting("runs/a~b", "train.out_dir") == "runs/a~b"
    assert path_setting(tmp_path / "x", "train.out_dir") == str(tmp_path / "x")
    assert path_setting(None, "tiers.nvme_dir") is None


def test_a_tilde_with_no_home_behind_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOME", raising=False)

    def no_entry(uid: int) -> None:
        raise KeyError(uid)

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with pytest.raises(ValueError, match=r"tiers.nvme_dir='~/swap' starts with ~, but there is no such home"):
        path_setting("~/swap", "tiers.nvme_dir")
    with pytest.raises(ValueError, match="train.out_dir='~nosuchuser-x/run'"):
        path_setting("~nosuchuser-x/run", "train.out_dir")


@pytest.mark.parametrize("key", ["model.hf_path", "data.path", "data.cache_dir", "train.out_dir", "tiers.nvme_dir"])
def test_a_nul_in_any_path_setting_is_refused_by_the_config(key: str) -> None:
    """offload-plan --no-measure took tiers.nvme_dir="a\\0b" (and could write it into --write-config);
    offload-train refused it only when the path was first used."""
    with pytest.raises(ValueError, match=rf"^{key.replace('.', '[.]')}='a\\x00b' holds a NUL character"):
        RunConfig().with_overrides({key: "a\0b"})


@pytest.mark.parametrize("key", ["model.hf_path", "data.path", "data.cache_dir", "train.out_dir", "tiers.nvme_dir"])
def test_a_path_the_locale_cannot_name_is_refused_by_the_config(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under LC_ALL=C with PYTHONUTF8=0 (an ASCII file system encoding) a config file's "/runs/rün" stopped
    the run at the path's first use with "'ascii' codec can't encode character '\\xfc'", no setting named."""
    monkeypatch.setattr("sys.getfilesystemencoding", lambda: "ascii")
    with pytest.raises(ValueError, match=rf"^{key.replace('.', '[.]')}='/runs/r\xfcn' holds '\xfc', which the file sys"):
        RunConfig().with_overrides({key: "/runs/r\u00fcn"})
    assert path_setting("/runs/r\udcc3\udcbcn", key) == "/runs/r\udcc3\udcbcn"  # from argv: bytes it cannot decode


def test_a_non_ascii_path_is_kept_under_a_utf8_file_system_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.getfilesystemencoding", lambda: "utf-8")
    assert path_setting("/runs/r\u00fcn \u65e5\u672c", "train.out_dir") == "/runs/r\u00fcn \u65e5\u672c"
