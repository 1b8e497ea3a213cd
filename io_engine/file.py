"""IOFile: one open file with a direct (O_DIRECT) and a buffered descriptor.

The direct descriptor carries the aligned bulk of every request; the buffered one carries what
O_DIRECT cannot (unaligned offsets or tails of writes), and everything when the file system
refuses O_DIRECT. Linux keeps the two coherent: a direct read first writes back dirty cached
pages of its range, and a direct write drops the cached pages it overwrites.

An IOFile is a passive record: it opens and closes its descriptors and says why it has no
direct one, but it neither warns nor decides what a refusal means. The engine that made it does
(IOConfig.direct, the engine's fallback record, BufferedFallbackWarning), so this file never
imports the engine: requests reach it through the small `Submitter` protocol below.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import TYPE_CHECKING, Any, Optional, Protocol

from .config import DirectMode
from .errors import TransferError

if TYPE_CHECKING:
    from .handle import IOHandle

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class Submitter(Protocol):
    """What an IOFile needs from the engine that opened it: starting its requests."""

    def pread(self, file: "IOFile", buf: Any, offset: int = 0, size: Optional[int] = None) -> "IOHandle": ...

    def pwrite(self, file: "IOFile", buf: Any, offset: int = 0, size: Optional[int] = None) -> "IOHandle": ...


class IOFile:
    """A file opened through an IOEngine. Use engine.open(); close() when done."""

    def __init__(self, engine: Submitter, path: str, writable: bool, create: bool, direct: DirectMode) -> None:
        """Open `path` buffered and, unless `direct` is OFF, with O_DIRECT too.

        A refused O_DIRECT open (EINVAL, EOPNOTSUPP, or no O_DIRECT on this platform) leaves
        fd_direct None and the reason in fallback_reason, for the engine to act on; any other
        failure closes what was opened and raises TransferError naming the path.
        """
        self.engine = engine
        self.path = os.fspath(path)
        self.writable = writable or create
        # Guards the swap of fd_direct against two workers retiring it at once.
        self._fallback_lock = threading.Lock()
        self.fallback_reason: Optional[str] = None
        """Why this file uses buffered IO although O_DIRECT was asked for (None if it does not)."""
        self._retired_fd_direct: Optional[int] = None
        flags = (os.O_RDWR if self.writable else os.O_RDONLY) | getattr(os, "O_CLOEXEC", 0)
        if create:
            flags |= os.O_CREAT
        try:
            self.fd_buffered = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise TransferError("open", self.path, 0, 0, exc.errno or errno.EIO) from exc
        self.fd_direct: Optional[int] = None
        if direct is DirectMode.OFF:
            return
        if not _O_DIRECT:
            self.fallback_reason = "this platform has no O_DIRECT"
            return
        try:
            self.fd_direct = os.open(self.path, (flags & ~os.O_CREAT) | _O_DIRECT)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                os.close(self.fd_buffered)
                raise TransferError("open", self.path, 0, 0, exc.errno or errno.EIO) from exc
            self.fallback_reason = f"the file system refused O_DIRECT: {os.strerror(exc.errno)}"

    @property
    def uses_direct_io(self) -> bool:
        """True while the bulk of this file's IO bypasses the page cache."""
        return self.fd_direct is not None

    def retire_direct(self, reason: str) -> bool:
        """Stop using O_DIRECT for this file (the file system accepted the open but not the IO).

        Returns True if this call retired the direct descriptor, False if it was already gone
        (another worker was refused first): only the first refusal is to be reported.
        """
        with self._fallback_lock:
            if self.fd_direct is None:
                return False
            # Closed by close(), not now: another worker may have read fd_direct just before and
            # be on its way into a system call, which would fail with EBADF, or, were the number
            # reused by then, move bytes of some other file.
            self._retired_fd_direct, self.fd_direct = self.fd_direct, None
            self.fallback_reason = reason
            return True

    def size(self) -> int:
        """The file's current size in bytes."""
        return os.fstat(self.fd_buffered).st_size

    def pread(self, buf: Any, offset: int = 0, size: Optional[int] = None) -> "IOHandle":
        """Start reading into `buf` (a CPU tensor or writable buffer) from `offset`. See IOEngine.pread."""
        return self.engine.pread(self, buf, offset, size)

    def pwrite(self, buf: Any, offset: int = 0, size: Optional[int] = None) -> "IOHandle":
        """Start writing `buf` at `offset`. See IOEngine.pwrite."""
        return self.engine.pwrite(self, buf, offset, size)

    def read(self, buf: Any, offset: int = 0, size: Optional[int] = None) -> int:
        """Read into `buf`, blocking until done; returns the bytes read."""
        return self.pread(buf, offset, size).wait()

    def write(self, buf: Any, offset: int = 0, size: Optional[int] = None) -> int:
        """Write `buf`, blocking until done; returns the bytes written."""
        return self.pwrite(buf, offset, size).wait()

    def fsync(self) -> None:
        """Flush the file's data to the disk (buffered tails included)."""
        os.fsync(self.fd_buffered)

    def drop_cached_pages(self) -> None:
        """Write back and evict the file's cached pages, so that the next read comes from the disk
        (what a benchmark of buffered IO needs; O_DIRECT reads never see the page cache)."""
        self.fsync()
        os.posix_fadvise(self.fd_buffered, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close both descriptors. Requests still in flight on this file must be waited for first."""
        for fd in (self.fd_direct, self._retired_fd_direct, self.fd_buffered):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd_direct = None
        self._retired_fd_direct = None
        self.fd_buffered = -1

    def __enter__(self) -> "IOFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"IOFile({self.path!r}, direct={self.uses_direct_io})"


__all__ = ["IOFile", "Submitter"]
