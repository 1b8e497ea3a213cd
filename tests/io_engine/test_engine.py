"""IOEngine and IOFile: byte-exact round trips, requests in flight, handles, and close().

Every write is checked against the file as plain buffered Python reads it, and every read
against bytes the test put in the file itself, so the engine is never its own reference.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, List

import numpy as np
import pytest
import torch

import io_engine.transfer
from io_engine import DirectMode, IOConfig, IOEngine, IOHandle, Segment, TransferError, aligned_empty

MiB = 1 << 20
SIZES = [1, 4095, 4096, 4097, MiB + 1]
OFFSETS = [0, 3 * 4096, 4097]  # start of the file, aligned, unaligned
MODES = [DirectMode.ON, DirectMode.AUTO, DirectMode.OFF]


def background(nbytes: int) -> np.ndarray:
    """What a file holds before the test writes into it: cheap, and unlike random payloads."""
    return (np.arange(nbytes) % 251).astype(np.uint8)


def file_bytes(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint8)


@pytest.fixture
def io_threads() -> Callable[[], List[threading.Thread]]:
    """io_threads() -> the io_engine worker threads started since the test began."""
    before = set(threading.enumerate())
    return lambda: [t for t in threading.enumerate() if t.name.startswith("io_engine-") and t not in before]


def wait_until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.001)


def check_round_trip(engine: IOEngine, path: Path, make_buffer, kind: str, offset: int, payload: np.ndarray) -> None:
    """Write `payload` at `offset` of a file of background bytes, then read it back.

    Above 4 MiB the bytes to be overwritten are left a hole: prefilling them would only make the
    direct write wait for the page cache to write them back first.
    """
    nbytes = len(payload)
    guard_bytes = 8192
    expected = background(offset + nbytes + guard_bytes)
    if nbytes > 4 * MiB:
        expected[offset : offset + nbytes] = 0
        with open(path, "wb") as f:
            f.write(expected[:offset].tobytes())
            f.seek(offset + nbytes)
            f.write(expected[offset + nbytes :].tobytes())
    else:
        path.write_bytes(expected.tobytes())
    expected[offset : offset + nbytes] = payload

    src = make_buffer(kind, nbytes)
    src.data[:nbytes] = payload
    with engine.open(path, writable=True) as f:
        assert f.uses_direct_io == (engine.config.direct is not DirectMode.OFF)
        assert f.write(src.obj, offset, src.size) == nbytes
        assert np.array_equal(file_bytes(path), expected), "the file does not hold what was written"

        dst = make_buffer(kind, nbytes)
        dst.data[:] = 0x5A
        assert f.read(dst.obj, offset, dst.size) == nbytes
        assert np.array_equal(dst.data[:nbytes], payload), "read back differs from what was written"
        assert (dst.data[nbytes:] == 0x5A).all(), "the read wrote past `size`"
    path.unlink()  # its dirty pages are dropped, not written back while later tests run


@pytest.mark.parametrize("direct", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip(tmp_path, make_engine, make_buffer, buffer_kind, random_bytes, direct, offset, nbytes):
    engine = make_engine(direct=direct)  # 8 KiB blocks: 1 MiB + 1 is 129 blocks
    check_round_trip(engine, tmp_path / "data.bin", make_buffer, buffer_kind, offset, random_bytes(nbytes, nbytes))


@pytest.mark.parametrize("offset", [0, 4097, MiB - 1])
@pytest.mark.parametrize("kind", ["aligned", "tensor_at_byte_1"])
def test_round_trip_with_default_blocks(needs_direct_io, tmp_path, make_engine, make_buffer, random_bytes, kind, offset):
    engine = make_engine(block_bytes=MiB)
    check_round_trip(engine, tmp_path / "data.bin", make_buffer, kind, offset, random_bytes(3 * MiB + 5, 3))


@pytest.fixture(scope="module")
def payload_64_mib() -> np.ndarray:
    return np.random.default_rng(64).integers(0, 256, 64 * MiB, dtype=np.uint8)


@pytest.mark.parametrize(
    "direct, kind, offset, block_bytes",
    [
        (DirectMode.ON, "aligned", 0, MiB),
        (DirectMode.AUTO, "tensor_at_byte_1", 4097, MiB),
        (DirectMode.OFF, "bytearray", 4097, 64 * 1024),
    ],
    ids=["on-aligned", "auto-unaligned", "off-bytearray-64k-blocks"],
)
def test_round_trip_64_mib(tmp_path, make_engine, make_buffer, payload_64_mib, direct, kind, offset, block_bytes):
    engine = make_engine(num_threads=4, queue_depth=16, block_bytes=block_bytes, direct=direct)
    check_round_trip(engine, tmp_path / "data.bin", make_buffer, kind, offset, payload_64_mib)


def test_default_config_round_trip(tmp_path, random_bytes):
    payload = random_bytes(2 * MiB + 4097, 5)
    with IOEngine() as engine, engine.open(tmp_path / "f", create=True) as f:
        assert f.write(payload) == len(payload)
        out = np.zeros_like(payload)
        assert f.read(out) == len(payload)
    assert np.array_equal(out, payload)
    assert np.array_equal(file_bytes(tmp_path / "f"), payload)


@pytest.mark.parametrize("kind", ["aligned", "tensor_at_byte_1"])
def test_many_requests_in_flight(tmp_path, make_engine, make_buffer, random_bytes, kind):
    """200 writes then 200 reads submitted before any is waited for, through a queue of depth 4."""
    engine = make_engine(num_threads=2, queue_depth=4)
    sizes = [[1, 4095, 4096, 4097, 8191, 12288, 3][i % 7] for i in range(200)]
    starts = np.cumsum([0] + sizes[:-1]).tolist()
    total = sum(sizes)
    payload = random_bytes(total, 200)
    src = make_buffer(kind, total)
    src.data[:] = payload
    with engine.open(tmp_path / "f", create=True) as f:
        writes = [f.pwrite(src.obj[s : s + n], s) for s, n in zip(starts, sizes)]
        assert [h.wait() for h in writes] == sizes
        assert all(h.done() for h in writes)
        assert np.array_equal(file_bytes(tmp_path / "f"), payload)

        dst = make_buffer(kind, total)
        dst.data[:] = 0
        reads = [f.pread(dst.obj[s : s + n], s) for s, n in zip(starts, sizes)]
        assert [h.wait() for h in reads] == sizes
        assert all(h.done() and h.exception() is None for h in reads)
    assert np.array_equal(dst.data, payload)


def test_size_argument_moves_only_that_many_bytes(tmp_path, make_engine):
    engine = make_engine()
    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    with engine.open(path, writable=True) as f:
        assert f.write(b"\xff" * 10, offset=5, size=3) == 3
        out = bytearray(b"\x00" * 10)
        assert f.read(out, offset=4, size=5) == 5
    expected = bytearray(range(100))
    expected[5:8] = b"\xff" * 3
    assert path.read_bytes() == bytes(expected)
    assert out == bytes([4, 255, 255, 255, 8]) + b"\x00" * 5


def test_zero_byte_request_is_done_at_once(tmp_path, make_engine):
    engine = make_engine()
    with engine.open(tmp_path / "f", create=True) as f:
        handle = f.pwrite(bytearray(), 4097)
        assert handle.done()
        assert handle.wait() == 0
        assert f.read(bytearray(), 4097) == 0
        assert f.size() == 0


def test_io_file_size_fsync_and_context(tmp_path, make_engine):
    engine = make_engine()
    with engine.open(tmp_path / "f", create=True) as f:
        assert f.writable
        f.write(bytearray(b"a" * 4097), 1)
        f.fsync()
        assert f.size() == 4098
        assert str(tmp_path / "f") in repr(f)
    assert f.fd_buffered == -1 and f.fd_direct is None
    f.close()  # closing twice is harmless


def spy_on(monkeypatch, name: str) -> List[int]:
    """Record the descriptor of every os.<name> call the workers make."""
    fds: List[int] = []
    real = getattr(os, name)

    def spy(fd, buffers, offset, *flags):
        fds.append(fd)
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(io_engine.transfer.os, name, spy)
    return fds


def test_aligned_requests_use_only_the_direct_descriptor(tmp_path, make_engine, monkeypatch, random_bytes):
    engine = make_engine(direct=DirectMode.ON, blocks_per_call=1)  # one system call per block, counted below
    payload = random_bytes(10 * 4096, 7)
    with engine.open(tmp_path / "f", create=True) as f:
        writes, reads = spy_on(monkeypatch, "pwritev"), spy_on(monkeypatch, "preadv")
        src = aligned_empty(len(payload))
        src.numpy()[:] = payload
        f.write(src, 4096)
        out = torch.empty(len(payload) + 1, dtype=torch.uint8)[1:]  # unaligned: via the bounce buffer
        f.read(out, 4096)
        assert set(writes) == {f.fd_direct} and set(reads) == {f.fd_direct}
        assert len(writes) == 5  # 8 KiB blocks, one system call each
    assert np.array_equal(out.numpy(), payload)


def test_write_at_unaligned_offset_goes_through_the_page_cache(tmp_path, make_engine, monkeypatch):
    engine = make_engine(direct=DirectMode.ON)
    with engine.open(tmp_path / "f", create=True) as f:
        writes = spy_on(monkeypatch, "pwritev")
        f.write(aligned_empty(100), 1)
        assert writes == [f.fd_buffered]


def test_done_and_wait_while_in_flight(tmp_path, make_engine, preadv_gate, random_bytes):
    engine = make_engine()
    payload = random_bytes(10000, 8)
    path = tmp_path / "f"
    path.write_bytes(payload.tobytes())
    f = engine.open(path)
    out = aligned_empty(10000)
    handle = f.pread(out)
    assert preadv_gate.entered.wait(10)
    assert not handle.done()
    assert handle.exception() is None
    assert "pending" in repr(handle)
    with pytest.raises(TimeoutError, match=f"read of 10000 bytes at offset 0 in {path}"):
        handle.wait(timeout=0.01)
    preadv_gate.open()
    assert handle.wait() == 10000
    assert handle.done() and handle.exception() is None
    assert np.array_equal(out.numpy(), payload)
    f.close()


def test_handle_keeps_its_buffer_alive_while_in_flight(tmp_path, make_engine, preadv_gate, random_bytes):
    engine = make_engine()
    payload = random_bytes(5000, 9)
    (tmp_path / "f").write_bytes(payload.tobytes())
    f = engine.open(tmp_path / "f")
    out = np.zeros(5000, dtype=np.uint8)
    alive = weakref.ref(out)
    handle = f.pread(out)
    del out
    assert preadv_gate.entered.wait(10)
    gc.collect()
    assert alive() is not None
    preadv_gate.open()
    assert handle.wait() == 5000
    gc.collect()
    assert alive() is None  # and let go of once done
    f.close()


def test_finished_request_lets_go_of_its_buffer(tmp_path, make_engine):
    """Once wait() returns, nothing in the engine holds the caller's memory any more."""
    engine = make_engine(num_threads=1, queue_depth=1)
    with engine.open(tmp_path / "f", create=True) as f:
        array = bytearray(b"x" * 10000)
        assert f.write(array) == 10000
        array.extend(b"grow")  # BufferError while any view of the bytearray is still held
        assert f.read(array, 0, 10000) == 10000
        array.extend(b"grow")

        freed = np.ones(20000, dtype=np.uint8)
        alive = weakref.ref(freed)
        handle = f.pwrite(freed)
        del freed
        assert handle.wait() == 20000
        gc.collect()
        assert alive() is None


def test_done_callback_runs_once_from_a_worker(tmp_path, make_engine, preadv_gate):
    engine = make_engine()
    (tmp_path / "f").write_bytes(b"z" * 4097)
    f = engine.open(tmp_path / "f")
    calls = []
    called = threading.Event()

    def callback(h: IOHandle) -> None:
        calls.append((h, threading.current_thread().name, h.done()))
        called.set()

    handle = f.pread(bytearray(4097))
    assert preadv_gate.entered.wait(10)
    handle.add_done_callback(callback)
    assert calls == []
    preadv_gate.open()
    assert handle.wait() == 4097
    assert called.wait(10)
    assert len(calls) == 1
    called_with, thread_name, was_done = calls[0]
    assert called_with is handle and was_done
    assert thread_name.startswith("io_engine-")
    f.close()


def test_done_callback_added_after_done_runs_at_once(tmp_path, make_engine):
    engine = make_engine()
    with engine.open(tmp_path / "f", create=True) as f:
        handle = f.pwrite(b"abc")
        handle.wait()
        calls = []
        handle.add_done_callback(lambda h: calls.append((h, threading.current_thread())))
        assert calls == [(handle, threading.current_thread())]


def test_raising_callback_does_not_stop_the_engine(tmp_path, make_engine, preadv_gate, caplog):
    engine = make_engine(num_threads=1, queue_depth=1)  # one worker: losing it would hang every request
    (tmp_path / "f").write_bytes(b"q" * 4096)
    f = engine.open(tmp_path / "f")
    later_callback_ran = threading.Event()

    def boom(_: IOHandle) -> None:
        raise RuntimeError("callback failed")

    handle = f.pread(bytearray(4096))
    assert preadv_gate.entered.wait(10)
    handle.add_done_callback(boom)
    handle.add_done_callback(lambda _: later_callback_ran.set())
    with caplog.at_level(logging.ERROR):
        preadv_gate.open()
        assert handle.wait() == 4096
        assert later_callback_ran.wait(10), "a failing callback kept the next one from running"
        assert f.pread(bytearray(4096)).wait(timeout=10) == 4096, "the worker died with the callback"
    assert any(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in caplog.records)
    f.close()


def test_close_stops_every_worker(make_engine, io_threads):
    engine = make_engine(num_threads=3, queue_depth=3)
    assert len(io_threads()) == 3
    engine.close()
    assert io_threads() == []
    engine.close()  # idempotent
    with IOEngine(IOConfig(num_threads=2, queue_depth=2, block_bytes=8192)):
        assert len(io_threads()) == 2
    assert io_threads() == []


def test_close_finishes_queued_blocks(tmp_path, make_engine, preadv_gate, random_bytes, io_threads):
    engine = make_engine(num_threads=1, queue_depth=8)
    payload = random_bytes(6 * 4096, 10)
    (tmp_path / "f").write_bytes(payload.tobytes())
    f = engine.open(tmp_path / "f")
    out = aligned_empty(6 * 4096)
    handles = [f.pread(out[i * 4096 : (i + 1) * 4096], i * 4096) for i in range(6)]
    assert preadv_gate.entered.wait(10)
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(0.05)
    assert closer.is_alive(), "close() returned while a block was still running"
    preadv_gate.open()
    closer.join(10)
    assert not closer.is_alive()
    assert [h.wait(timeout=0) for h in handles] == [4096] * 6
    assert np.array_equal(out.numpy(), payload)
    assert io_threads() == []
    f.close()


def test_close_with_cancel_fails_queued_blocks(tmp_path, make_engine, preadv_gate, random_bytes, io_threads):
    engine = make_engine(num_threads=1, queue_depth=8)
    payload = random_bytes(6 * 4096, 11)
    path = tmp_path / "f"
    path.write_bytes(payload.tobytes())
    f = engine.open(path)
    out = aligned_empty(6 * 4096)
    running = f.pread(out[:4096], 0)
    assert preadv_gate.entered.wait(10)  # the only worker is busy: the rest stay queued
    queued = [f.pread(out[i * 4096 : (i + 1) * 4096], i * 4096) for i in range(1, 6)]
    closer = threading.Thread(target=engine.close, kwargs={"cancel": True})
    closer.start()
    wait_until(lambda: engine._cancel)  # close() has begun; let the running block finish now
    preadv_gate.open()
    closer.join(10)
    assert not closer.is_alive()
    assert running.wait(timeout=0) == 4096  # a block already running completes
    assert np.array_equal(out.numpy()[:4096], payload[:4096])
    for i, handle in enumerate(queued, start=1):
        assert handle.done()
        with pytest.raises(TransferError) as info:
            handle.wait(timeout=0)
        assert info.value.errno == errno.ECANCELED
        assert f"offset {i * 4096}" in str(info.value) and str(path) in str(info.value)
        assert "cancelled" in str(info.value)
    assert io_threads() == []
    f.close()


def test_requests_after_close_raise_value_error(tmp_path, make_engine):
    engine = make_engine()
    f = engine.open(tmp_path / "f", create=True)
    f.write(b"x" * 10)
    engine.close()
    with pytest.raises(ValueError, match="closed"):
        f.pread(bytearray(10))
    with pytest.raises(ValueError, match="closed"):
        engine.pwrite(f, b"y")
    with pytest.raises(ValueError, match="closed"):
        engine.open(tmp_path / "f")
    f.close()


def test_foreground_blocks_pass_queued_background_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: Background requests]: with one worker held busy, a background write of 4 blocks and
    then a foreground read are queued; the worker takes the read before any of the write's
    blocks, and every byte of both still arrives (close() finishes the background lane too)."""
    order: List[str] = []
    release = threading.Event()
    real = IOEngine._run_block

    def run(self, block, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not order:
            release.wait(10)  # the first block holds the only worker until both are queued
        order.append(("bg" if block.background else "fg") + (" read" if block.is_read else " write"))
        return real(self, block, *args, **kwargs)

    monkeypatch.setattr(IOEngine, "_run_block", run)
    # One block per system call: the write's 4 blocks queue as 4 ([Note: Blocks per call]).
    engine = IOEngine(
        IOConfig(num_threads=1, queue_depth=8, block_bytes=4096, blocks_per_call=1, direct=DirectMode.OFF)
    )
    f = engine.open(tmp_path / "f.bin", writable=True, create=True)
    first = f.pwrite(np.full(4096, 1, dtype=np.uint8), offset=0)  # occupies the worker
    payload = np.arange(4 * 4096, dtype=np.uint32).astype(np.uint8)
    bg = engine.pwrite_many(f, [Segment(payload, 4096)], background=True)
    into = np.zeros(4096, dtype=np.uint8)
    fg = f.pread(into, offset=0)
    release.set()
    assert fg.wait() == 4096 and bool((into == 1).all())
    assert first.wait() == 4096 and bg.wait() == 4 * 4096
    engine.close()
    assert order == ["fg write", "fg read"] + ["bg write"] * 4, order
    assert bytes(file_bytes(tmp_path / "f.bin")[4096 : 5 * 4096]) == payload.tobytes()


def test_close_finishes_the_background_lane(tmp_path: Path) -> None:
    """Blocks queued in the background lane are written before close() returns."""
    engine = IOEngine(IOConfig(num_threads=2, queue_depth=4, block_bytes=4096, direct=DirectMode.OFF))
    f = engine.open(tmp_path / "f.bin", writable=True, create=True)
    payload = (np.arange(16 * 4096) % 241).astype(np.uint8)
    handle = engine.pwrite_many(f, [Segment(payload, 0)], background=True)
    engine.close()
    assert handle.wait() == payload.nbytes
    assert bytes(file_bytes(tmp_path / "f.bin")) == payload.tobytes()


def test_an_engine_dropped_without_close_stops_its_workers(tmp_path, io_threads, random_bytes):
    """An IOEngine nobody closed, once dropped: its workers held it (their loop was its bound
    method), so it was never collected and its threads ran until the process ended, one set per
    engine made. Now an idle worker holds nothing; a request in flight still completes first (its
    file holds the engine), then the workers end."""
    engine = IOEngine(IOConfig(num_threads=2, block_bytes=8192))
    f = engine.open(tmp_path / "f", create=True)
    payload = random_bytes(100_000, 5)
    handle = f.pwrite(payload)
    alive = weakref.ref(engine)
    del engine
    assert handle.wait() == 100_000
    f.close()
    del f
    gc.collect()
    assert alive() is None
    for thread in io_threads():
        thread.join(timeout=10)
    assert not [t.name for t in io_threads() if t.is_alive()]
    assert np.array_equal(file_bytes(tmp_path / "f"), payload)


def test_a_request_reported_done_is_referenced_by_no_worker(tmp_path, random_bytes):
    """When a handle reports its request done, no worker still refers to its memory: a caller may
    reuse the buffer at once, and the engine's slot pool lends a slot again only once nothing but
    it refers to the slot's storage. A worker's loop once kept the last block (and through it a
    view of the caller's buffer) until after reporting it done, so a slot could look busy for a
    moment: under load, a one-slot plan found none free and failed ("needs a device slot")."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        pytest.skip("this torch cannot count a storage's references")
    payload = random_bytes(3 * 8192, 7)
    (tmp_path / "f").write_bytes(payload.tobytes())
    engine = IOEngine(IOConfig(num_threads=1, block_bytes=8192))
    f = engine.open(tmp_path / "f")
    buf = torch.empty(len(payload), dtype=torch.uint8)
    alone = use_count(buf.untyped_storage()._cdata)
    at_done: List[int] = []
    try:
        for _ in range(20):
            handle = f.pread(buf)
            # Called by the worker as the request completes, before it takes its next block.
            handle.add_done_callback(lambda h: at_done.append(use_count(buf.untyped_storage()._cdata)))
            handle.wait()
            wait_until(lambda: len(at_done) == 1)
            assert at_done.pop() == alone, "a worker still held the request's memory when it reported it done"
    finally:
        f.close()
        engine.close()
    assert np.array_equal(buf.numpy(), payload)


def test_close_ends_every_worker_after_a_submit_interrupted_between_queueing_and_counting_a_block(
    tmp_path, make_engine
) -> None:
    """Ctrl-C (or offload-train's SIGTERM, raised the same way) landing in the main thread between a
    block's put into its lane and the count that wakes a worker left one worker a count short of its
    stop: close() joined it forever (offload-train hung on its way out after a SIGTERM, swap files
    kept). The block is served, and close() ends every worker."""
    engine = make_engine(num_threads=2)
    counted = engine._queued

    class InterruptedOnce:
        def __init__(self) -> None:
            self.interrupted = False

        def release(self) -> None:
            if not self.interrupted:
                self.interrupted = True
                raise KeyboardInterrupt  # arrived after the put, before the release
            counted.release()

    buf = np.full(4096, 7, dtype=np.uint8)
    with engine.open(tmp_path / "f", writable=True, create=True) as f:
        engine._queued = InterruptedOnce()
        with pytest.raises(KeyboardInterrupt):
            engine.pwrite(f, buf, 0)
        engine._queued = counted
        closing = threading.Thread(target=engine.close, daemon=True)
        closing.start()
        closing.join(timeout=30)  # a hang guard, not a timing: close returns at once when it works
        assert not closing.is_alive(), "close() waits forever for a worker one count short"
        assert all(not t.is_alive() for t in engine._threads)
