"""Tokens: a counting semaphore whose acquire() and release() are C calls.

    slots = Tokens(4)
    slots.acquire()   # blocks while none is left (a KeyboardInterrupt ends the wait, as for a lock)
    slots.release()

threading.Semaphore is written in Python (a Condition, its lock and notify): each acquire and release
costs several Python calls, and the IOEngine makes two of each for every block it moves, so a few
hundred-KB requests per group and step spent more in them than in their system calls. Here the count
is the number of tokens in a queue.SimpleQueue (C code): acquire takes one (waiting for one), release
puts one back. No timeout and no non-blocking acquire: the engine needs neither.
"""

from __future__ import annotations

import functools
import queue
from typing import Callable


class Tokens:
    """A semaphore starting at `count`; `acquire` and `release` are the queue's own (C) methods."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"count={count} must be >= 0")
        tokens: "queue.SimpleQueue[None]" = queue.SimpleQueue()
        for _ in range(count):
            tokens.put(None)
        self.acquire: Callable[[], None] = tokens.get
        """Take a token, waiting while none is left."""
        self.release: Callable[[], None] = functools.partial(tokens.put, None)
        """Give a token back (or one more), waking one waiter."""
        self._tokens = tokens

    @property
    def count(self) -> int:
        """Tokens left now (a snapshot: other threads may take or give meanwhile)."""
        return self._tokens.qsize()
