"""The one safe way to create a file: written beside its target, fsynced, then renamed into place.

    write_atomic("runs/x/config.json", text)                 # all or nothing
    with atomic_open("runs/x/model.safetensors") as f:       # streamed: f.write(...) as often as needed
        f.write(header)
    fsync_dir("runs/x")                                      # after renaming a directory into it

[Note: Creating files safely]
A file is first written to a temporary name in the target's own directory, created with
O_CREAT | O_EXCL | O_NOFOLLOW and a random suffix: a file or symlink already at that name (planted
by someone else) makes the open fail instead of being followed or truncated. The data is fsynced,
the temporary name renamed over the target (rename replaces a symlink at the target; it never
writes through it), and the directory fsynced, so that a crash at any instant leaves either the
old file or the complete new one, never a torn one. On any failure the temporary file is removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path
from typing import IO, Iterator, Union

PathLike = Union[str, "os.PathLike[str]"]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
TEMP_MARKER = ".tmp-"
"""Temporary files are named `<name>.tmp-<random>`: what a killed writer leaves is recognisable."""


_DIR_FSYNC_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF)
"""What fsync of a directory returns on file systems that cannot sync one (SMB/CIFS, some FUSE and
9p/virtiofs mounts): the rename is as durable as that file system makes it, and PostgreSQL and
SQLite go on the same way. Failing there instead made every save of a run on such a disk fail."""


def fsync_dir(path: PathLike) -> None:
    """Make the directory's entries (a rename, a new file) durable, where the file system can."""
    fd = os.open(os.fspath(path), os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def open_exclusive(path: PathLike, mode: int = 0o666) -> int:
    """A new file's descriptor (write-only), never following or replacing what is already at `path`.

    FileExistsError if anything (a file, a directory, a symlink) is there. `mode` is subject to the umask."""
    return os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode)


def open_append(path: PathLike, mode: int = 0o666) -> IO[str]:
    """A text file opened to append to (made if missing), refusing a symlink at `path` (OSError ELOOP)."""
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, mode)
    return os.fdopen(fd, "a", encoding="utf-8")


def temporary_name(target: Path) -> Path:
    """A fresh, unpredictable temporary name beside `target`."""
    return target.with_name(f"{target.name}{TEMP_MARKER}{secrets.token_hex(8)}")


@contextlib.contextmanager
def atomic_open(path: PathLike, binary: bool = True, mode: int = 0o666) -> Iterator[IO]:
    """Write a new version of `path`: yields a file at a temporary name beside it, renamed over `path`
    (after fsync of the file, then of the directory) when the block ends without an exception."""
    target = Path(path)
    tmp = temporary_name(target)
    fd = open_exclusive(tmp, mode)
    try:
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def write_atomic(path: PathLike, data: Union[str, bytes], mode: int = 0o666) -> None:
    """Replace `path` with `data` (text as UTF-8) all at once: see atomic_open."""
    with atomic_open(path, binary=isinstance(data, bytes), mode=mode) as f:
        f.write(data)


__all__ = [
    "TEMP_MARKER",
    "atomic_open",
    "fsync_dir",
    "open_append",
    "open_exclusive",
    "temporary_name",
    "write_atomic",
]
