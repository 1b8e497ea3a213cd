"""Every command pyproject.toml installs resolves to a main(), scripts/*.py are thin entry points to the
same mains, and the commands name themselves as installed and share one flag style (--kebab-case)."""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def _main(target: str):  # type: ignore[no-untyped-def]
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def test_every_console_script_resolves_to_a_main() -> None:
    assert {"offload-train", "offload-plan", "offload-bench-io", "offload-bench", "offload-tune-prefetch"} <= set(SCRIPTS)
    for target in SCRIPTS.values():
        assert callable(_main(target)), target


def test_scripts_are_thin_entry_points_to_the_installed_mains() -> None:
    installed = {target.split(":")[0] for target in SCRIPTS.values()}
    for script in sorted((REPO / "scripts").glob("*.py")):
        tree = ast.parse(script.read_text())
        imports = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module != "__future__"]
        assert [m for m in imports if m.startswith("offload_trainer")] and set(imports) - {"sys"} <= installed, script
        assert len(script.read_text().splitlines()) < 20, f"{script} is more than an entry point"


def test_the_commands_name_themselves_as_installed_and_use_kebab_case_flags() -> None:
    from offload_trainer.app.bench import bench_io_settings, bench_offload_settings, many_layers, tune_settings
    from offload_trainer.app import cli, plan_cli

    for name, parser in (("offload-bench-io", bench_io_settings.build_parser()),
                         ("offload-bench", bench_offload_settings.build_parser()),
                         ("offload-bench-many-layers", many_layers.build_parser()),
                         ("offload-tune-prefetch", tune_settings.build_parser()),
                         ("offload-train", cli.build_parser()), ("offload-plan", plan_cli.build_parser())):
        assert parser.prog == name
        flags = [opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")]
        assert all(re.fullmatch(r"--[a-z0-9]+(-[a-z0-9]+)*", f) for f in flags), (name, flags)
