"""`await handle` in asyncio code: results, errors, and an event loop that is never blocked."""

from __future__ import annotations

import asyncio
import errno

import numpy as np
import pytest

import io_engine.transfer
from io_engine import ShortTransferError, TransferError, aligned_empty


def test_await_returns_the_bytes_moved(tmp_path, make_engine, random_bytes):
    engine = make_engine()
    payload = random_bytes(3 * 8192 + 5, 1)
    out = np.zeros(len(payload), dtype=np.uint8)

    async def main():
        with engine.open(tmp_path / "f", create=True) as f:
            written = await f.pwrite(payload, 4097)
            read = await f.pread(out, 4097)
            return written, read

    assert asyncio.run(main()) == (len(payload), len(payload))
    assert np.array_equal(out, payload)


def test_gather_many_handles(tmp_path, make_engine, random_bytes):
    engine = make_engine(queue_depth=4)
    chunks = [random_bytes(4097, i) for i in range(20)]
    out = aligned_empty(20 * 4097)

    async def main():
        with engine.open(tmp_path / "f", create=True) as f:
            written = await asyncio.gather(*(f.pwrite(c, i * 4097) for i, c in enumerate(chunks)))
            read = await asyncio.gather(*(f.pread(out[i * 4097 : (i + 1) * 4097], i * 4097) for i in range(20)))
            return written, read

    assert asyncio.run(main()) == ([4097] * 20, [4097] * 20)
    assert np.array_equal(out.numpy(), np.concatenate(chunks))


def test_await_a_handle_that_is_already_done(tmp_path, make_engine):
    engine = make_engine()
    with engine.open(tmp_path / "f", create=True) as f:
        handle = f.pwrite(b"abc")
        handle.wait()

        async def main():
            return await handle

        assert asyncio.run(main()) == 3


def test_await_raises_the_transfer_error(tmp_path, make_engine):
    engine = make_engine()
    path = tmp_path / "f"
    path.write_bytes(b"x" * 4097)

    async def main():
        with engine.open(path) as f:
            await f.pread(bytearray(8192))

    with pytest.raises(ShortTransferError, match=f"in {path}"):
        asyncio.run(main())


def test_await_raises_an_injected_io_error(tmp_path, make_engine, monkeypatch):
    engine = make_engine()
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)

    def failing_preadv(fd, buffers, offset, *flags):
        raise OSError(errno.EIO, "injected media error")

    monkeypatch.setattr(io_engine.transfer.os, "preadv", failing_preadv)

    async def main():
        with engine.open(path) as f:
            await f.pread(bytearray(8192), 0)

    with pytest.raises(TransferError) as info:
        asyncio.run(main())
    assert info.value.errno == errno.EIO and str(path) in str(info.value)


def test_event_loop_runs_while_a_request_is_in_flight(tmp_path, make_engine, preadv_gate):
    """The read is held until another coroutine opens the gate: a blocked loop would never get there."""
    engine = make_engine()
    path = tmp_path / "f"
    path.write_bytes(b"z" * 4097)
    out = bytearray(4097)

    async def reader(f):
        return await f.pread(out)

    async def opener():
        while not preadv_gate.entered.is_set():
            await asyncio.sleep(0.001)
        preadv_gate.open()

    async def main():
        with engine.open(path) as f:
            got, _ = await asyncio.gather(reader(f), opener())
            return got

    assert asyncio.run(main()) == 4097
    assert out == b"z" * 4097


def test_abandoned_await_does_not_hurt_the_engine(tmp_path, make_engine, preadv_gate, caplog):
    """A wait_for that times out, then a closed loop: the handle still completes later, and the
    worker that completes it survives (one worker, so losing it would hang the next request)."""
    engine = make_engine(num_threads=1, queue_depth=1)
    path = tmp_path / "f"
    path.write_bytes(b"w" * 4096)
    f = engine.open(path)
    out = aligned_empty(4096)
    handle = f.pread(out)

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(handle, timeout=0.01)

    asyncio.run(main())
    assert not handle.done()
    preadv_gate.open()
    assert handle.wait(timeout=10) == 4096
    assert f.pread(bytearray(4096)).wait(timeout=10) == 4096
    assert bytes(out.numpy()) == b"w" * 4096
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    f.close()
