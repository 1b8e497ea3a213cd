"""A setting that names a file or directory (tiers.nvme_dir, train.out_dir, data.path, ...): a Path or
a string, with a leading `~` expanded; a NUL character, which no path holds, is refused.

A shell expands `~/scratch` on a command line, but nothing did in a config file: a run config's
`nvme_dir = "~/scratch"` made a directory named `~` in the working directory and put the swap files
there, and `data.path = "~/corpus"` was "no corpus at '~/corpus'". So `~` and `~user` are expanded
here, as the benchmarks' flags do, and a `~` with no home to stand for is refused with the fix.
"""

from __future__ import annotations

import os
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
    if not isinstance(value, str) or not value.startswith("~"):
        return value
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        raise ValueError(
            f"{key}={value!r} starts with ~, but there is no such home directory to expand it to (HOME unset, or "
            "no such user): give the path without ~"
        )
    return expanded


__all__ = ["path_setting"]
