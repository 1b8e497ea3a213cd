"""schedule.RecordedOrder: the group order recorded on the first step, replayed after, re-recorded on change.

Pure bookkeeping, driven here by hand with lists of group indices as a step's acquisitions.
Run: pytest tests/offload_trainer/runtime/test_recorded_order.py
"""

from __future__ import annotations

from typing import List, Sequence

from offload_trainer.runtime.residency.recorded_order import RecordedOrder, OrderPhase

FORWARD_BACKWARD = [0, 1, 2, 2, 1, 0]
"""A three-group step: forward, then backward in reverse."""


def run_step(schedule: RecordedOrder, events: Sequence[int]) -> List[bool]:
    """Acquire `events` in order and close the step; what on_acquire said for each."""
    predicted = [schedule.on_acquire(g) for g in events]
    schedule.end_step()
    return predicted


def test_first_step_records_then_replays() -> None:
    schedule = RecordedOrder()
    assert schedule.phase is OrderPhase.RECORD
    assert schedule.num_records == 0 and schedule.trace == []

    predicted = run_step(schedule, FORWARD_BACKWARD)

    assert predicted == [False] * len(FORWARD_BACKWARD), "nothing is predicted while recording"
    assert schedule.phase is OrderPhase.REPLAY
    assert schedule.trace == FORWARD_BACKWARD
    assert schedule.num_records == 1


def test_recording_prefetches_nothing() -> None:
    schedule = RecordedOrder()
    schedule.on_acquire(0)
    assert schedule.upcoming(4) == []
    assert schedule.next_use_distance(1, horizon=5) == 5


def test_matching_replay_keeps_the_trace() -> None:
    schedule = RecordedOrder()
    run_step(schedule, FORWARD_BACKWARD)
    recorded = schedule.trace

    for _ in range(3):
        assert run_step(schedule, FORWARD_BACKWARD) == [True] * len(FORWARD_BACKWARD)
        assert schedule.phase is OrderPhase.REPLAY
        assert schedule.trace == FORWARD_BACKWARD
        assert schedule.num_records == 1
    assert schedule.trace is recorded, "a followed trace is kept, not replaced by an equal copy"


def test_upcoming_walks_the_trace_during_replay() -> None:
    schedule = RecordedOrder()
    run_step(schedule, FORWARD_BACKWARD)
    assert schedule.upcoming(2) == [0, 1]
    schedule.on_acquire(0)
    schedule.on_acquire(1)
    assert schedule.upcoming(3) == [2, 2, 1]
    assert schedule.upcoming(100) == [2, 2, 1, 0]
    assert schedule.upcoming(0) == []


def test_divergence_invalidates_the_step_and_records_it() -> None:
    schedule = RecordedOrder()
    run_step(schedule, FORWARD_BACKWARD)

    assert schedule.on_acquire(0) is True
    assert schedule.on_acquire(2) is False  # the trace says 1
    assert schedule.phase is OrderPhase.INVALID
    assert schedule.upcoming(4) == []
    assert schedule.next_use_distance(1, horizon=4) == 4
    # Once invalid, even an event the trace would have predicted is not trusted.
    assert schedule.on_acquire(1) is False
    assert schedule.phase is OrderPhase.INVALID
    for g in (1, 2, 0):
        schedule.on_acquire(g)
    schedule.end_step()

    assert schedule.trace == [0, 2, 1, 1, 2, 0]
    assert schedule.num_records == 2
    assert schedule.phase is OrderPhase.REPLAY
    assert run_step(schedule, [0, 2, 1, 1, 2, 0]) == [True] * 6
    assert schedule.num_records == 2


def test_a_new_group_in_the_step_diverges() -> None:
    schedule = RecordedOrder()
    run_step(schedule, [0, 1, 1, 0])
    assert run_step(schedule, [0, 3, 1, 1, 3, 0])[:2] == [True, False]
    assert schedule.trace == [0, 3, 1, 1, 3, 0]
    assert schedule.num_records == 2


def test_a_shorter_step_is_re_recorded() -> None:
    schedule = RecordedOrder()
    run_step(schedule, FORWARD_BACKWARD)

    predicted = run_step(schedule, FORWARD_BACKWARD[:3])

    assert predicted == [True, True, True], "the prefix matched, so nothing diverged while it ran"
    assert schedule.trace == FORWARD_BACKWARD[:3]
    assert schedule.num_records == 2
    assert schedule.phase is OrderPhase.REPLAY


def test_a_longer_step_diverges_past_the_end_of_the_trace() -> None:
    schedule = RecordedOrder()
    run_step(schedule, [0, 1])
    predicted = run_step(schedule, [0, 1, 0, 1])
    assert predicted == [True, True, False, False]
    assert schedule.trace == [0, 1, 0, 1]
    assert schedule.num_records == 2


def test_next_use_distance() -> None:
    schedule = RecordedOrder()
    run_step(schedule, [0, 1, 2, 1, 0])
    schedule.on_acquire(0)  # upcoming: 1, 2, 1, 0

    assert schedule.next_use_distance(1, horizon=10) == 0
    assert schedule.next_use_distance(2, horizon=10) == 1
    assert schedule.next_use_distance(0, horizon=10) == 3
    assert schedule.next_use_distance(7, horizon=10) == 10, "never used again: the horizon"
    assert schedule.next_use_distance(0, horizon=3) == 3, "beyond the horizon counts as the horizon"
    assert schedule.next_use_distance(0, horizon=4) == 3


def test_first_use_order() -> None:
    schedule = RecordedOrder()
    assert schedule.first_use_order() == []
    run_step(schedule, [3, 0, 3, 2, 0, 1, 2])
    assert schedule.first_use_order() == [3, 0, 2, 1]


def test_state_dict_round_trip() -> None:
    schedule = RecordedOrder()
    run_step(schedule, FORWARD_BACKWARD)
    run_step(schedule, [0, 2, 2, 0])
    state = schedule.state_dict()
    assert state == {"trace": [0, 2, 2, 0], "num_records": 2}

    state["trace"].append(9)  # the state dict is a copy
    assert schedule.trace == [0, 2, 2, 0]
    state["trace"].pop()

    restored = RecordedOrder()
    restored.load_state_dict(state)
    assert restored.phase is OrderPhase.REPLAY
    assert restored.trace == [0, 2, 2, 0] and restored.num_records == 2
    assert restored.upcoming(2) == [0, 2]
    assert run_step(restored, [0, 2, 2, 0]) == [True] * 4
    assert restored.num_records == 2
    state["trace"].append(9)
    assert restored.trace == [0, 2, 2, 0], "loading copies the trace"


def test_loading_an_empty_trace_records_again() -> None:
    schedule = RecordedOrder()
    schedule.on_acquire(5)  # a step in progress is dropped by the load
    schedule.load_state_dict(RecordedOrder().state_dict())
    assert schedule.phase is OrderPhase.RECORD
    run_step(schedule, [1, 0])
    assert schedule.trace == [1, 0] and schedule.num_records == 1
