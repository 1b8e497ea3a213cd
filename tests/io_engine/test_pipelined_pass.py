"""run_pass: a whole file moved block by block, a fixed number of requests in flight.

Every pass here has more blocks than slices, so slices are reused; sizes are odd (a last block
of 1 byte, 4096*10+1 bytes) so the short last block is exercised. Reads are checked by copying
each block out of its slice when its request completes (before run_pass may reuse the slice).
"""

from __future__ import annotations

import errno
import functools
import os
import random
import threading
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import pytest
import torch

import io_engine.transfer
from io_engine import FileStore, IOHandle, TransferError, aligned_empty, run_pass

BLOCK = 8192
"""The slice size, and make_engine's block_bytes."""
SIZES = [1, BLOCK, 4096 * 10 + 1, 3 * BLOCK + 1]


def make_slices(num_slices: int, block_bytes: int = BLOCK) -> List[torch.Tensor]:
    buffer = aligned_empty(num_slices * block_bytes)
    return [buffer[k * block_bytes : (k + 1) * block_bytes] for k in range(num_slices)]


def offsets_of(size_bytes: int, shuffle: bool = False) -> List[int]:
    offsets = list(range(0, size_bytes, BLOCK))
    if shuffle:
        random.Random(0).shuffle(offsets)
    return offsets


class Recorder:
    """Wraps a submit function: records each (offset, nbytes), the most requests in flight at once,
    and for reads copies every block into `out` when it completes."""

    def __init__(self, submit: Callable[[Any, int, int], IOHandle], out: Optional[np.ndarray] = None) -> None:
        self._submit = submit
        self.out = out
        self.calls: List[Tuple[int, int]] = []
        self.handles: List[IOHandle] = []
        self._cond = threading.Condition()
        self._in_flight = 0
        self.max_in_flight = 0

    def __call__(self, buf: torch.Tensor, offset: int, nbytes: int) -> IOHandle:
        with self._cond:
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        self.calls.append((offset, nbytes))
        handle = self._submit(buf, offset, nbytes)
        self.handles.append(handle)
        # Added before run_pass adds its own: runs before the slice can be handed out again.
        handle.add_done_callback(functools.partial(self._done, buf, offset, nbytes))
        return handle

    def _done(self, buf: torch.Tensor, offset: int, nbytes: int, handle: IOHandle) -> None:
        if self.out is not None and handle.exception() is None:
            self.out[offset : offset + nbytes] = buf.numpy()[:nbytes]
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait for every done callback: a handle's wait() returns before its callbacks have run."""
        with self._cond:
            assert self._cond.wait_for(lambda: self._in_flight == 0, timeout=30)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
def test_read_pass(tmp_path, make_engine, random_bytes, size, shuffle):
    data = random_bytes(size, 1)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    engine = make_engine()
    with engine.open(path) as f:
        out = np.zeros(size, dtype=np.uint8)
        recorder = Recorder(f.pread, out)
        seconds = run_pass(recorder, make_slices(3), offsets_of(size, shuffle), size)
        recorder.drain()
    assert seconds > 0
    assert np.array_equal(out, data)
    expected = [(offset, min(BLOCK, size - offset)) for offset in offsets_of(size, shuffle)]
    assert recorder.calls == expected
    assert recorder.max_in_flight <= 3
    assert all(handle.done() for handle in recorder.handles)


@pytest.mark.parametrize("size", SIZES)
def test_write_pass(tmp_path, make_engine, random_bytes, size):
    slices = make_slices(2)
    pattern = random_bytes(BLOCK, 2)
    for s in slices:  # every slice holds the same bytes, whichever block it carries
        s.numpy()[:] = pattern
    engine = make_engine()
    path = tmp_path / "f"
    with engine.open(path, create=True) as f:
        recorder = Recorder(f.pwrite)
        run_pass(recorder, slices, offsets_of(size, shuffle=True), size)
    on_disk = np.fromfile(path, dtype=np.uint8)
    assert len(on_disk) == size, "the last block wrote past size_bytes"
    assert np.array_equal(on_disk, np.resize(pattern, size))
    assert recorder.max_in_flight <= 2


def test_file_store_key(tmp_path, make_engine, random_bytes):
    size = 4096 * 10 + 1
    engine = make_engine()
    with FileStore(engine, tmp_path) as store:
        store.allocate({"x": size})
        data = random_bytes(size, 3)
        store.write("x", data)
        out = np.zeros(size, dtype=np.uint8)
        recorder = Recorder(functools.partial(store.pread, "x"), out)
        run_pass(recorder, make_slices(4), offsets_of(size), size)
        recorder.drain()
    assert np.array_equal(out, data)
    assert recorder.calls[-1] == (4096 * 10, 1)


def test_without_size_every_block_is_a_whole_slice(tmp_path, make_engine, random_bytes):
    data = random_bytes(5 * BLOCK, 4)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    engine = make_engine()
    with engine.open(path) as f:
        out = np.zeros(len(data), dtype=np.uint8)
        recorder = Recorder(f.pread, out)
        run_pass(recorder, make_slices(2), offsets_of(len(data)))
        recorder.drain()
    assert {nbytes for _, nbytes in recorder.calls} == {BLOCK}
    assert np.array_equal(out, data)


@pytest.mark.parametrize("failing_block", [0, 5], ids=["first", "last"])
def test_a_failed_block_raises_its_transfer_error(tmp_path, make_engine, monkeypatch, random_bytes, failing_block):
    """The first block's error surfaces when its slice is reused, the last one's in the final wait;
    either way every other request has finished when run_pass raises."""
    size = 4096 * 10 + 1
    path = tmp_path / "f"
    path.write_bytes(random_bytes(size, 5).tobytes())
    bad_offset = failing_block * BLOCK
    real_preadv = os.preadv

    def failing_preadv(fd, buffers, offset, *flags):
        if bad_offset <= offset < bad_offset + BLOCK:
            raise OSError(errno.EIO, "injected media error")
        return real_preadv(fd, buffers, offset, *flags)

    engine = make_engine()
    with engine.open(path) as f:
        monkeypatch.setattr(io_engine.transfer.os, "preadv", failing_preadv)
        recorder = Recorder(f.pread)
        with pytest.raises(TransferError) as info:
            run_pass(recorder, make_slices(2), offsets_of(size), size)
    assert info.value.errno == errno.EIO and info.value.op == "read"
    assert (info.value.path, info.value.offset) == (str(path), bad_offset)
    assert all(handle.done() for handle in recorder.handles)


def test_an_error_from_submit_waits_for_the_requests_in_flight(tmp_path, make_engine, random_bytes):
    path = tmp_path / "f"
    path.write_bytes(random_bytes(4 * BLOCK, 6).tobytes())
    engine = make_engine()
    with engine.open(path) as f:
        recorder = Recorder(f.pread)
        # No size_bytes, so no check up front: the engine refuses the third block's offset.
        with pytest.raises(ValueError, match="offset=-1"):
            run_pass(recorder, make_slices(2), [0, BLOCK, -1, 2 * BLOCK])
    assert len(recorder.handles) == 2 and all(handle.done() for handle in recorder.handles)


def test_bad_arguments_are_value_errors(tmp_path, make_engine):
    engine = make_engine()
    path = tmp_path / "f"
    path.write_bytes(b"z" * BLOCK)
    with engine.open(path) as f:
        with pytest.raises(ValueError, match="at least one buffer slice"):
            run_pass(f.pread, [], [0], BLOCK)
        with pytest.raises(ValueError, match=r"one non-zero size.*\[4096, 8192\]"):
            run_pass(f.pread, [aligned_empty(BLOCK), aligned_empty(4096)], [0], BLOCK)
        with pytest.raises(ValueError, match=rf"offset {BLOCK} is outside the {BLOCK} bytes"):
            run_pass(f.pread, make_slices(1), [0, BLOCK], BLOCK)
