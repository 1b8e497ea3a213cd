"""IOHandle: the future of one pread/pwrite, completed by the engine's workers block by block."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Generator, List, Optional

from .errors import TransferError

_LOGGER = logging.getLogger(__name__)


class IOHandle:
    """One request in flight. `wait()` returns the bytes moved or raises the request's TransferError.

    A request is split into blocks that complete in any order; the handle is done when all have.
    It keeps the request's buffer alive until then.
    """

    def __init__(self, op: str, path: str, offset: int, size_bytes: int, num_blocks: int, buffer: Any) -> None:
        self.op = op
        self.path = path
        self.offset = offset
        self.size_bytes = size_bytes
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._blocks_left = num_blocks
        self._bytes_done = 0
        self._error: Optional[TransferError] = None
        self._callbacks: List[Callable[["IOHandle"], None]] = []
        self._buffer: Any = buffer
        if num_blocks == 0:
            self._finish()

    def _block_finished(self, nbytes: int, error: Optional[TransferError]) -> None:
        """Called by a worker when one block of this request has finished (or failed)."""
        with self._lock:
            self._bytes_done += nbytes
            if error is not None and self._error is None:
                self._error = error
            self._blocks_left -= 1
            last = self._blocks_left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        self._buffer = None
        self._event.set()
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._run_callback(callback)

    def _run_callback(self, callback: Callable[["IOHandle"], None]) -> None:
        try:
            callback(self)
        except Exception:
            # Logged, not raised: raised in a worker it would end that worker thread (and hang
            # every later request), and keep this handle's other callbacks from running.
            _LOGGER.exception("exception in a done callback of %r", self)

    def done(self) -> bool:
        """True once every block has finished, successfully or not. Never blocks."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> int:
        """Block until the request is done; return the bytes moved, or raise its TransferError.

        Raises TimeoutError if `timeout` seconds pass first (the request goes on).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(
                f"{self.op} of {self.size_bytes} bytes at offset {self.offset} in {self.path} "
                f"not done after {timeout} s"
            )
        if self._error is not None:
            raise self._error
        return self._bytes_done

    def exception(self) -> Optional[TransferError]:
        """The error of a finished request, or None; None too while it runs."""
        return self._error if self._event.is_set() else None

    def add_done_callback(self, callback: Callable[["IOHandle"], None]) -> None:
        """Call `callback(handle)` when done: at once if already done, else from a worker thread.

        An exception raised by the callback is logged (logger "io_engine.handle"), not raised.
        """
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        self._run_callback(callback)

    def __await__(self) -> Generator[Any, None, int]:
        """`await handle` in asyncio code: the event loop is never blocked by the IO."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()

        def settle(_: "IOHandle") -> None:
            try:
                loop.call_soon_threadsafe(self._settle_future, future)
            except RuntimeError:
                pass  # the event loop has closed (say after a wait_for timeout): no one awaits this

        self.add_done_callback(settle)
        return future.__await__()

    def _settle_future(self, future: "asyncio.Future[int]") -> None:
        if future.cancelled():
            return
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._bytes_done)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"IOHandle({self.op} {self.size_bytes} B at {self.offset} in {self.path}, {state})"
