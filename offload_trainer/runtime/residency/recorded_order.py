"""RecordedOrder: the order in which groups are used, learned on the first step and replayed after.

Every acquisition of a group (forward, backward, recomputation under activation checkpointing)
is one event. While RECORD, events are only written down. At the end of a step the trace is the
prediction for the next one (REPLAY): each event is checked against it, and the scheduler
prefetches the groups the trace says come next. The first event that differs makes the step
INVALID: it fetches on demand from there on and its own events become the new trace. A step
that ends early (fewer micro-batches) is re-recorded too. A wrong prediction costs speed only:
what is used is always what was acquired.
"""

from __future__ import annotations

import enum
from typing import List


class OrderPhase(enum.Enum):
    """What the recorded order does with this step's events."""

    RECORD = "record"
    """No trusted trace yet: write events down; prefetch nothing ahead."""
    REPLAY = "replay"
    """Events so far matched the trace: prefetch what it says comes next."""
    INVALID = "invalid"
    """This step diverged from the trace: fetch on demand and record the step as the new trace."""


class RecordedOrder:
    """The trace of group acquisitions, and where this step is in it."""

    def __init__(self) -> None:
        self.phase = OrderPhase.RECORD
        self.trace: List[int] = []
        self._current: List[int] = []
        self._position = 0
        self.num_records = 0
        """Completed recordings: the first one, and one per divergence after it."""

    def on_acquire(self, group: int) -> bool:
        """Note that `group` is being acquired; True if the trace predicted it."""
        self._current.append(group)
        if self.phase is not OrderPhase.REPLAY:
            return False
        if self._position < len(self.trace) and self.trace[self._position] == group:
            self._position += 1
            return True
        self.phase = OrderPhase.INVALID
        return False

    def upcoming(self, max_events: int) -> List[int]:
        """The next `max_events` acquisitions the trace predicts (empty unless replaying)."""
        if self.phase is not OrderPhase.REPLAY:
            return []
        return self.trace[self._position : self._position + max_events]

    def next_use_distance(self, group: int, horizon: int) -> int:
        """Events until `group` is acquired again per the trace; `horizon` if not within it."""
        ahead = self.upcoming(horizon)
        return ahead.index(group) if group in ahead else horizon

    def used_within(self, group: int, horizon: int) -> bool:
        """Whether the trace acquires `group` again within the next `horizon` events."""
        return self.phase is OrderPhase.REPLAY and group in self.trace[self._position : self._position + horizon]

    def first_use_order(self) -> List[int]:
        """Groups in the order the trace first acquires them (the next forward's order)."""
        return list(dict.fromkeys(self.trace))

    def end_step(self) -> None:
        """Close the step: keep the trace if it was followed to its end, else record this step's.
        Nothing acquired since the step was last closed (engine.step() called again after it raised
        past this point, its norm's read failing): the trace stays. Before, the empty acquisitions
        became the trace, and the next step ran unprefetched and was recorded again."""
        if self.phase is OrderPhase.REPLAY and not self._current:
            return
        followed = self.phase is OrderPhase.REPLAY and self._position == len(self.trace)
        if not followed:
            self.trace = self._current
            self.num_records += 1
        self.phase = OrderPhase.REPLAY
        self._current = []
        self._position = 0

    def forget_position(self) -> None:
        """Where this step is in the trace is not known alike on every rank (an agreement found the ranks
        at different calls): fetch on demand from here and record the rest of the step, as a divergence
        does, on every rank alike."""
        self.phase = OrderPhase.INVALID if self.trace else OrderPhase.RECORD
        self._current = []
        self._position = 0

    def state_dict(self) -> dict:
        return {"trace": list(self.trace), "num_records": self.num_records}

    def load_state_dict(self, state: dict) -> None:
        self.trace = list(state["trace"])
        self.num_records = int(state["num_records"])
        self.phase = OrderPhase.REPLAY if self.trace else OrderPhase.RECORD
        self._current = []
        self._position = 0
