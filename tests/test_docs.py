"""README.md must say what the code does: every config key and every script flag appears in it,
and the test command it gives is the one .ci/run runs."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import offload_trainer.config as config
from offload_trainer.app import run_config
from io_engine import IOConfig

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()

SECTIONS = {
    "tiers": config.TierConfig,
    "prefetch": config.PrefetchConfig,
    "grouping": config.GroupingConfig,
    "optimizer": config.OptimizerConfig,
    "precision": config.PrecisionConfig,
    "io": IOConfig,
    "model": run_config.ModelConfig,
    "data": run_config.DataConfig,
    "train": run_config.TrainConfig,
    "lora": run_config.LoraConfig,
}


def test_every_config_key_is_in_the_reference() -> None:
    keys = [f.name for f in dataclasses.fields(run_config.RunConfig) if f.name not in SECTIONS]
    keys += [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    missing = [k for k in keys if f"| `{k}` |" not in README]
    assert not missing, f"README's configuration reference lacks {missing}"


def test_every_bench_io_flag_is_documented() -> None:
    help_text = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_io.py"), "--help"], capture_output=True, text=True, check=True
    ).stdout
    flags = sorted(set(re.findall(r"(--[a-z][a-z-]+)", help_text)) - {"--help"})
    missing = [f for f in flags if f"`{f}`" not in README]
    assert not missing, f"README lacks bench_io.py flags {missing}"


def test_readme_states_the_cli_defaults() -> None:
    from offload_trainer.app.run_config import DEFAULT_RUN

    opt = DEFAULT_RUN["optimizer"]
    assert f"`lr` {opt['lr']:g}" in README and f"`weight_decay` {opt['weight_decay']:g}" in README
    assert DEFAULT_RUN["tiers"]["nvme_dir"] in README


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    command = "python3 -m pytest -q -n 2"
    assert f"bash scripts/install.sh && {command} " in README
    assert "bash scripts/install.sh" in ci and f"{command}\n" in ci


def test_every_cited_note_is_written_somewhere() -> None:
    """A `[Note: X]` cited in the code or the docs is defined in the repository: a line that is the
    note's name alone (in a docstring, a comment, or a Markdown heading)."""
    this = Path(__file__).resolve()
    files = [
        p for p in REPO.rglob("*")
        if p.suffix in (".py", ".md") and ".git" not in p.parts and p.is_file() and p.resolve() != this
    ]
    cited, defined = set(), set()
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            cited.update(re.findall(r"\[Note: [^\]]+\]", line))
            bare = line.strip().lstrip("#").strip()
            if re.fullmatch(r"\[Note: [^\]]+\]", bare):
                defined.add(bare)
    assert cited - defined == set(), f"notes cited but never written: {sorted(cited - defined)}"


def test_every_python_file_the_docs_name_exists() -> None:
    """A `path/to/file.py` named in README.md or docs/design.md is a file of the repository (named by
    its path from the root, or by the end of that path: `runtime/test_hooks.py`, `token_cache.py`)."""
    files = ["/" + p.relative_to(REPO).as_posix() for p in REPO.rglob("*.py") if ".git" not in p.parts]
    missing = []
    for doc in ("README.md", "docs/design.md"):
        text = (REPO / doc).read_text()
        for name in sorted(set(re.findall(r"(?<![\w./-])((?:[\w-]+/)*\w+\.py)\b", text))):
            if not any(f.endswith("/" + name) for f in files):
                missing.append(f"{doc}: {name}")
    assert not missing, f"the docs name files that do not exist: {missing}"
