"""FileStore: named extents in preallocated swap files, under a private directory removed on close.

    store = FileStore(engine, "/nvme/scratch")
    store.allocate({"layer0.param": 4096 * 1000, "layer0.adam_m": 4096 * 1000})
    store.write("layer0.param", tensor)            # blocking
    h = store.pread("layer0.param", tensor)        # in flight; h.wait()
    store.close()                                   # the swap files are gone

Extents start at multiples of IOConfig.alignment_bytes and never share a disk block, so direct IO
of one extent cannot touch another's bytes. Free space is checked before anything is created,
and the space is reserved with posix_fallocate, so a full disk fails at allocate(), not in the
middle of training.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from .buffers import round_up
from .engine import IOEngine, PathLike
from .errors import NotEnoughSpaceError, TransferError
from .file import IOFile
from .handle import IOHandle

SWAP_DIR_PREFIX = "offload-swap-"


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


@dataclass(frozen=True)
class Extent:
    """Where a key's bytes live: [offset, offset + size_bytes) of the swap file at `path`."""

    key: str
    path: str
    offset: int
    size_bytes: int


def _remove_swap_dir(root: str, files: List[IOFile]) -> None:
    for f in files:
        f.close()
    shutil.rmtree(root, ignore_errors=True)


class FileStore:
    """Named extents of swap files in a new private (0700) directory under `directory`.

    The directory is made if missing. Swap files are created 0600 and removed, with their
    directory, by close() or, failing that, when the store is garbage-collected or Python exits.
    """

    def __init__(self, engine: IOEngine, directory: PathLike) -> None:
        self.engine = engine
        parent = os.fspath(directory)
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise ValueError(f"swap directory {parent!r} exists but is not a directory; name a directory")
        os.makedirs(parent, exist_ok=True)
        self.root = tempfile.mkdtemp(prefix=f"{SWAP_DIR_PREFIX}{os.getpid()}-", dir=parent)
        self._files: List[IOFile] = []
        self._extents: Dict[str, Extent] = {}
        self._file_of: Dict[str, IOFile] = {}
        self._finalizer = weakref.finalize(self, _remove_swap_dir, self.root, self._files)

    @property
    def extents(self) -> Dict[str, Extent]:
        """Every allocated extent by key."""
        return dict(self._extents)

    @property
    def allocated_bytes(self) -> int:
        """Bytes reserved on disk by all swap files, alignment padding included."""
        return sum(f.size() for f in self._files)

    def allocate(self, sizes: Mapping[str, int]) -> List[Extent]:
        """Reserve one extent of `sizes[key]` bytes per key, in one new preallocated swap file.

        Raises NotEnoughSpaceError, before creating anything, if the file system lacks the room;
        ValueError for a key already allocated or a negative size.
        """
        self._check_open()
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
        path = os.path.join(self.root, f"swap-{len(self._files):04d}.bin")
        f = self.engine.open(path, create=True)
        try:
            os.posix_fallocate(f.fd_buffered, 0, total)
        except OSError as exc:
            f.close()
            os.unlink(path)
            if exc.errno == errno.ENOSPC:
                raise NotEnoughSpaceError(self.root, total, free_bytes(self.root)) from exc
            raise TransferError("allocate", path, 0, total, exc.errno or 0) from exc
        self._files.append(f)
        made = []
        for key, offset, size in layout:
            extent = Extent(key, path, offset, size)
            self._extents[key] = extent
            self._file_of[key] = f
            made.append(extent)
        return made

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
        extent = self.extent(key)
        if size is None:
            size = _nbytes(buf)
        if offset < 0 or size < 0 or offset + size > extent.size_bytes:
            raise ValueError(
                f"request of {size} bytes at offset {offset} is outside extent {key!r} of "
                f"{extent.size_bytes} bytes; it would touch another extent's data"
            )
        return self._file_of[key], extent.offset + offset, size

    def pread(self, key: str, buf: Any, offset: int = 0, size: Optional[int] = None) -> IOHandle:
        """Start reading `size` bytes (default all of `buf`) at `offset` within extent `key`."""
        f, file_offset, size = self._locate(key, buf, offset, size)
        return self.engine.pread(f, buf, file_offset, size)

    def pwrite(self, key: str, buf: Any, offset: int = 0, size: Optional[int] = None) -> IOHandle:
        """Start writing `size` bytes (default all of `buf`) at `offset` within extent `key`."""
        f, file_offset, size = self._locate(key, buf, offset, size)
        return self.engine.pwrite(f, buf, file_offset, size)

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
