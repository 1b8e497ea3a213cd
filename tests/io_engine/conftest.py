"""Fixtures shared by the io_engine tests.

- `make_engine`: IOEngines with small blocks (so requests split into many), always closed.
- `buffer_kind` / `make_buffer`: every kind of memory the engine accepts, aligned or not.
- `random_bytes`: reference data, reproducible from a seed.
- `preadv_gate`: holds the workers inside os.preadv until the test lets them go, so tests can
  look at requests in flight without sleeping or timing anything.
- An autouse check that no test leaves an `io_engine-*` worker thread behind.
- `direct_io_refused`: why the temporary directory's file system refuses O_DIRECT (tmpfs before
  Linux 6.6, ramfs), or None. There, a test run with `direct` ON or AUTO as its parameter, or that
  makes an engine with direct=ON, or that asks for `needs_direct_io`, is skipped: it tests direct IO,
  which that machine cannot do (the fallback tests inject the refusal themselves).
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any, Callable, Iterator, List, NamedTuple, Optional

import numpy as np
import pytest
import torch

import io_engine.transfer
from io_engine import DirectMode, IOConfig, IOEngine, aligned_empty

SMALL_ENGINE = {"num_threads": 2, "queue_depth": 8, "block_bytes": 8192}
"""Default settings of make_engine: 8 KiB blocks, so a 1 MiB request is 129 blocks."""

BUFFER_KINDS = ("aligned", "tensor_at_byte_1", "bytearray", "numpy_at_byte_3", "bf16")


def io_engine_threads() -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("io_engine-")]


@pytest.fixture(autouse=True)
def no_worker_left_behind() -> Iterator[None]:
    before = set(io_engine_threads())  # threads of other test directories' engines are not ours to judge
    yield
    left = [t for t in io_engine_threads() if t not in before]
    assert not left, f"worker threads still running after the test: {[t.name for t in left]}"


@pytest.fixture(scope="session")
def direct_io_refused(tmp_path_factory: pytest.TempPathFactory) -> Optional[str]:
    if not getattr(os, "O_DIRECT", 0):
        return "this platform has no O_DIRECT"
    probe = tmp_path_factory.mktemp("o_direct_probe") / "probe"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT))
    except OSError as exc:
        return f"the file system of {probe.parent} refused O_DIRECT ({os.strerror(exc.errno)})"
    return None


@pytest.fixture(autouse=True)
def _skip_direct_io_where_refused(request: pytest.FixtureRequest, direct_io_refused: Optional[str]) -> None:
    callspec = getattr(request.node, "callspec", None)
    if direct_io_refused and callspec is not None and callspec.params.get("direct") in (DirectMode.ON, DirectMode.AUTO):
        pytest.skip(f"tests direct IO: {direct_io_refused}")


@pytest.fixture
def needs_direct_io(direct_io_refused: Optional[str]) -> None:
    if direct_io_refused:
        pytest.skip(f"tests direct IO: {direct_io_refused}")


@pytest.fixture
def make_engine(direct_io_refused: Optional[str]) -> Iterator[Callable[..., IOEngine]]:
    """make_engine(**IOConfig fields) -> IOEngine; SMALL_ENGINE unless overridden; closed after the test."""
    engines: List[IOEngine] = []

    def make(**fields: Any) -> IOEngine:
        if direct_io_refused and fields.get("direct") is DirectMode.ON:
            pytest.skip(f"tests direct IO: {direct_io_refused}")
        engine = IOEngine(IOConfig(**{**SMALL_ENGINE, **fields}))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def random_bytes() -> Callable[[int, int], np.ndarray]:
    def make(nbytes: int, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)

    return make


class SampleBuffer(NamedTuple):
    obj: Any
    """What is passed to pread/pwrite."""
    data: np.ndarray
    """uint8 view sharing obj's memory (for bf16, every byte of the tensor)."""
    size: Optional[int]
    """The size argument to pass: None where obj is exactly nbytes long."""


def make_test_buffer(kind: str, nbytes: int) -> SampleBuffer:
    if kind == "aligned":
        tensor = aligned_empty(nbytes)
        assert tensor.data_ptr() % 4096 == 0
        return SampleBuffer(tensor, tensor.numpy(), None)
    if kind == "tensor_at_byte_1":
        tensor = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
        assert tensor.data_ptr() % 2 == 1
        return SampleBuffer(tensor, tensor.numpy(), None)
    if kind == "bytearray":
        array = bytearray(nbytes)
        return SampleBuffer(array, np.frombuffer(array, dtype=np.uint8), None)
    if kind == "numpy_at_byte_3":
        array = np.empty(nbytes + 3, dtype=np.uint8)[3:]
        assert array.ctypes.data % 4 == 3
        return SampleBuffer(array, array, None)
    if kind == "bf16":
        # An odd byte count does not fill a whole bf16 element: pass size and leave the last byte alone.
        tensor = torch.empty((nbytes + 1) // 2, dtype=torch.bfloat16)
        return SampleBuffer(tensor, tensor.view(torch.uint8).numpy(), None if nbytes % 2 == 0 else nbytes)
    raise ValueError(f"unknown buffer kind {kind!r}")


@pytest.fixture(params=BUFFER_KINDS)
def buffer_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_buffer() -> Callable[[str, int], SampleBuffer]:
    return make_test_buffer


class PreadvGate:
    """Holds every os.preadv call until open() (the test's stand-in for a slow disk)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        """Set once a worker is held inside preadv."""
        self._open = threading.Event()
        self._real_preadv = os.preadv

    def preadv(self, fd: int, buffers: Any, offset: int, *flags: int) -> int:
        self.entered.set()
        if not self._open.wait(timeout=30):
            raise OSError(errno.ETIMEDOUT, "the test never opened the preadv gate")
        return self._real_preadv(fd, buffers, offset, *flags)

    def open(self) -> None:
        self._open.set()


@pytest.fixture
def preadv_gate(monkeypatch: pytest.MonkeyPatch, make_engine: Any) -> Iterator[PreadvGate]:
    # Depends on make_engine so that it is torn down first: the gate opens before engines close.
    gate = PreadvGate()
    monkeypatch.setattr(io_engine.transfer.os, "preadv", gate.preadv)
    yield gate
    gate.open()
