"""The failure board's rules, with a store stood in for and the peer's posts written by hand: a rank that
left a call goes on where every peer left at the same point, and refuses (RanksOutOfStepError, naming
the peer) where one went on or closed ([Note: A rank that left a call alone] in collectives.py). The
two-rank behaviour is in test_engine_two_ranks.py."""

from __future__ import annotations

from typing import Dict, List

import pytest

from offload_trainer.errors import RanksOutOfStepError
from offload_trainer.runtime.collectives import Collectives
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.rank_failures import FailureBoard


class DictStore:
    """The three calls of a c10d store the board makes."""

    def __init__(self) -> None:
        self.values: Dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def check(self, keys: List[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


def two_ranks(store: DictStore, rank: int) -> Collectives:
    """A Collectives of rank `rank` of two, over `store`, that issues nothing itself (tests call _issue)."""
    coll = Collectives(StepStats())
    coll.world_size, coll.rank = 2, rank
    coll._board = FailureBoard(store, "test", rank, 2)
    return coll


def test_the_same_error_on_every_rank_keeps_them_in_step() -> None:
    store = DictStore()
    zero, one = two_ranks(store, 0), two_ranks(store, 1)
    for coll in (zero, one):
        coll.num_issued = 5
        coll.left("engine.backward()", ValueError("not a scalar"))
    zero._issue()  # both left after #5: each goes on
    one._issue()
    assert zero.num_issued == one.num_issued == 6


def test_an_error_agreed_at_its_collective_is_not_posted() -> None:
    store = DictStore()
    one = two_ranks(store, 1)
    one.num_issued = 5
    one.failure_agreed()
    one.left("engine.load_safetensors()", OSError("its disk"))
    assert store.values == {}
    one._issue()


def test_a_peer_that_went_on_or_closed_is_named() -> None:
    store = DictStore()
    zero, one = two_ranks(store, 0), two_ranks(store, 1)
    one.num_issued = zero.num_issued = 5
    one.left("engine(...)", ValueError("rank 1's hook"))
    FailureBoard(store, "test", 0, 2).post(6, "waited", "went on to its collective #6 (agreement)")
    with pytest.raises(RanksOutOfStepError, match=r"rank 1: .*left after its collective #5 \(engine\(\.\.\.\) raised "
                       r"ValueError: rank 1's hook\), and rank 0 went on to its collective #6"):
        one._issue()
    with pytest.raises(RanksOutOfStepError):  # and from then on, every collective
        one._issue()


def test_a_peer_that_closed_after_the_same_error_is_named() -> None:
    """Both ranks left at #5, then rank 0 closed its engine: rank 1's next collective would wait for it
    until the process group's timeout (the close posted nothing where it had just posted its error)."""
    store = DictStore()
    zero, one = two_ranks(store, 0), two_ranks(store, 1)
    for coll in (zero, one):
        coll.num_issued = 5
        coll.left("engine.backward()", ValueError("not a scalar"))
    zero.closed()
    closed = r"rank 0 closed its engine after engine.backward\(\) raised ValueError"
    with pytest.raises(RanksOutOfStepError, match=closed):
        one._issue()


def test_a_peer_that_says_nothing_is_given_up_on_after_the_timeout() -> None:
    store = DictStore()
    store.timeout = __import__("datetime").timedelta(seconds=0.1)
    one = two_ranks(store, 1)
    one.num_issued = 5
    one.left("engine(...)", ValueError("rank 1's hook"))
    with pytest.raises(RanksOutOfStepError, match=r"rank\(s\) \[0\] said nothing of where they are"):
        one._issue()
