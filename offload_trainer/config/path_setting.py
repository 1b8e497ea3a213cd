"""A setting that names a file or directory (tiers.nvme_dir, train.out_dir, data.path, ...): a Path or
a string, with a leading `~` expanded; a NUL character, which no path holds, is refused.

A shell expands `~/scratch` on a command line, but nothing did in a config file: a run config's
`nvme_dir = "~/scratch"` made a directory named `~` in the working directory and put the swap files
there, and `data.path = "~/corpus"` was "no corpus at '~/corpus'". So `~` and `~user` are expanded
here, as the benchmarks' flags do, and a `~` with no home to stand for is refused with the fix.

A config file is UTF-8 (TOML says so), but file names are bytes in the locale's encoding: under a
C/POSIX locale without UTF-8 (PYTHONUTF8=0 PYTHONCOERCECLOCALE=0 LC_ALL=C, an ASCII file system
encoding) `out_dir = "/runs/rün"` cannot be named at all, and the run stopped at its first use of the
path with "offload-train: 'ascii' codec can't encode character '\\xfc' in position 18", naming neither
the setting nor the locale. Such a value is refused here, with the fix. (A path given on the command
line always can: Python decodes argv with the same encoding, escaping the bytes it cannot.)
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Union

PathValue = Union[str, "os.PathLike[str]", None]


def path_setting(value: PathValue, key: str) -> Optional[str]:
    """`value` as a string, `~` or `~user` at its start expanded; None stays None, and anything else
    that is not a string is returned as it is for the type checks that follow. ValueError naming `key`
    when `~` stands for no home (HOME unset and no password entry), or the value holds a NUL."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and "\0" in value:  # found here, not by whichever command reads it first (or none)
        raise ValueError(f"{key}={value!r} holds a NUL character, which no path can: remove it")
    if isinstance(value, str):
        _check_encodable(value, key)
    if not isinstance(value, str) or not value.startswith("~"):
        return value
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        raise ValueError(
            f"{key}={value!r} starts with ~, but there is no such home directory to expand it to (HOME unset, or "
            "no such user): give the path without ~"
        )
    return expanded


def _check_encodable(value: str, key: str) -> None:
    """ValueError naming `key` when `value` has characters the file system encoding cannot write
    (what os.fsencode does, spelled out so that a test can give it another encoding)."""
    encoding = sys.getfilesystemencoding()
    try:
        value.encode(encoding, sys.getfilesystemencodeerrors())
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{key}={value!r} holds {value[exc.start:exc.end]!r}, which the file system encoding of this locale "
            f"({encoding}: LANG/LC_ALL name no UTF-8 locale) cannot write in a file name: run under a UTF-8 locale "
            "(LC_ALL=C.UTF-8) or with PYTHONUTF8=1, or rename the path with ASCII characters only"
        ) from None


__all__ = ["path_setting"]
