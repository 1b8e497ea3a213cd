"""offload_trainer/python_version.py: an older Python is refused at import, in one line for a command."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from offload_trainer.python_version import MINIMUM, UnsupportedPythonError, require_supported_python

REPO = Path(__file__).resolve().parents[2]
AS_IF_3_10 = "import sys; sys.version_info = (3, 10, 12, 'final', 0)\n"
"""Python 3.10 is not on the test machines: the check reads sys.version_info, which a program may replace."""


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", AS_IF_3_10 + code], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def test_the_minimum_is_pyprojects_requires_python() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=" + ".".join(map(str, MINIMUM))


def test_an_older_python_is_an_import_error_naming_it_and_the_fix() -> None:
    require_supported_python((3, 11, 0, "final", 0))
    with pytest.raises(UnsupportedPythonError, match=r"needs Python 3\.11 or newer .* this is Python 3\.10\.12 .*"
                                                      r"run it with python3\.11 or newer"):
        require_supported_python((3, 10, 12, "final", 0))
    assert issubclass(UnsupportedPythonError, ImportError)


@pytest.mark.parametrize("command", [
    "import runpy; sys.argv = ['offload-train', '--help']; runpy.run_module('offload_trainer', run_name='__main__')",
    "from offload_trainer.app.launch import plan; sys.exit(plan(['--help']))",  # what the console script runs
])
def test_a_command_on_an_older_python_ends_with_one_line_and_exit_2(command: str) -> None:
    done = _run(command)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs Python 3.11 or newer" in lines[0] and "3.10.12" in lines[0], done.stderr


def test_a_program_that_catches_the_import_error_goes_on() -> None:
    done = _run("try:\n    import offload_trainer\nexcept ImportError as e:\n    print('caught', type(e).__name__)\n"
                "raise SystemExit(7)")
    assert (done.returncode, done.stdout.strip(), done.stderr) == (7, "caught UnsupportedPythonError", "")
