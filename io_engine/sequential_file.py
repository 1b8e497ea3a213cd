"""A new file written front to back by one thread, every failure an IO error with path, offset and size.

    with SequentialFile(open_exclusive(path), path) as f:   # takes the descriptor
        f.write(header)                                    # buffered up to buffer_bytes, then written whole
        f.write(memoryview(array))
        f.fsync()                                          # the rest written, then made durable

Python's own file objects say "[Errno 28] No space left on device" and nothing else: not which
write of which file, nor where in it. A checkpoint or an export that filled its disk ended with a
line naming the checkpoint's directory only. Here os.write is looped until each piece is written
(a short write is continued; a write that moves nothing is a ShortTransferError) and an OSError of
the write or of fsync becomes a TransferError naming the path given (the file the user knows, not
necessarily the temporary name it is written under), the piece's offset in the file and its size.
Small writes are gathered into one piece of up to buffer_bytes; larger ones go as they are.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Optional

from .errors import ShortTransferError, TransferError

BUFFER_BYTES = 1 << 16
"""Writes smaller than this are gathered into one system call."""


class SequentialFile:
    """A write-only file descriptor written front to back (see the module's docstring); owns `fd`."""

    def __init__(self, fd: int, path: "os.PathLike[str] | str", buffer_bytes: int = BUFFER_BYTES) -> None:
        self._fd: Optional[int] = fd
        self.path = os.fspath(path)
        """The name failures give (the target of a temporary, where one is written)."""
        self._written_bytes = 0
        """Bytes already in the file (the offset of the next piece)."""
        self._pending = bytearray()
        self._buffer_bytes = buffer_bytes

    def fileno(self) -> int:
        assert self._fd is not None, "the file is closed"
        return self._fd

    def tell(self) -> int:
        """Bytes written so far, gathered ones included."""
        return self._written_bytes + len(self._pending)

    def write(self, data: Any) -> int:
        """Append all of `data` (bytes or any C-contiguous buffer); returns its size."""
        view = memoryview(data).cast("B")
        size = len(view)
        if len(self._pending) + size <= self._buffer_bytes:
            self._pending += view
            return size
        self.flush()
        if size < self._buffer_bytes:
            self._pending += view
        else:
            self._write_all(view)
        return size

    def flush(self) -> None:
        """Write what is gathered."""
        if self._pending:
            self._write_all(memoryview(self._pending))
            self._pending = bytearray()

    def fsync(self) -> None:
        """Write what is gathered, then make the file durable."""
        self.flush()
        try:
            os.fsync(self.fileno())
        except OSError as exc:
            raise TransferError("fsync", self.path, 0, self._written_bytes, exc.errno or errno.EIO) from exc

    def close(self) -> None:
        """Close the descriptor (what is gathered and not flushed is dropped: call fsync() first)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> "SequentialFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_all(self, view: memoryview) -> None:
        offset, size, done = self._written_bytes, len(view), 0
        while done < size:
            try:
                n = os.write(self.fileno(), view[done:])
            except InterruptedError:
                continue
            except OSError as exc:
                raise TransferError("write", self.path, offset, size, exc.errno or errno.EIO) from exc
            if n <= 0:
                raise ShortTransferError("write", self.path, offset, size, done)
            done += n
        self._written_bytes += size


__all__ = ["BUFFER_BYTES", "SequentialFile"]
