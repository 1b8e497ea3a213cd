"""The buffered fallback where a file system refuses O_DIRECT, at open or at the first IO.

O_DIRECT works on the file systems of this machine (ext4, and tmpfs on recent kernels), so the
refusal is injected: os.open raises EINVAL for O_DIRECT, or os.preadv/os.pwritev raise EINVAL
on the direct descriptor, as some FUSE and network file systems do.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings

import numpy as np
import pytest

import io_engine.file
import io_engine.transfer
from io_engine import (
    BufferedFallbackWarning,
    DirectIOUnsupportedError,
    DirectMode,
    FileStore,
    TransferError,
    aligned_empty,
)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def refuse_o_direct(monkeypatch: pytest.MonkeyPatch, err: int = errno.EINVAL) -> list:
    """Make os.open fail with `err` whenever O_DIRECT is asked for; return the paths it refused."""
    real_open = os.open
    refused = []

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(err, os.strerror(err), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(io_engine.file.os, "open", fake_open)
    return refused


def refuse_direct_io(monkeypatch: pytest.MonkeyPatch, name: str, direct_fd: int) -> list:
    """Make os.<name> (preadv or pwritev) fail with EINVAL on `direct_fd`; return the refused offsets."""
    real = getattr(os, name)
    refused = []

    def fake(fd, buffers, offset, *flags):
        if fd == direct_fd:
            refused.append(offset)
            raise OSError(errno.EINVAL, "direct IO refused (injected)")
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(io_engine.transfer.os, name, fake)
    return refused


def round_trip(f, random_bytes, path) -> None:
    """Unaligned and aligned writes and reads through `f`, checked against the file's bytes."""
    payload = random_bytes(5 * 8192 + 3, 1)
    assert f.write(payload, 4097) == len(payload)
    src = aligned_empty(8192)
    src.numpy()[:] = payload[:8192]
    assert f.write(src, 65536) == 8192
    on_disk = np.fromfile(path, dtype=np.uint8)
    assert np.array_equal(on_disk[4097 : 4097 + len(payload)], payload)
    assert np.array_equal(on_disk[65536 : 65536 + 8192], payload[:8192])
    out = np.zeros(len(payload) + 1, dtype=np.uint8)[1:]
    assert f.read(out, 4097) == len(payload)
    assert np.array_equal(out, payload)
    out = aligned_empty(8192)
    assert f.read(out, 65536) == 8192
    assert np.array_equal(out.numpy(), payload[:8192])


@pytest.mark.parametrize("err", [errno.EINVAL, errno.EOPNOTSUPP])
def test_auto_falls_back_when_open_refuses_o_direct(tmp_path, make_engine, monkeypatch, random_bytes, err):
    engine = make_engine(direct=DirectMode.AUTO)
    refused = refuse_o_direct(monkeypatch, err)
    path = tmp_path / "f"
    with pytest.warns(BufferedFallbackWarning, match=f"{path} uses buffered IO"):
        f = engine.open(path, create=True)
    assert refused == [str(path)]
    assert not f.uses_direct_io and f.fd_direct is None
    assert "refused O_DIRECT" in f.fallback_reason
    assert engine.buffered_fallback
    assert engine.fallbacks == [(str(path), f.fallback_reason)]
    round_trip(f, random_bytes, path)
    f.close()


def test_on_refuses_to_fall_back(tmp_path, make_engine, monkeypatch):
    engine = make_engine(direct=DirectMode.ON)
    refuse_o_direct(monkeypatch)
    path = tmp_path / "f"
    fds = open_fds()
    with pytest.raises(DirectIOUnsupportedError) as info:
        engine.open(path, create=True)
    assert isinstance(info.value, OSError) and info.value.errno == errno.EINVAL
    assert "direct='auto'" in str(info.value) and str(path) in str(info.value)
    assert open_fds() == fds, "the buffered descriptor was left open"
    assert not engine.buffered_fallback


def test_store_falls_back_too(tmp_path, make_engine, monkeypatch, random_bytes):
    engine = make_engine(direct=DirectMode.AUTO)
    refuse_o_direct(monkeypatch)
    with FileStore(engine, tmp_path) as store:
        with pytest.warns(BufferedFallbackWarning):
            store.allocate({"a": 4097, "b": 8192})
        assert engine.buffered_fallback
        a, b = random_bytes(4097, 1), random_bytes(8192, 2)
        store.write("a", a)
        store.write("b", b)
        out_a, out_b = np.zeros(4097, dtype=np.uint8), aligned_empty(8192)
        store.read("a", out_a)
        store.read("b", out_b)
        assert np.array_equal(out_a, a) and np.array_equal(out_b.numpy(), b)


def test_off_never_asks_for_o_direct(tmp_path, make_engine, monkeypatch, random_bytes):
    engine = make_engine(direct=DirectMode.OFF)
    refused = refuse_o_direct(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = engine.open(tmp_path / "f", create=True)
        round_trip(f, random_bytes, tmp_path / "f")
    assert refused == [] and not f.uses_direct_io and f.fallback_reason is None
    assert not engine.buffered_fallback
    f.close()


@pytest.mark.parametrize("direct", [DirectMode.AUTO, DirectMode.ON])
def test_direct_io_where_the_file_system_allows_it(tmp_path, make_engine, random_bytes, direct):
    engine = make_engine(direct=direct)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = engine.open(tmp_path / "f", create=True)
        round_trip(f, random_bytes, tmp_path / "f")
    assert f.uses_direct_io and f.fallback_reason is None
    assert not engine.buffered_fallback and engine.fallbacks == []
    f.close()


def test_other_open_failures_are_transfer_errors(tmp_path, make_engine, monkeypatch):
    engine = make_engine(direct=DirectMode.AUTO)
    refuse_o_direct(monkeypatch, errno.EACCES)
    path = tmp_path / "f"
    path.write_bytes(b"x")
    fds = open_fds()
    with pytest.raises(TransferError) as info:
        engine.open(path)
    assert info.value.errno == errno.EACCES and str(path) in str(info.value)
    assert open_fds() == fds
    assert not engine.buffered_fallback


@pytest.mark.parametrize("name", ["preadv", "pwritev"])
def test_auto_falls_back_when_direct_io_fails(needs_direct_io, tmp_path, make_engine, monkeypatch, random_bytes, name):
    engine = make_engine(direct=DirectMode.AUTO)
    path = tmp_path / "f"
    fds = open_fds()
    f = engine.open(path, create=True)
    assert f.uses_direct_io
    refused = refuse_direct_io(monkeypatch, name, f.fd_direct)
    with pytest.warns(BufferedFallbackWarning, match="direct IO failed with EINVAL"):
        round_trip(f, random_bytes, path)
    assert refused, "the injected refusal was never hit"
    assert not f.uses_direct_io
    assert engine.buffered_fallback and engine.fallbacks[0][0] == str(path)
    round_trip(f, random_bytes, path)  # and goes on working, buffered
    f.close()
    assert open_fds() == fds, "a descriptor of the file outlived close()"


def test_on_reports_failing_direct_io(tmp_path, make_engine, monkeypatch):
    engine = make_engine(direct=DirectMode.ON)
    path = tmp_path / "f"
    path.write_bytes(b"y" * 8192)
    with engine.open(path) as f:
        refuse_direct_io(monkeypatch, "preadv", f.fd_direct)
        with pytest.raises(TransferError) as info:
            f.read(aligned_empty(8192))
        assert info.value.errno == errno.EINVAL and str(path) in str(info.value)
        assert f.uses_direct_io and not engine.buffered_fallback


def test_fallback_while_another_worker_is_using_the_direct_descriptor(needs_direct_io, tmp_path, make_engine, monkeypatch, random_bytes):
    """Two workers read the direct descriptor; the first is refused and falls back while the other
    is still on its way into its system call, which must then be refused too, not fail with EBADF
    (or, with the descriptor number reused, land in another file)."""
    engine = make_engine(num_threads=2, queue_depth=2, blocks_per_call=1, direct=DirectMode.AUTO)  # a block each
    path = tmp_path / "f"
    payload = random_bytes(2 * 8192, 3)
    path.write_bytes(payload.tobytes())
    f = engine.open(path)
    direct_fd, buffered_fd = f.fd_direct, f.fd_buffered
    real_preadv = os.preadv
    lock = threading.Lock()
    direct_calls = []
    second_worker_in = threading.Event()
    buffered_retry_began = threading.Event()

    def preadv(fd, buffers, offset, *flags):
        if fd == direct_fd:
            with lock:
                first = not direct_calls
                direct_calls.append(offset)
            if first:
                second_worker_in.wait(10)  # refuse only once the other worker holds the descriptor too
                raise OSError(errno.EINVAL, "direct IO refused (injected)")
            second_worker_in.set()
            buffered_retry_began.wait(10)  # the first worker has fallen back and moved on
            os.fstat(fd)  # the system call would fail with EBADF if the descriptor were closed now
            raise OSError(errno.EINVAL, "direct IO refused (injected)")
        if fd == buffered_fd:
            buffered_retry_began.set()
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(io_engine.transfer.os, "preadv", preadv)
    out = aligned_empty(2 * 8192)
    with pytest.warns(BufferedFallbackWarning):
        assert f.read(out) == 2 * 8192
    assert sorted(direct_calls) == [0, 8192]
    assert np.array_equal(out.numpy(), payload)
    assert not f.uses_direct_io
    f.close()


def test_io_file_only_reports_a_refusal(tmp_path, monkeypatch):
    """IOFile records why it has no direct descriptor; warning and recording are the engine's."""
    refuse_o_direct(monkeypatch)
    path = tmp_path / "f"
    fds = open_fds()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = io_engine.file.IOFile(object(), str(path), writable=True, create=True, direct=DirectMode.ON)
    assert f.fd_direct is None and "refused O_DIRECT" in f.fallback_reason
    f.close()
    assert open_fds() == fds


def test_retire_direct_keeps_the_descriptor_open_until_close(needs_direct_io, tmp_path):
    path = tmp_path / "f"
    fds = open_fds()
    f = io_engine.file.IOFile(object(), str(path), writable=True, create=True, direct=DirectMode.AUTO)
    direct_fd = f.fd_direct
    assert direct_fd is not None and f.fallback_reason is None
    assert f.retire_direct("refused at offset 0") is True
    assert f.retire_direct("refused at offset 8192") is False, "only the first refusal retires it"
    assert f.fd_direct is None and f.fallback_reason == "refused at offset 0"
    os.fstat(direct_fd)  # still open: a worker may be on its way into a system call with it
    f.close()
    assert open_fds() == fds
