"""Exceptions and the warnings io_engine raises: each IO failure names the path, offset and size."""

from __future__ import annotations

import errno as errno_codes
import os
from typing import Optional


class TransferError(OSError):
    """A read or write that failed. Carries path, offset, size and errno."""

    def __init__(self, op: str, path: str, offset: int, size_bytes: int, err: int, detail: str = "") -> None:
        reason = detail or os.strerror(err)
        message = f"{op} of {size_bytes} bytes at offset {offset} in {path} failed: {reason} (errno {err})"
        super().__init__(err, message)
        self.op = op
        self.path = path
        self.offset = offset
        self.size_bytes = size_bytes

    def __str__(self) -> str:
        return self.strerror or ""


class ShortTransferError(TransferError):
    """A read that hit end of file (or a write that stopped moving bytes) before its size was done."""

    def __init__(self, op: str, path: str, offset: int, size_bytes: int, done_bytes: int) -> None:
        if op == "read":
            detail = (
                f"only {done_bytes} bytes could be read: the file ends at byte {offset + done_bytes} "
                "(was it truncated or replaced?)"
            )
            err = errno_codes.EIO
        else:
            detail = f"the write stopped after {done_bytes} bytes (is the disk full?)"
            err = errno_codes.ENOSPC
        super().__init__(op, path, offset, size_bytes, err, detail)
        self.done_bytes = done_bytes


class IntegrityError(TransferError):
    """A read whose bytes are not what was written there: a chunk's checksum did not match.

    `offset` and `size_bytes` are the bad chunk's place in the file at `path`; `key` and `label`
    name the FileStore extent it belongs to, `extent_offset` where the chunk starts in it.
    See [Note: Checksums of swap extents] in checksums.py.
    """

    def __init__(
        self,
        path: str,
        offset: int,
        size_bytes: int,
        key: str,
        label: Optional[str],
        extent_offset: int,
        expected_checksum: int,
        actual_checksum: int,
    ) -> None:
        what = f"extent {key!r}" + (f" ({label})" if label else "")
        detail = (
            f"checksum mismatch in {what}, bytes [{extent_offset}, {extent_offset + size_bytes}) of the extent: "
            f"checksum {actual_checksum:#x} read back, {expected_checksum:#x} expected; the swap file was changed "
            "on disk after it was written (a failing disk, or another program writing the file), so the state "
            "it held is lost"
        )
        super().__init__("read", path, offset, size_bytes, errno_codes.EIO, detail)
        self.key = key
        self.label = label
        self.extent_offset = extent_offset
        self.expected_checksum = expected_checksum
        self.actual_checksum = actual_checksum


class LostWriteError(TransferError):
    """A read of extent bytes whose last write failed: they hold neither what was written before nor what
    that write carried (part of it may have reached the disk), so no value read there can be trusted.

    `offset` and `size_bytes` are the first such chunk's place in the file at `path`; `key` and `label`
    name the FileStore extent, `extent_offset` where the chunk starts in it. A whole write of the chunk
    that succeeds makes it readable again. See [Note: Checksums of swap extents] in checksums.py.
    """

    def __init__(self, path: str, offset: int, size_bytes: int, key: str, label: Optional[str], extent_offset: int) -> None:
        what = f"extent {key!r}" + (f" ({label})" if label else "")
        detail = (
            f"the last write of {what}, bytes [{extent_offset}, {extent_offset + size_bytes}) of the extent, failed, so "
            "they hold no known values (not the old ones, nor all of the new); write them again before reading them"
        )
        super().__init__("read", path, offset, size_bytes, errno_codes.EIO, detail)
        self.key = key
        self.label = label
        self.extent_offset = extent_offset


class NotEnoughSpaceError(OSError):
    """The file system cannot hold what was asked; raised before anything is written."""

    def __init__(self, directory: str, needed_bytes: int, free_bytes: int) -> None:
        gib = 1 << 30
        message = (
            f"not enough space in {directory}: the swap files need {needed_bytes} bytes "
            f"({needed_bytes / gib:.2f} GiB) but the file system has {free_bytes} bytes "
            f"({free_bytes / gib:.2f} GiB) free; free {needed_bytes - free_bytes} more bytes "
            "or choose a directory on a larger disk"
        )
        super().__init__(errno_codes.ENOSPC, message)
        self.directory = directory
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes

    def __str__(self) -> str:
        return self.strerror or ""


class DirectIOUnsupportedError(OSError):
    """O_DIRECT was required (DirectMode.ON) but the file system refused it."""


class BufferedFallbackWarning(UserWarning):
    """O_DIRECT was asked for (DirectMode.AUTO) but refused, so this file uses the page cache."""


class SwapReclaimWarning(UserWarning):
    """A swap directory of a dead run could not be inspected or removed; the new run goes on."""
