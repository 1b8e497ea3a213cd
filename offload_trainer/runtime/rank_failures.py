"""The ranks' failure board: one entry per rank in the process group's store, where a rank posts
that it left an engine call on an error (or closed its engine) at a point its peers did not all
reach with it, so that a peer waiting in a collective learns of it within POLL_S and raises,
naming the rank, instead of waiting for the process group's timeout.

    board = FailureBoard.of_group(group, rank, world_size, serial)   # None: no store to post in
    board.post(num_issued, "left", "engine.forward raised ValueError: ...")
    board.read()                                                       # {rank: Post} of every peer

Posts are rare (a failure, a close), reads happen only where a wait has already lasted POLL_S:
training that does not fail costs nothing here. How the posts are used: [Note: A rank that left
a call alone] in collectives.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch.distributed as dist

POLL_S = 0.2
"""How long a wait for a collective lasts between two looks at the board (a failed peer is seen
within this long); a collective that completes ends the wait at once."""

_DEFAULT_TIMEOUT_S = 1800.0
"""torch's default process group timeout, where the store does not tell its own."""

_TEXT_CHARS = 600
"""A post's text is cut to this many characters (an error's message can be long)."""


@dataclass(frozen=True)
class Post:
    """A rank's latest post."""

    serial: int
    """1, 2, ...: the rank's posts in order (a reader tells a new post from one it has seen by this)."""
    num_issued: int
    """How many of the engine's collectives the rank had issued when it posted."""
    kind: str
    """"left" (an engine call raised on it), "closed" (it closed its engine), "waited" (it found
    another rank's post while waiting in a collective, and raised)."""
    text: str
    """What happened, for the other ranks' messages."""


class FailureBoard:
    """This rank's view of the board of one engine (its `prefix`) in a process group's store."""

    def __init__(self, store: "dist.Store", prefix: str, rank: int, world_size: int) -> None:
        self._store = store
        self._prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self._num_posts = 0

    @staticmethod
    def of_group(
        group: Optional["dist.ProcessGroup"], rank: int, world_size: int, serial: int
    ) -> Optional["FailureBoard"]:
        """The board of the engine numbered `serial` (engines are made in the same order on every
        rank) in `group`'s store (the default group's where None); None where torch does not show
        the store, and the engine then waits as before, until the process group's timeout."""
        try:
            from torch.distributed import distributed_c10d as c10d

            pg = group if group is not None else c10d._get_default_group()
            store = c10d._world.pg_map[pg][1]
        except (AttributeError, KeyError, RuntimeError, IndexError, TypeError, ValueError):
            return None
        return FailureBoard(store, f"offload-trainer/failures/{serial}", rank, world_size)

    def timeout_s(self) -> float:
        """The store's timeout (the process group's, as init_process_group makes the store): how long a
        rank waits for its peers' posts before it gives up on them."""
        try:
            return float(self._store.timeout.total_seconds())
        except (AttributeError, RuntimeError):
            return _DEFAULT_TIMEOUT_S

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    def post(self, num_issued: int, kind: str, text: str) -> None:
        """This rank's post (replacing its previous one). A store that does not answer is not an error
        here: the peers then wait until the process group's timeout, as they did without a board."""
        self._num_posts += 1
        value = f"{self._num_posts}|{num_issued}|{kind}|{text[:_TEXT_CHARS]}"
        try:
            self._store.set(self._key(self.rank), value)
        except RuntimeError:
            pass

    def post_waiting(self, seq: int, kind: str) -> None:
        """This rank has waited POLL_S for its collective number `seq`, of `kind` ("agreement",
        "all-gather", ...): a peer waiting for its own number `seq`, of another kind, knows the ranks'
        calls went apart. A store that does not answer is not an error here."""
        try:
            self._store.set(f"{self._prefix}/wait/{self.rank}", f"{seq}|{kind}")
        except RuntimeError:
            pass

    def read_waiting(self) -> Dict[int, Tuple[int, str]]:
        """Every other rank's last post_waiting: rank -> (seq, kind)."""
        waiting: Dict[int, Tuple[int, str]] = {}
        for rank in range(self.world_size):
            key = f"{self._prefix}/wait/{rank}"
            try:
                if rank == self.rank or not self._store.check([key]):
                    continue
                seq, kind = self._store.get(key).decode("utf-8", "replace").split("|", 1)
            except (RuntimeError, ValueError):
                continue
            waiting[rank] = (int(seq), kind)
        return waiting

    def read(self) -> Dict[int, Post]:
        """Every other rank's latest post (ranks that posted nothing are absent)."""
        posts: Dict[int, Post] = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = self._key(rank)
            try:
                if not self._store.check([key]):
                    continue
                serial, num_issued, kind, text = self._store.get(key).decode("utf-8", "replace").split("|", 3)
            except (RuntimeError, ValueError):
                continue
            posts[rank] = Post(int(serial), int(num_issued), kind, text)
        return posts


__all__ = ["FailureBoard", "Post", "POLL_S"]
