"""The one safe way to create a file: written beside its target, fsynced, then renamed into place.

    write_atomic("runs/x/config.json", text)                 # all or nothing
    with atomic_open("runs/x/model.safetensors") as f:       # streamed: f.write(...) as often as needed
        f.write(header)
    fsync_dir("runs/x")                                      # after renaming a directory into it
    make_dirs("runs/x")                                      # mkdir -p, each new entry durable

[Note: Creating files safely]
A file is first written to a temporary name in the target's own directory, created with
O_CREAT | O_EXCL | O_NOFOLLOW and a random suffix: a file or symlink already at that name (planted
by someone else) makes the open fail instead of being followed or truncated. The data is fsynced,
the temporary name renamed over the target (rename replaces a symlink at the target; it never
writes through it), and the directory fsynced, so that a crash at any instant leaves either the
old file or the complete new one, never a torn one. On any failure the temporary file is removed.

[Note: What a killed writer leaves]
SIGKILL (an OOM kill, a scheduler's) gives no chance to remove the temporary: it stays beside the
target as `<name>.tmp-<random>`. The writer holds an exclusive flock on its temporary from the
moment it is created until it is renamed, and atomic_open first removes the temporaries of its
target that no one holds (remove_stale_temporaries), so the next write of the same file (the same
offload-plan --write-config again, the next cache write, the next engine.export_safetensors of a
path: a killed export's temporary held a model's bytes, for good) removes what a killed one left. An empty
temporary is left until it is older than STALE_TEMPORARY_S: a live writer's is empty for the instant
between its creation and its lock. Where the file system has no flock, nothing is removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from pathlib import Path
from typing import IO, Iterator, List, Union

from .sequential_file import SequentialFile

try:
    import fcntl
except ImportError:  # not POSIX: temporaries are not locked, and none is removed as stale
    fcntl = None  # type: ignore[assignment]

PathLike = Union[str, "os.PathLike[str]"]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
TEMP_MARKER = ".tmp-"
"""Temporary files are named `<name>.tmp-<random>`: what a killed writer leaves is recognisable."""
STALE_TEMPORARY_S = 60.0
"""Age past which an empty, unlocked temporary is a killed writer's (see [Note: What a killed writer leaves])."""


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


def make_dirs(path: PathLike) -> None:
    """Make the directory `path` and its missing parents (Path.mkdir(parents=True, exist_ok=True)),
    each new one made durable in the directory holding it (fsync_dir), outermost first. A new
    directory's entry is no more durable than a rename's: a run's first train.out_dir (or an
    export's or a checkpoint's new parent) could vanish on power loss with every file fsynced in it."""
    target = Path(path)
    made = []
    here = target
    while not os.path.isdir(here) and here.parent != here:
        if os.path.lexists(here):  # what mkdir of a directory under it says (Path.mkdir: FileExistsError)
            raise NotADirectoryError(errno.ENOTDIR, _NOT_A_DIRECTORY, os.fspath(here))
        made.append(here)
        here = here.parent
    target.mkdir(parents=True, exist_ok=True)
    for directory in reversed(made):
        try:
            fsync_dir(directory.parent)
        except PermissionError:  # a parent one may write into but not open (mode -wx): as durable as it gets
            pass


def open_exclusive(path: PathLike, mode: int = 0o666) -> int:
    """A new file's descriptor (write-only), never following or replacing what is already at `path`.

    FileExistsError if anything (a file, a directory, a symlink) is there. `mode` is subject to the umask."""
    return os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode)


def open_append(path: PathLike, mode: int = 0o666) -> IO[str]:
    """A text file opened to append to (made if missing), refusing a symlink at `path` (OSError ELOOP)."""
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, mode)
    return os.fdopen(fd, "a", encoding="utf-8")


_TOKEN_HEX_BYTES = 8
_DEFAULT_NAME_MAX = 255
"""Bytes in one name on Linux's file systems; pathconf's PC_NAME_MAX where it answers (eCryptfs: 143)."""


def temporary_prefix(target: Path) -> str:
    """`<name>.tmp-`, the name cut short (whole characters) where a temporary's full name would pass the
    directory's limit on a name: a target named with 240 bytes, itself valid, could never be written
    ("File name too long" naming the target) when its temporary took 21 bytes more."""
    try:
        name_max = os.pathconf(target.parent or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = _DEFAULT_NAME_MAX
    room = name_max - len(TEMP_MARKER) - 2 * _TOKEN_HEX_BYTES
    name = target.name
    while name and len(os.fsencode(name)) > room:
        name = name[:-1]
    return name + TEMP_MARKER


def temporary_name(target: Path) -> Path:
    """A fresh, unpredictable temporary name beside `target`: `<name>.tmp-<16 hex digits>`, the name
    shortened where the whole would be too long for the file system (temporary_prefix)."""
    return target.with_name(f"{temporary_prefix(target)}{secrets.token_hex(_TOKEN_HEX_BYTES)}")


_NOT_A_DIRECTORY = "Not a directory: a file is there, where a directory is needed"
"""make_dirs's strerror for a file in the way (the plain "Not a directory" left unsaid which was wrong)."""
_A_DIRECTORY = "Is a directory, where a file is to be written"
"""refuse_directory_at's strerror."""


def refuse_directory_at(target: Path) -> None:
    """IsADirectoryError (EISDIR, naming `target`) when a directory (not a symlink to one, which the
    rename replaces) is at `target`. Checked before anything is written: the rename at the end of
    atomic_open failed there only after all the data was (an export: every group gathered), and
    named the temporary beside it."""
    try:
        mode = os.lstat(target).st_mode
    except OSError:  # nothing there (or unreachable: the temporary's creation says why)
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, _A_DIRECTORY, os.fspath(target))


def check_file_target(path: PathLike) -> None:
    """What atomic_open (after make_dirs of its directory) would meet at `path`, checked now, for a
    file written later (a trace at the end of a step): IsADirectoryError for a directory there,
    NotADirectoryError naming a file where one of its directories would be."""
    target = Path(path)
    refuse_directory_at(target)
    here = target.parent
    while not os.path.lexists(here) and here.parent != here:
        here = here.parent
    if os.path.lexists(here) and not os.path.isdir(here):
        raise NotADirectoryError(errno.ENOTDIR, _NOT_A_DIRECTORY, os.fspath(here))


@contextlib.contextmanager
def atomic_open(path: PathLike, binary: bool = True, mode: int = 0o666) -> Iterator[IO]:
    """Write a new version of `path`: yields a file at a temporary name beside it (binary: a
    SequentialFile, whose failures name `path`, the offset and the size), renamed over `path` (after
    fsync of the file, then of the directory) when the block ends without an exception. What killed
    writers of `path` left beside it is removed first (remove_stale_temporaries)."""
    target = Path(path)
    refuse_directory_at(target)
    remove_stale_temporaries(target)
    tmp = temporary_name(target)
    fd = open_exclusive(tmp, mode)
    try:
        _lock(fd)  # held until the descriptor closes: the temporary is a live writer's
        if binary:  # its failures name the target, the offset and the size (a full disk mid-export)
            with SequentialFile(fd, target) as f:
                yield f
                f.fsync()
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as t:
                yield t
                t.flush()
                os.fsync(t.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def _lock(fd: int) -> bool:
    """Take the exclusive flock of `fd` without waiting; False if another holds it or there is no flock."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (EWOULDBLOCK), or no flock on this file system (ENOLCK, EOPNOTSUPP)
        return False
    return True


def remove_stale_temporaries(path: PathLike) -> List[Path]:
    """Remove the temporaries of `path` (`<name>.tmp-*` regular files beside it) that killed writers
    left: those whose flock no one holds, and if empty older than STALE_TEMPORARY_S. Returns what
    was removed. Never raises: upkeep never fails a write."""
    target = Path(path)
    prefix = temporary_prefix(target)
    removed: List[Path] = []
    try:
        names = [n for n in os.listdir(target.parent or ".") if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        tmp = target.with_name(name)
        try:
            fd = os.open(tmp, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
        except OSError:  # gone meanwhile, a symlink, unreadable: not ours to remove
            continue
        try:
            info = os.fstat(fd)
            young_and_empty = info.st_size == 0 and time.time() - info.st_mtime < STALE_TEMPORARY_S
            if stat.S_ISREG(info.st_mode) and not young_and_empty and _lock(fd):
                os.unlink(tmp)
                removed.append(tmp)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def write_atomic(path: PathLike, data: Union[str, bytes], mode: int = 0o666) -> None:
    """Replace `path` with `data` (text as UTF-8) all at once: see atomic_open (which first removes
    what killed writers of `path` left beside it)."""
    with atomic_open(path, binary=isinstance(data, bytes), mode=mode) as f:
        f.write(data)


__all__ = [
    "STALE_TEMPORARY_S",
    "TEMP_MARKER",
    "remove_stale_temporaries",
    "atomic_open",
    "check_file_target",
    "fsync_dir",
    "make_dirs",
    "open_append",
    "open_exclusive",
    "temporary_name",
    "temporary_prefix",
    "write_atomic",
]
