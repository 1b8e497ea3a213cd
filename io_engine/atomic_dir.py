"""The one safe way to replace a directory: filled beside its target, fsynced, then swapped into place.

    with atomic_dir("runs/x/hf") as tmp:                     # all or nothing, a directory of files
        (tmp / "config.json").write_text(text)
        write_weights(tmp / "model.safetensors")

[Note: Replacing a directory as a whole]
An export is several files that only make sense together (a config saying bf16 and the weights
it describes). Written file by file into its target, a kill part-way left a directory of mixed
files (some new, some old, some missing) that looked complete. Here the new version is written
into a fresh directory beside the target (`<name>.tmp-<random>`, made with mkdir: an entry already
at that name makes it fail, as atomic_file's O_EXCL does), every file and directory in it is
fsynced, and it is then swapped with the target in one step: renameat2(RENAME_EXCHANGE) on Linux,
so the target's name holds the old complete version up to that instant and the new complete one
after it. The old version, now at the temporary name, is removed afterwards; a kill during its
removal leaves only a `*.tmp-*` name, which the next run removes. Where the exchange is missing
(another OS, a file system without it), the old version is renamed aside first and the new one
renamed in: a kill between the two renames leaves no directory at the target (never a mixed one)
and both versions under temporary names. On any failure in the block the new directory is removed
and the target is left as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Callable, Iterator, Optional

from .atomic_file import PathLike, fsync_dir, make_dirs, temporary_name

_RENAME_EXCHANGE = 2
"""linux/fs.h: atomically exchange the two names (both must exist)."""
_AT_FDCWD = -100
_EXCHANGE_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)
"""What renameat2 returns where it, or RENAME_EXCHANGE on this file system, is missing."""


def _load_renameat2() -> Optional[Callable[..., int]]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = libc.renameat2  # glibc 2.28 and later
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()


def exchange(a: PathLike, b: PathLike) -> bool:
    """Swap the entries at `a` and `b` in one step (both must exist); False where this OS or file
    system cannot (nothing was changed then). Other errors raise OSError with both paths."""
    if _renameat2 is None:
        return False
    src, dst = os.fsencode(os.fspath(a)), os.fsencode(os.fspath(b))
    if _renameat2(_AT_FDCWD, src, _AT_FDCWD, dst, _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(err, f"exchanging {os.fspath(a)} with {os.fspath(b)}: {os.strerror(err)}")


def fsync_tree(root: Path) -> None:
    """fsync every regular file under `root`, then every directory, deepest first (symlinks untouched)."""
    for parent, dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(parent, name)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(parent)


def remove_path(path: Path) -> None:
    """Remove what is at `path`: a directory with its contents, a file or a symlink itself (never followed)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def replace_dir(new: Path, target: Path) -> None:
    """Put the complete directory `new` (fsynced) at `target`, in one step where the OS can (see
    [Note: Replacing a directory as a whole]), then remove the version it replaced."""
    if not os.path.lexists(target):
        os.rename(new, target)
        fsync_dir(target.parent)
        return
    if exchange(new, target):  # `new` now holds the old version
        fsync_dir(target.parent)
        remove_path(new)
        return
    aside = temporary_name(target)
    os.rename(target, aside)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(aside, target)  # the old version back where it was
        raise
    fsync_dir(target.parent)
    remove_path(aside)


@contextlib.contextmanager
def atomic_dir(path: PathLike) -> Iterator[Path]:
    """Write a new version of the directory `path` as a whole: yields a fresh empty directory beside
    it (its parent made if missing), which replaces `path` (and whatever was there) when the block
    ends without an exception.
    On an exception the new directory is removed and `path` is left as it was."""
    target = Path(path)
    make_dirs(target.parent)
    tmp = temporary_name(target)
    os.mkdir(tmp, 0o777)  # fails if anything is at that name: never a directory planted there
    try:
        yield tmp
        fsync_tree(tmp)
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["atomic_dir", "exchange", "fsync_tree", "remove_path", "replace_dir"]
