"""FileStore: named extents in preallocated swap files, under a private directory removed on close.

    store = FileStore(engine, "/nvme/scratch")     # first removes the swap directories of dead runs
    store.allocate({"layer0.param": 4096 * 1000, "layer0.adam_m": 4096 * 1000},
                   labels={"layer0.adam_m": "group 'layer0' exp_avg"})
    store.write("layer0.param", tensor)            # blocking
    h = store.pread("layer0.param", tensor)        # in flight; h.wait(): IntegrityError if changed on disk
    h = store.pread_many([("layer0.param", a, 0), ("layer0.adam_m", b, 0)])   # both, one request
    store.free("layer0.param")                      # its requests waited for; the key is unknown from now
    store.close()                                   # the swap files are gone

Extents start at multiples of IOConfig.alignment_bytes and never share a disk block, so direct IO
of one extent cannot touch another's bytes. Free space is checked before anything is created,
and the space is reserved with posix_fallocate, so a full disk fails at allocate(), not in the
middle of training (where the file system cannot preallocate, the file is sparse instead: a disk
filled by someone else meanwhile then fails a write, a TransferError naming the file). An extent's disk space goes back to the file system when every extent of its
swap file (those of one allocate() call) is freed: the file is then removed.

The store's directory is locked by its live owner, and a new store removes the directories of
dead runs beside it, and again as it closes ([Note: Swap directory lifecycle] in swap_dirs.py). Every chunk written to an
extent has a checksum checked on every read, in the worker threads, unless
IOConfig.verify_checksums is False ([Note: Checksums of swap extents] in checksums.py).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .buffers import round_up
from .checksums import ExtentChecksums
from .engine import IOEngine, PathLike, Segment
from .errors import NotEnoughSpaceError, SwapReclaimWarning, TransferError
from .file import IOFile
from .handle import IOHandle
from .swap_dirs import SWAP_DIR_PREFIX  # noqa: F401 - re-exported: callers name the prefix from here
from .swap_dirs import dead_swap_dir_bytes, make_swap_dir, reclaim_dead_swap_dirs, remove_swap_dir


def existing_ancestor(path: str) -> str:
    """`path` if it exists, else its nearest existing parent (a swap directory not made yet)."""
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def free_bytes(path: str) -> int:
    """Bytes an unprivileged user may still write on the file system holding `path` (which need
    not exist yet: its nearest existing parent's file system is the one it would be made on)."""
    return shutil.disk_usage(existing_ancestor(os.path.abspath(path))).free



def swap_room_bytes(directory: str) -> int:
    """Bytes a FileStore made in `directory` can reserve: the file system's free bytes plus those the
    swap directories of dead runs there hold, which the store reclaims before it makes its own
    (swap_dirs.dead_swap_dir_bytes). What a check of the room for swap files reads, never free_bytes
    alone: after a SIGKILL, the killed run's swap files are the resumed run's room."""
    return free_bytes(directory) + dead_swap_dir_bytes(directory)

_MEMORY_FILE_SYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
"""statfs f_type of the file systems that keep their files in memory (linux/magic.h)."""


def memory_file_system(path: str) -> Optional[str]:
    """"tmpfs" or "ramfs" when the file system holding `path` (or its nearest existing parent) keeps its
    files in host memory, else None (also where it cannot tell: not Linux, statfs failing).

    A swap file there takes as much RAM as it holds bytes (posix_fallocate on tmpfs faults the pages in)
    and counts against a container's memory limit, while its free space (shutil.disk_usage) is the
    mount's size, up to half the RAM or more: memory a planner must not count twice."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        statfs = ctypes.CDLL(None, use_errno=True).statfs
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(512)  # struct statfs (120 bytes on x86-64); f_type, a long, comes first
    if statfs(os.fsencode(existing_ancestor(os.path.abspath(path))), buf) != 0:
        return None
    return _MEMORY_FILE_SYSTEMS.get(ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF)


@dataclass(frozen=True)
class Extent:
    """Where a key's bytes live: [offset, offset + size_bytes) of the swap file at `path`."""

    key: str
    path: str
    offset: int
    size_bytes: int
    label: Optional[str] = None
    """What the bytes are, for error messages (e.g. "group 'layers.3' exp_avg")."""


_NO_FALLOCATE_ERRNOS = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
"""What posix_fallocate returns where the file system cannot preallocate and the C library does not
emulate it (musl, as in Alpine images, on ZFS before 2.2 or some network file systems; EINVAL is
what some return for an operation they lack: the arguments here are always valid)."""


def _reserve(fd: int, size_bytes: int) -> None:
    """Make the file `size_bytes` long, its blocks reserved where the file system can (posix_fallocate);
    elsewhere a sparse file of that length, whose blocks are taken as they are written (the free-space
    check before still refuses what cannot fit at the start)."""
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as exc:
        if exc.errno not in _NO_FALLOCATE_ERRNOS:
            raise
        os.ftruncate(fd, size_bytes)


def _remove_swap_dir(root: str, files: List[IOFile], lock_fd: Optional[int]) -> None:
    try:
        for f in files:
            f.close()
    finally:  # the files go even if closing them was interrupted (remove_swap_dir)
        remove_swap_dir(root, lock_fd)
    # Dead runs' directories too young to judge when this store was made are judged again now: a run
    # resumed at once after a kill in the killed run's mkdir or removal left that directory behind for
    # good ([Note: Swap directory lifecycle]). Its problems are the next store's to warn of.
    reclaim_dead_swap_dirs(os.path.dirname(root))


class FileStore:
    """Named extents of swap files in a new private (0700) directory under `directory`.

    The directory is made if missing. Before anything else, the swap directories of dead runs in
    it are removed (reclaimed_dirs, reclaimed_bytes; a leftover that cannot be removed is a
    SwapReclaimWarning, never an error). The store's own directory is locked while it lives.
    Swap files are created 0600 and removed, with their directory, by close() or, failing that,
    when the store is garbage-collected or Python exits; dead runs' directories are then looked for
    again (those too young to judge at the start: see swap_dirs.py), without a report.
    """

    def __init__(self, engine: IOEngine, directory: PathLike) -> None:
        self.engine = engine
        parent = os.fspath(directory)
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise ValueError(f"swap directory {parent!r} exists but is not a directory; name a directory")
        os.makedirs(parent, exist_ok=True)
        reclaimed = reclaim_dead_swap_dirs(parent)
        for problem in reclaimed.problems:
            warnings.warn(f"io_engine: {problem}", SwapReclaimWarning, stacklevel=2)
        self.reclaimed_dirs: List[str] = reclaimed.dirs
        """Swap directories of dead runs in `directory` that this store removed when it was made."""
        self.reclaimed_bytes: int = reclaimed.freed_bytes
        """Bytes of the files removed with them (what the disk got back)."""
        self.root, lock_fd = make_swap_dir(parent)
        self._files: List[IOFile] = []
        self._extents: Dict[str, Extent] = {}
        self._file_of: Dict[str, IOFile] = {}
        self._checksums: Dict[str, ExtentChecksums] = {}
        self._num_files_made = 0
        """Swap files ever made: the next one's number (a freed file's name is never reused)."""
        self._finalizer = weakref.finalize(self, _remove_swap_dir, self.root, self._files, lock_fd)

    @property
    def extents(self) -> Dict[str, Extent]:
        """Every allocated extent by key."""
        return dict(self._extents)

    @property
    def allocated_bytes(self) -> int:
        """Bytes reserved on disk by all swap files, alignment padding included."""
        return sum(f.size() for f in self._files)

    def allocate(self, sizes: Mapping[str, int], labels: Optional[Mapping[str, str]] = None) -> List[Extent]:
        """Reserve one extent of `sizes[key]` bytes per key, in one new preallocated swap file.

        `labels` maps some keys to what their bytes are (say "group 'layers.3' exp_avg"), which
        an IntegrityError names. Raises NotEnoughSpaceError, before creating anything, if the
        file system lacks the room; ValueError for a key already allocated, a negative size or a
        label of a key not in `sizes`.
        """
        self._check_open()
        labels = dict(labels) if labels is not None else {}
        for key, label in labels.items():
            if key not in sizes:
                raise ValueError(f"label {label!r} is for key {key!r}, which is not among the keys to allocate")
            if not isinstance(label, str):
                raise ValueError(f"label {label!r} of extent {key!r} must be a string")
        alignment = self.engine.config.alignment_bytes
        layout = []
        cursor = 0
        for key, size in sizes.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"extent key {key!r} must be a non-empty string")
            if key in self._extents:
                raise ValueError(f"extent {key!r} is already allocated in {self.root}; pick another key")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"extent {key!r} size {size!r} must be a non-negative int of bytes")
            layout.append((key, cursor, size))
            cursor += round_up(max(size, 1), alignment)
        total = cursor
        if total == 0:
            return []
        available = free_bytes(self.root)
        if total > available:
            raise NotEnoughSpaceError(self.root, total, available)
        path = os.path.join(self.root, f"swap-{self._num_files_made:04d}.bin")
        self._num_files_made += 1
        f = self.engine.open(path, create=True)
        try:
            _reserve(f.fd_buffered, total)
        except OSError as exc:
            f.close()
            os.unlink(path)
            if exc.errno == errno.ENOSPC:
                raise NotEnoughSpaceError(self.root, total, free_bytes(self.root)) from exc
            raise TransferError("allocate", path, 0, total, exc.errno or 0) from exc
        self._files.append(f)
        config = self.engine.config
        made = []
        for key, offset, size in layout:
            extent = Extent(key, path, offset, size, labels.get(key))
            self._extents[key] = extent
            self._file_of[key] = f
            if config.verify_checksums:
                self._checksums[key] = ExtentChecksums(path, offset, size, config.block_bytes, key, extent.label)
            made.append(extent)
        return made

    def free(self, key: str) -> None:
        """Forget extent `key`: no request may use it from now, and its key may be allocated again.

        Every request on the extent must have been waited for (the file may be closed under it).
        Its disk space goes back to the file system when it was the last extent left of its swap
        file (extents of one allocate() call share a file): the file is then closed and removed,
        and allocated_bytes drops by its size; until then the space stays reserved. KeyError
        naming the known keys if `key` is not allocated; TransferError if the file cannot be removed.
        """
        self._check_open()
        self.extent(key)  # KeyError naming the known keys
        f = self._file_of.pop(key)
        del self._extents[key]
        self._checksums.pop(key, None)
        if any(other is f for other in self._file_of.values()):
            return
        self._files.remove(f)
        size = f.size()
        f.close()
        try:
            os.unlink(f.path)
        except OSError as exc:
            raise TransferError("remove", f.path, 0, size, exc.errno or 0) from exc

    def file_of(self, key: str) -> IOFile:
        """The open swap file that holds extent `key` (to fsync it, say)."""
        self.extent(key)  # KeyError naming the known keys
        return self._file_of[key]

    def extent(self, key: str) -> Extent:
        """The extent allocated for `key` (KeyError naming the known keys if none)."""
        try:
            return self._extents[key]
        except KeyError:
            known = ", ".join(sorted(self._extents)[:8])
            raise KeyError(f"no extent {key!r} in this store (known: {known or 'none'})") from None

    def _locate(self, key: str, buf: Any, offset: int, size: Optional[int]) -> "tuple[IOFile, int, int]":
        self._check_open()
        return self._place(key, buf, offset, size)

    def _place(self, key: str, buf: Any, offset: int, size: Optional[int]) -> "tuple[IOFile, int, int]":
        """_locate of a store known open (a request of several parts checks that once)."""
        extent = self._extents.get(key)
        if extent is None:
            extent = self.extent(key)  # raises, naming the known keys
        if size is None:
            size = _nbytes(buf)
        if offset < 0 or size < 0 or offset + size > extent.size_bytes:
            raise ValueError(
                f"request of {size} bytes at offset {offset} is outside extent {key!r} of "
                f"{extent.size_bytes} bytes; it would touch another extent's data"
            )
        return self._file_of[key], extent.offset + offset, size

    def pread(self, key: str, buf: Any, offset: int = 0, size: Optional[int] = None) -> IOHandle:
        """Start reading `size` bytes (default all of `buf`) at `offset` within extent `key`.

        The handle fails with IntegrityError if a checked chunk differs from what was written.
        """
        f, file_offset, size = self._locate(key, buf, offset, size)
        return self.engine.pread(f, buf, file_offset, size, check=self._checksums.get(key))

    def pwrite(self, key: str, buf: Any, offset: int = 0, size: Optional[int] = None) -> IOHandle:
        """Start writing `size` bytes (default all of `buf`) at `offset` within extent `key`.

        A read or write of the same bytes must not start before this one is done.
        """
        f, file_offset, size = self._locate(key, buf, offset, size)
        return self.engine.pwrite(f, buf, file_offset, size, check=self._checksums.get(key))

    def pread_many(self, parts: Sequence[Tuple[str, Any, int]]) -> IOHandle:
        """Start filling each `buf` from byte `offset` of extent `key`, for every (key, buf, offset)
        of `parts`, as ONE engine request (IOEngine.pread_many): one handle, every chunk checked as
        pread checks it. The extents must be in one swap file (every extent of one allocate() call
        is); ValueError naming the files otherwise."""
        f, segments = self._segments(parts)
        return self.engine.pread_many(f, segments)

    def pwrite_many(self, parts: Sequence[Tuple[str, Any, int]], *, background: bool = False) -> IOHandle:
        """Start storing each `buf` at byte `offset` of extent `key` as ONE engine request (see
        pread_many). A read or write of the same bytes must not start before this one is done.
        `background`: in the engine's background lane (IOEngine's [Note: Background requests])."""
        f, segments = self._segments(parts)
        return self.engine.pwrite_many(f, segments, background=background)

    def _segments(self, parts: Sequence[Tuple[str, Any, int]]) -> "tuple[IOFile, List[Segment]]":
        if not parts:
            raise ValueError("pread_many/pwrite_many need at least one (key, buf, offset) part")
        self._check_open()
        segments = []
        files = []
        for key, buf, offset in parts:
            f, file_offset, size = self._place(key, buf, offset, None)
            if files and f is not files[0]:
                raise ValueError(
                    f"extents {parts[0][0]!r} and {key!r} are in different swap files ({files[0].path}, "
                    f"{f.path}); one request moves one file: split the parts by Extent.path"
                )
            files.append(f)
            segments.append(Segment(buf, file_offset, size, self._checksums.get(key)))
        return files[0], segments

    def read(self, key: str, buf: Any, offset: int = 0, size: Optional[int] = None) -> int:
        """Blocking read: pread(...).wait()."""
        return self.pread(key, buf, offset, size).wait()

    def write(self, key: str, buf: Any, offset: int = 0, size: Optional[int] = None) -> int:
        """Blocking write: pwrite(...).wait()."""
        return self.pwrite(key, buf, offset, size).wait()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ValueError("this FileStore is closed")

    def close(self) -> None:
        """Close and remove every swap file and the store's directory. Wait for requests first."""
        self._finalizer()

    def __enter__(self) -> "FileStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nbytes(buf: Any) -> int:
    nbytes = getattr(buf, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    return memoryview(buf).nbytes
