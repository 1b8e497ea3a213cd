"""How a command ends on a mistake its user can fix: one line naming the path, what is wrong and the
fix, exit status 2, no traceback. Shared by offload-train, offload-plan and the scripts.

    parser = OneLineParser(prog="offload-plan")            # argparse: no prefix matching, one-line errors
    roles = [PathRole(cfg.train.out_dir, "train.out_dir")]  # which setting each path comes from
    with naming_path(out_dir / "config.json"):              # an OSError without a path gets this one
        write_atomic(...)
    message = describe_user_error(exc, roles)               # None: not the user's doing (a bug: traceback)

A user causes OSErrors (a directory that is a file, read-only, on a full disk, a dangling symlink),
JSON and safetensors errors (a file that is not what its name says), CheckpointError, PlanError,
NonFiniteError and ValueError/TypeError (a setting out of range). Every other exception is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import resource
import sys
import warnings
from dataclasses import dataclass
from typing import Iterator, NoReturn, Optional, Sequence, Union

import torch

from io_engine.atomic_file import TEMP_MARKER
from io_engine.errors import NotEnoughSpaceError

from offload_trainer.version import __version__

EXIT_USAGE = 2
"""Exit status of a mistake the user can fix (argparse's own)."""

PathLike = Union[str, "os.PathLike[str]"]


class _StoreOnce(argparse._StoreAction):
    """argparse's plain store, refusing a second value: `--config a.toml --config b.toml` kept the last
    without a word, so the run used a file the user may not have meant."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: Optional[str] = None) -> None:
        given = parser._given  # type: ignore[attr-defined]  # OneLineParser's, reset by each parse
        if self.dest in given:
            raise argparse.ArgumentError(
                self, f"is given twice ({given[self.dest]!r}, then {values!r}): give it once"
            )
        given[self.dest] = values
        super().__call__(parser, namespace, values, option_string)


class OneLineParser(argparse.ArgumentParser):
    """argparse with prefix matching off (`--resum` is not `--resume`), its errors on one line, and a
    flag that takes a value refused when given twice (every command: offload-train, offload-plan and
    the scripts; `--steps 5 --steps 50` ran 50 without a word).

    argparse prints the usage and then the error (two lines); a script that reads a command's
    stderr, and a person scanning a log, get one line that says where to look."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        self._given: dict[str, object] = {}
        self.add_argument(
            "--version", action="version", version=f"%(prog)s {__version__} (torch {torch.__version__})",
            help="print the version and exit",
        )

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def, override]
        self._given = {}  # the values _StoreOnce has seen: this parse's alone
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)


def one_line(text: object) -> str:
    """`text` with its line breaks (and runs of spaces) made single spaces."""
    return " ".join(str(text).split())


@dataclass(frozen=True)
class PathRole:
    """A path the user gave, and the setting (or flag) it was given as: what a message tells them to change."""

    path: str
    setting: str
    """"train.out_dir", "--write-config", ..."""


def _role_of(path: Optional[str], roles: Sequence[PathRole]) -> Optional[str]:
    """The setting whose path holds `path` (the longest that does), or None."""
    if path is None:
        return None
    target = os.path.abspath(path)
    best: Optional[PathRole] = None
    for role in roles:
        root = os.path.abspath(role.path)
        if target == root or target.startswith(root.rstrip(os.sep) + os.sep):
            if best is None or len(root) > len(os.path.abspath(best.path)):
                best = role
    return best.setting if best is not None else None


_WHAT_AND_FIX = {
    errno.ENOSPC: ("the disk is full", "free space there, or set {setting} to a directory on a disk with room"),
    errno.EDQUOT: ("the disk quota is used up", "free space there, or set {setting} to a directory on another disk"),
    errno.EROFS: ("the file system is read-only", "set {setting} to a directory on a writable disk"),
    errno.EACCES: ("permission denied", "set {setting} to a directory you may write, or fix its permissions"),
    errno.EPERM: ("not permitted", "set {setting} to a directory you may write, or fix its permissions"),
    errno.ENOTDIR: ("a part of this path is a file, not a directory", "set {setting} to a path made of directories"),
    errno.EISDIR: ("it is a directory where a file belongs", "remove or rename the directory, or change {setting}"),
    errno.ENOENT: ("it does not exist", "check {setting}"),
    errno.ELOOP: (
        "it is a symbolic link, which is never followed for a file that is written",
        "remove the link (or change {setting})",
    ),
    errno.EEXIST: ("something is already there", "remove it, or change {setting}"),
    errno.ENAMETOOLONG: ("the path is too long", "choose a shorter {setting}"),
    errno.EMFILE: ("too many open files", "raise the limit (ulimit -n)"),
    errno.ENFILE: ("too many open files on this machine", "close some programs, or raise the system's limit"),
    errno.EIO: ("the disk reported an IO error", "check the disk (dmesg), or set {setting} to another disk"),
    errno.EFBIG: ("the file is too large for this file system or limit", "set {setting} to another disk"),
    errno.ENXIO: ("it is a FIFO or device with no one at the other end", "point {setting} at a regular file"),
    errno.ENOMEM: (
        "this machine's memory cannot hold what the placement keeps in memory",
        'move state to NVMe (tiers.params, tiers.optimizer = "nvme" with tiers.nvme_dir), set '
        "tiers.host_budget_bytes to what this machine can give (the plan is then checked against it), or "
        "train a smaller model",
    ),
}


_ADDRESS_SPACE_WHAT = "the process's address-space limit (ulimit -v) of {limit_mib:,} MiB is reached"
_ADDRESS_SPACE_FIX = "raise it (ulimit -v unlimited)"
_ARENA_FIX = (
    ", or set MALLOC_ARENA_MAX=2 in the environment (glibc reserves up to 64 MiB of address space for the heap "
    "of each thread that allocates)"
)
"""ENOMEM under `ulimit -v` (an RLIMIT_AS, as some batch schedulers set) is no shortage of memory: the built-in
tiny model, everything on NVMe, maps 1.7 GiB of address space for 0.27 GiB resident, most of it glibc's
per-thread heaps, and "this machine's memory cannot hold what the placement keeps in memory" sent the user to
move state to NVMe that was there already. MALLOC_ARENA_MAX=2 halves that run's address space (0.81 GiB)."""


def _address_space_limit_bytes() -> Optional[int]:
    """The soft RLIMIT_AS of this process, None when there is none."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


_ENGINE_SPACE_FIX = " or choose a directory on a larger disk"
"""How io_engine's NotEnoughSpaceError ends; the setting to change replaces it."""


def describe_os_error(exc: OSError, roles: Sequence[PathRole] = ()) -> str:
    """One line: the path, what is wrong (strerror and its meaning) and the fix, naming the setting."""
    path = exc.filename if exc.filename is not None else getattr(exc, "path", None) or getattr(exc, "directory", None)
    path = _target_of_temporary(path, exc.filename2)
    setting = _role_of(os.fspath(path) if path is not None else None, roles) or "the path"
    if isinstance(exc, NotEnoughSpaceError):  # it has the numbers and a fix already: name the setting in that fix
        return one_line(f"{str(exc).removesuffix(_ENGINE_SPACE_FIX)} there, or set {setting} to a directory on a larger disk")
    what, fix = _WHAT_AND_FIX.get(exc.errno or -1, ("", "check {setting}"))
    if exc.errno == errno.ENOMEM and (limit := _address_space_limit_bytes()) is not None:
        what = _ADDRESS_SPACE_WHAT.format(limit_mib=limit // 2**20)
        fix = _ADDRESS_SPACE_FIX + ("" if "MALLOC_ARENA_MAX" in os.environ else _ARENA_FIX)
    # io_engine's errors (TransferError, NotEnoughSpaceError) already say what failed, with numbers.
    detail = str(exc) if exc.__class__.__str__ is not OSError.__str__ else (exc.strerror or str(exc))
    where = f"{os.fspath(path)}: " if path is not None and os.fspath(path) not in detail else ""
    meaning = f" ({what})" if what and what.lower() not in detail.lower() else ""
    return one_line(f"{where}{detail}{meaning}; {fix.format(setting=setting)}")


_TEMPORARY_SUFFIX = re.compile(re.escape(TEMP_MARKER) + r"[0-9a-f]+$")


def _target_of_temporary(path: object, renamed_to: object) -> object:
    """The file the user knows for `path` when it is one of our temporaries (`name.tmp-<hex>`, which
    atomic writes create beside their target and remove on failure): the rename's destination, or the
    name without the suffix. A line naming the temporary sends the user after a file that is gone."""
    if path is None:
        return None
    text = os.fspath(path)  # type: ignore[arg-type]
    match = _TEMPORARY_SUFFIX.search(os.path.basename(text))
    if match is None:
        return path
    if renamed_to is not None:  # os.replace(temporary, target) failed: the target is in the way
        return renamed_to
    return text[: len(text) - len(match.group(0))]


def _safetensors_error() -> tuple:
    try:
        from safetensors import SafetensorError  # type: ignore[attr-defined]
    except ImportError:  # an older safetensors: no public name
        return ()
    return (SafetensorError,)


def describe_user_error(exc: BaseException, roles: Sequence[PathRole] = ()) -> Optional[str]:
    """The one-line message of a failure the user caused and can fix; None for anything else (a bug).

    ValueError covers CheckpointError, PlanError, NonFiniteError, json.JSONDecodeError and
    UnicodeDecodeError; their messages name the value and the fix already. A warning raised as an
    error (-W error, PYTHONWARNINGS=error: a CI job's environment) is a note the user asked to stop on:
    its line, not a traceback with exit status 1 (an O_DIRECT fallback on tmpfs, a cache that
    cannot be written)."""
    if isinstance(exc, (ValueError, TypeError)):  # first: some are OSErrors too (a corpus not found)
        return one_line(exc)
    if isinstance(exc, Warning):
        return one_line(f"{exc} (a warning, which the warnings filter makes an error: -W error or "
                        "PYTHONWARNINGS=error); leave that filter out to have it as a note, or fix what it says")
    if isinstance(exc, OSError):
        return describe_os_error(exc, roles)
    if isinstance(exc, _safetensors_error()):
        return one_line(f"a safetensors file could not be read ({exc}): check the *.safetensors files named")
    return None


@contextlib.contextmanager
def naming_path(path: PathLike) -> Iterator[None]:
    """An OSError raised inside that names no file (a failed write() names none) is given `path`."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENOMEM:  # memory, not a file: a path here would send the user to the wrong place
            exc.filename = None
        elif exc.filename is None and getattr(exc, "path", None) is None and getattr(exc, "directory", None) is None:
            exc.filename = os.fspath(path)
        raise


@contextlib.contextmanager
def warnings_as_lines(prog: str) -> Iterator[None]:
    """Inside, a warning is printed at once as one line, `prog: warning: message`, not Python's two
    (file:line, then the source line), for a command whose output is read as it comes (offload-plan)."""

    def show(message: object, category: object, filename: str, lineno: int, file: object = None, line: object = None) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            print(f"{prog}: warning: {one_line(message)}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


__all__ = [
    "EXIT_USAGE",
    "OneLineParser",
    "PathRole",
    "describe_os_error",
    "describe_user_error",
    "naming_path",
    "one_line",
    "warnings_as_lines",
]
