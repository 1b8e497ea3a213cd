"""sequential_file: a file written front to back, every byte there in order, every failure naming
the path, the offset and the size of the write refused."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from io_engine import ShortTransferError, TransferError
from io_engine import sequential_file
from io_engine.atomic_file import open_exclusive
from io_engine.sequential_file import SequentialFile


@pytest.mark.parametrize("sizes", [[1], [4096 * 10 + 1], [3, 70_000, 1, 65_536, 2]], ids=["1", "40961", "mixed"])
def test_every_byte_lands_in_order(tmp_path: Path, sizes: list) -> None:
    pieces = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    with SequentialFile(open_exclusive(tmp_path / "f"), tmp_path / "f", buffer_bytes=1 << 16) as f:
        for piece in pieces:
            assert f.write(piece) == len(piece)
        assert f.tell() == sum(sizes)
        f.fsync()
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)


def test_a_short_write_is_continued_and_a_refused_one_names_path_offset_and_size(tmp_path: Path, monkeypatch) -> None:
    real_write, room = os.write, [5000]

    def write(fd: int, data) -> int:  # a disk that takes 1000 bytes a call, then fills
        if room[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, data[: min(1000, room[0])])
        room[0] -= n
        return n

    named = tmp_path / "model.safetensors"
    with SequentialFile(open_exclusive(tmp_path / "f.tmp-1"), named, buffer_bytes=4096) as f:
        monkeypatch.setattr(sequential_file.os, "write", write)
        f.write(b"a" * 3000)  # gathered
        with pytest.raises(TransferError) as failed:
            f.write(b"b" * 4096)  # flushes the 3000, then goes as it is: 2000 bytes taken, then ENOSPC
    monkeypatch.undo()
    err = failed.value
    assert (err.errno, err.path, err.offset, err.size_bytes) == (errno.ENOSPC, str(named), 3000, 4096)
    assert str(err).startswith(f"write of 4096 bytes at offset 3000 in {named} failed: No space left on device")
    assert (tmp_path / "f.tmp-1").read_bytes() == b"a" * 3000 + b"b" * 2000


def test_a_write_that_moves_nothing_is_a_short_transfer(tmp_path: Path, monkeypatch) -> None:
    with SequentialFile(open_exclusive(tmp_path / "f"), tmp_path / "f", buffer_bytes=1) as f:
        monkeypatch.setattr(sequential_file.os, "write", lambda fd, data: 0)
        with pytest.raises(ShortTransferError, match="the write stopped after 0 bytes"):
            f.write(b"xy")
