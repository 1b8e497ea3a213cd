"""The Python this package runs on: 3.11 or newer, checked first when the package is imported.

    require_supported_python()      # offload_trainer/__init__.py, before anything else is imported

pyproject.toml's requires-python (>=3.11) keeps pip from installing the package on an older Python, but
a source checkout on PYTHONPATH, or an install made with --ignore-requires-python, reached a
ModuleNotFoundError for tomllib (new in 3.11: config files are TOML) deep in an import, as a
traceback, and every command with it. Here an older Python is refused at once: ImportError for a
program that imports the package, and for one that does not catch it (offload-train, offload-plan,
the scripts) one line naming the version and the fix, exit status 2.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Optional, Sequence, Type

MINIMUM = (3, 11)
"""The oldest Python supported: pyproject.toml's requires-python (tests/offload_trainer/test_python_version.py)."""

EXIT_USAGE = 2
"""The exit status of a mistake the user can fix (app/user_errors.py's, which this file cannot import yet)."""


class UnsupportedPythonError(ImportError):
    """The package was imported on a Python older than MINIMUM."""


def require_supported_python(version_info: Sequence[object] = sys.version_info) -> None:
    """UnsupportedPythonError naming this Python and the fix unless `version_info` is MINIMUM or newer."""
    if tuple(version_info[:2]) >= MINIMUM:
        return
    running = ".".join(str(part) for part in version_info[:3])
    needed = ".".join(str(part) for part in MINIMUM)
    error = UnsupportedPythonError(
        f"offload-trainer needs Python {needed} or newer (it reads TOML with tomllib, new in {needed}), but this is "
        f"Python {running} ({sys.executable}): run it with python{needed} or newer (pip installs it only there)"
    )
    _one_line_if_uncaught()
    raise error


def _one_line_if_uncaught() -> None:
    """An UnsupportedPythonError that no one catches ends the program with its message on one line and
    exit status 2, not a traceback with status 1; every other exception goes to the hook as before. A
    hook someone installed already (IPython's, a crash reporter's) is left in place."""
    if sys.excepthook is not sys.__excepthook__:
        return
    previous = sys.excepthook

    def hook(kind: Type[BaseException], value: BaseException, traceback: Optional[TracebackType]) -> None:
        if not isinstance(value, UnsupportedPythonError):
            previous(kind, value, traceback)
            return
        try:
            print(value, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass  # no stderr: the exit status still says it
        raise SystemExit(EXIT_USAGE)

    sys.excepthook = hook
