"""CopyWorker: copies made in order on a thread of their own, like one copy engine of a GPU.

    worker = CopyWorker("h2d")
    done = worker.submit(dst, src, after=[...])       # returns at once; dst is written later
    done.wait()

A tensor copy releases the GIL, so the training thread computes while the worker copies. Copies
run one at a time in the order they were submitted; each first waits for its `after` work. The
worker holds the source and the destination until the copy is done, so neither is freed early.
The simulated accelerator adds `delay_s` before each copy and fills the destination with NaN at
submission, so a use that does not wait for the copy reads NaN (see host.py).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from offload_trainer.runtime.device.pending import HostEvent, Pending, wait_all


@dataclass
class _Copy:
    dst: torch.Tensor
    src: torch.Tensor
    after: Sequence[Pending]
    done: HostEvent


class CopyWorker:
    """One thread that makes the copies submitted to it, in order."""

    def __init__(self, name: str, delay_s: float = 0.0, poison: bool = False) -> None:
        """`delay_s`: sleep before each copy; `poison`: fill each destination with NaN when submitted."""
        self.delay_s = delay_s
        self.poison = poison
        self._queue: "queue.SimpleQueue[Optional[_Copy]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"copy-{name}", daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Pending] = ()) -> Pending:
        """Copy `src` into `dst` once `after` is done; returns at once."""
        if self._closed:
            raise ValueError("this copy worker is closed")
        if dst.numel() != src.numel():
            raise ValueError(f"copy of {src.numel()} elements into {dst.numel()}")
        if self.poison and dst.is_floating_point():
            dst.fill_(float("nan"))
        done = HostEvent()
        self._queue.put(_Copy(dst, src, tuple(after), done))
        return done

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            dst, src, after, done = item.dst, item.src, item.after, item.done
            del item
            try:
                wait_all(list(after))
                if self.delay_s:
                    time.sleep(self.delay_s)
                with torch.no_grad():
                    dst.copy_(src.view(dst.shape) if src.shape != dst.shape else src)
            except BaseException as error:  # noqa: B902 - reported to whoever waits for the copy
                del dst, src, after
                done.fail(error)
                continue
            # Let go of both ends before saying so: a device slot is lent again only once nothing
            # but its pool refers to it (groups/buffer_pool.py).
            del dst, src, after
            done.set()

    def close(self) -> None:
        """Finish what was submitted, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
