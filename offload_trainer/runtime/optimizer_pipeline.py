"""OptimizerPipeline: a step's group updates run behind the next forward, each group's state owned here.

    pipeline.submit(prepared, lrs)      # returns at once; the updates run on a worker thread
    fill = pipeline.fill_params(gi, shard, after)  # a load of gi filled by the pass itself, or None
    pipeline.wait_params(gi)            # before a load reads group gi's parameter home
    pipeline.wait_group(gi)             # before anything reads all of group gi's homes
    pipeline.wait_all()                 # before backward, a checkpoint, an export, close

See [Note: Hiding the optimizer step] (docs/design.md). engine.step() computes the global norm on
the training thread (every gradient is final then), hands the updates here in the order the next
forward needs the groups, and returns; the next forward's first acquisition waits for the first
group only, and the scheduler waits for a group's update before it loads that group (prefetch
included), so no load ever reads a home the update has not finished writing; a load waits only
for the parameter's write where that is a request of its own ([Note: The parameter written
first] in optimizer.py), the group's other writes landing behind the forward. The next backward
waits for all of them (it writes the gradient homes and shares the host staging buffers).

A load of a group whose update is queued and not begun takes its parameters from the pass itself
instead ([Note: The next forward's load from the update]).

Once a pass has updated every group and its writes have landed, the same worker starts reading
the states (all but the gradients) of the first `groups_ahead` groups of its order again, for the
next pass: they do not depend on the next step's gradients, and reading them behind the next
forward and backward means the next pass starts its first updates (those the forward after it
waits for) on states already in memory. The reads hold staging buffers until that pass, leaving
`staging_kept` free for the backward in between; a skipped step keeps them (no state changed), a
load of new weights drops them.

Results are bitwise those of running the updates in step(): the same kernels on the same values
in the same order; only when they run moves.

[Note: The next forward's load from the update]
The first group the next forward loads is the one whose update it waits for (on gpt2-124m the
tied embedding, 154 MB, whose gradient is final last). With [Note: The parameter written first]
that wait was the update and the parameter's NVMe write, and the load then read the same bytes
back from NVMe: a write and a read of the whole shard on the forward's path. Now a load of a
group whose update is queued, and not begun by the pass, hands its slot's shard to the pass
instead (fill_params, tried first by every NVMe-homed load into a slot whose last users are done:
the scheduler's fill_from_update; under CUDA step()'s norm has waited for the backward by then):
as the pass stores each chunk it copies the new parameter values from its staging buffer into
the shard (accelerator.h2d, after the slot's last users, as a read's copy would be), before it
issues the chunk's writes, which go on as before, off the forward's path; the staging buffer
goes back to the pool once both its write and its copy have read it. The load's Pending
(ParamFill) is done once the pass has issued the group's last chunk's copy and all are done; the
compute that reads the slot waits for it (compute_waits; under CUDA a stream wait on the
copies' events). Bitwise the same: the copy is of the bytes the write puts in the home (the last
chunk's tail, frozen parameters and padding, included). Any placement whose parameter home is
on NVMe, any accelerator; other homes have no NVMe round trip to save.

Who decides: the pass, once per group, as it begins storing the group's first chunk (_fill_for,
under _cond). A load that asks later gets None, waits for the parameter's write (wait_params)
and reads the home, as before: correct whatever the timing. step()'s prefetch of the next
forward's first groups runs right after submit, so that it is never late the pass is submitted
held and started after that prefetch (submit(held=True), start()); every wait starts a held
pass first, so none can wait for it forever.

A load cancelled (evicted while LOADING) before the pass begins its group withdraws its fill
(Pending.cancel): nothing writes the slot, which is lent again after its last users (the fill's
`after`); once begun, the fill completes and the slot is lent again after its copies. A pass
that fails part-way marks its fills failed: over once the copies it issued are, their wait
raising the pass's failure (once, as wait_params does; held on several ranks, [Note: An update
pass that failed on one rank]). A finished fill lets the engine give the group's grad home back
(scheduler.after_fill), as a load that waited for the update does in before_load.

Counted: the load's wait for the pass to issue the copies is exposed optimizer time
(optimizer_exposed_s; the scheduler's io_wait_s leaves it out); the shard's bytes count in
param_bytes_read and param_bytes_from_update, not in bytes_read. A test delays every NVMe write
and read of the first group's parameter by 300 ms: from step() to the end of the next forward
the training thread waits under a third of it, on the CPU and on the simulated accelerator;
with fills off, at least the delay.

Measured on gpt2-124m (bench_offload's configuration, engine alone, 3 steps after 1, four runs
of the tree before and after in turn, the shared 2-core machine at load 7-12, so wall-clock
waits are noisy): optimizer_exposed_s per timed step median 0.66 s (0.49-1.33) before, 0.43 s
(0.37-0.70) after, per-run median ratios 0.85, 1.01, 0.50, 0.60; NVMe bytes read per step 2451
MiB before, 2141-2243 after (255-309 MiB of loads filled: the embedding and the blocks whose
update had not begun when their load asked); the copies' thread 0.02-0.05 s of CPU a step. What
is left is the embedding's update itself, bound by its NVMe traffic through the staging pool
(docs/design.md, "Not built yet").
"""

from __future__ import annotations

import enum
import queue
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from io_engine import TransferError
from io_engine.thread_join import EndingThread, join_through_interrupts

import torch

from offload_trainer.runtime.device.pending import DONE, Pending, wait_all
from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.optimizer import ParamTarget, PreparedStep, ReadAhead, StreamingOptimizer


class UpdateState(enum.Enum):
    """Where one group's update of the last step stands."""

    DONE = "done"
    """The homes hold the group's latest values (or no update was asked for): anyone may read them."""
    QUEUED = "queued"
    """An update is queued or running on the worker: nothing may read or write the group's homes."""
    PARAM_WRITING = "param writing"
    """Updated; the parameter's own write request is in flight (`_param_writes`), the other
    states' not issued yet: a load waits for the former, any other reader for the group's WRITING."""
    WRITING = "writing"
    """Updated; its NVMe writes are in flight (`_writes`, and `_param_writes` until a load has
    waited for them): a reader waits for them first."""


class _Fill(enum.Enum):
    """Where a ParamFill stands (guarded by its pipeline's _cond)."""

    REGISTERED = "registered"
    """Handed to the pipeline; the pass has not begun the group: a cancelled load withdraws it."""
    BEGUN = "begun"
    """The pass copies the group's chunks into the shard as it computes them."""
    ISSUED = "issued"
    """Every chunk's copy is issued: done once they are."""
    FAILED = "failed"
    """The pass stopped before it issued them all: over once those it issued are; waits raise."""
    WITHDRAWN = "withdrawn"
    """The load was cancelled first: nothing was copied."""


_OVER = (_Fill.ISSUED, _Fill.FAILED, _Fill.WITHDRAWN)


class ParamFill(Pending):
    """A load's parameter shard filled by the update pass from its staging buffers, as it computes
    each chunk ([Note: The next forward's load from the update]): done once the pass has issued
    every chunk's copy and they are done. The pass sees it as a ParamTarget (optimizer.py)."""

    def __init__(self, pipeline: "OptimizerPipeline", gi: int, shard: torch.Tensor, after: Sequence[Pending]) -> None:
        self._pipeline = pipeline
        self.gi = gi
        self.shard = shard
        """The slot's view the copies write (dropped once over: a slot still referenced is not lent again)."""
        self.after = list(after)
        self._copies: List[Pending] = []
        """The chunks' copies (the pass appends while BEGUN; read by others once over)."""
        self._state = _Fill.REGISTERED

    # -- the update pass (ParamTarget) --

    def add(self, copy: Pending) -> None:
        self._copies.append(copy)

    def issued(self) -> None:
        self._pipeline._fill_over(self, _Fill.ISSUED)

    # -- the load (Pending) --

    def _work(self) -> List[Pending]:
        """Once over: what still writes the slot (its copies, which follow `after`; `after` itself)."""
        return [*self._copies, *self.after]

    def done(self) -> bool:
        with self._pipeline._cond:
            if self._state not in _OVER:
                return False
        return all(p.done() for p in self._work())

    def wait_issued(self) -> None:
        self._pipeline._wait_fill(self)

    def wait_read(self) -> None:
        self.wait_issued()
        self._check()

    def wait(self) -> None:
        self.wait_issued()
        self._check()
        wait_all(self._work())

    def parts(self) -> List[Pending]:
        self.wait_issued()
        if self._state is not _Fill.ISSUED:
            return [self]  # its wait() raises the pass's failure, or waits for what it issued
        return [part for copy in self._work() for part in copy.parts()] or [DONE]

    def cancel(self) -> None:
        self._pipeline._withdraw(self)

    def _check(self) -> None:
        if self._state is _Fill.FAILED:
            self._pipeline._fill_failed(self)


class OptimizerPipeline:
    """Runs StreamingOptimizer.update on a worker thread and tells when each group is done."""

    def __init__(
        self,
        optimizer: StreamingOptimizer,
        num_groups: int,
        stats: StepStats,
        groups_ahead: int = 0,
        staging_kept: int = 0,
    ) -> None:
        """`stats`: the engine's running counts, where the training thread's waits are counted.
        `groups_ahead`: how many groups' states a pass reads again for the next one when done
        (prefetch.optimizer_groups_ahead); `staging_kept`: the host staging buffers those reads must
        leave free for the backward before the next pass (Engine._staging_kept_for_gradients)."""
        self.optimizer = optimizer
        self.groups_ahead = groups_ahead
        self.staging_kept = staging_kept
        self.stats = stats
        self._cond = threading.Condition()
        """Guards the fields below; notified when something a waiter waits for changes ([Note: Whom a group's
        update wakes])."""
        self._awaited: Dict[int, int] = {}
        """Group index -> how many threads wait (wait_params, wait_group) for a change of its state: the worker
        wakes waiters at a group's update only when it is awaited."""
        self._state: List[UpdateState] = [UpdateState.DONE] * num_groups
        self._writes: Dict[int, List[Pending]] = {}
        """Per WRITING group: its NVMe writes in flight, but the parameter's own request."""
        self._param_writes: Dict[int, List[Pending]] = {}
        """Per PARAM_WRITING or WRITING group: the parameter home's own write request, where it has
        one, until a load waited for it."""
        self._params_landed: Set[int] = set()
        """Groups (not DONE) whose parameter home holds the new values: a load needs no wait."""
        self._fills: Dict[int, ParamFill] = {}
        """Per QUEUED group the pass has not begun: the load its pass is to fill (fill_params)."""
        self._filling: Optional[ParamFill] = None
        """The fill the pass is copying into (BEGUN), if any."""
        self._begun: Set[int] = set()
        """Groups of the running pass it has begun storing: too late for a fill."""
        self._held_job: Optional[tuple] = None
        """A pass submitted held, until start() (or any wait) hands it to the worker."""
        self._error: Optional[BaseException] = None
        self.failed_pass: Optional[str] = None
        """What ended the last update pass that failed, until a checkpoint's load writes every home
        again (forget_failed_pass): its groups' homes are part that step's and part the step's before
        ([Note: A pass that failed part-way])."""
        self.hold_errors = False
        """On several ranks: a failure of the pass is held for an agreement, not raised at the wait
        that finds it ([Note: An update pass that failed on one rank])."""
        self._held: Optional[BaseException] = None
        """The failure of the last pass that a wait found, while hold_errors, until take_held()."""
        self._running = False
        self._finished: List[StepStats] = []
        """Counts of update passes that have finished, not yet handed to a step's stats (collect())."""
        self._ahead = ReadAhead()
        """States read for the next pass by the last one (set with _running cleared, under _cond)."""
        self._jobs: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        # The updates run here so that the next forward computes meanwhile (the fused kernels and
        # the IO waits release the GIL). The thread holds the pipeline only while it runs a pass:
        # idle, it must not keep it (and through the optimizer's buffers, the engine) alive, or an
        # engine dropped without close() could never be collected ([Note: An engine dropped
        # without close()] in runtime/engine.py).
        self._thread = EndingThread(
            target=OptimizerPipeline._worker_loop, args=(weakref.ref(self), self._jobs),
            name="optimizer-updates", daemon=True,
        )
        self._thread.start()
        # Collected without close(): the thread, idle then, ends.
        self._stop = weakref.finalize(self, self._jobs.put, None)
        self._stop.atexit = False  # at exit the daemon thread just stops
        self._closed = False

    # -- the training thread -------------------------------------------------------------------

    def drop_ahead(self) -> bool:
        """Forget the states read for the next pass (new weights are being loaded, or the training
        thread needs their staging buffers: the pass then reads them itself). After wait_all().
        Returns whether any staging buffer was given back."""
        with self._cond:
            assert not self._running, "drop_ahead while updates are running"
            ahead, self._ahead = self._ahead, ReadAhead()
        had = bool(ahead.loads)
        self.optimizer.drop(ahead)
        return had

    def submit(self, prepared: PreparedStep, lrs: Dict[float, Tuple[float, float]], held: bool = False) -> None:
        """Queue the updates of `prepared` (whose groups are all DONE: wait_all() came first), with
        the states read ahead for them. `held`: the pass starts only at start() or at the first wait,
        so that loads asked for before (fill_params) find every group not begun."""
        with self._cond:
            assert not self._running, "submit while the previous updates are running"
            self._raise_error()
            for group in prepared.groups:
                assert self._state[group.index] is UpdateState.DONE
                self._state[group.index] = UpdateState.QUEUED
            self._running = True
            self._begun = set()
            ahead, self._ahead = self._ahead, ReadAhead()
            job = (prepared, dict(lrs), ahead)
            if held:
                self._held_job = job
                return
        self._jobs.put(job)

    def start(self) -> None:
        """Let a pass submitted held begin (nothing otherwise). Every wait calls it first: a wait
        for a held pass would never end."""
        with self._cond:
            job, self._held_job = self._held_job, None
        if job is not None:
            self._jobs.put(job)

    def fill_params(self, gi: int, shard: torch.Tensor, after: Sequence[Pending]) -> Optional[ParamFill]:
        """A load of group gi into `shard` (this rank's shard in a device slot, the size of the
        parameter home, on NVMe; `after`: the slot's last users), while gi's update is queued and the
        pass has not begun it: the pass copies the new values into the shard itself as it computes
        them, and the load waits for the returned Pending instead of the home's write and read
        ([Note: The next forward's load from the update]). None otherwise: the caller waits with
        wait_params and reads the home."""
        with self._cond:
            if self._state[gi] is not UpdateState.QUEUED or gi in self._begun or gi in self._fills:
                return None
            fill = self._fills[gi] = ParamFill(self, gi, shard, after)
        return fill

    def is_done(self, gi: int) -> bool:
        with self._cond:
            return self._state[gi] is UpdateState.DONE

    def wait_params(self, gi: int) -> None:
        """Block until group gi's parameter home holds its updated values (its other homes may
        still be written); counted as exposed optimizer time. Before a load of the group."""
        with self._cond:
            if self._state[gi] is UpdateState.DONE or gi in self._params_landed:
                return
        self.start()
        start = time.perf_counter()
        with self._cond:
            self._await(gi, lambda: self._state[gi] is UpdateState.QUEUED)
            self._raise_error()
            own = gi in self._param_writes
        if not own:  # the parameter is in the group's one write request
            self._wait_group(gi)
        else:
            self._land(self._param_writes, [gi])
            with self._cond:
                self._params_landed.add(gi)
        self.stats.optimizer_exposed_s += time.perf_counter() - start

    def wait_group(self, gi: int) -> None:
        """Block until every home of group gi holds its updated values (counted as exposed
        optimizer time)."""
        with self._cond:
            if self._state[gi] is UpdateState.DONE:
                return
        self.start()
        start = time.perf_counter()
        self._wait_group(gi)
        self.stats.optimizer_exposed_s += time.perf_counter() - start

    def _wait_group(self, gi: int) -> None:
        with self._cond:
            self._await(gi, lambda: self._state[gi] in (UpdateState.QUEUED, UpdateState.PARAM_WRITING))
            self._raise_error()
        # The worker is done with the group: only this (the training) thread moves it on now.
        self._land(self._param_writes, [gi])
        self._land(self._writes, [gi])
        with self._cond:
            self._state[gi] = UpdateState.DONE
            self._params_landed.discard(gi)

    def _await(self, gi: int, pending: Callable[[], bool]) -> None:
        """Under _cond: wait while `pending()` and no error, as a waiter on group gi's changes.

        [Note: Whom a group's update wakes]
        The worker changes a group's state twice per update (its parameter written, its writes
        issued). Notifying every waiter at each woke the training thread once per change wherever it
        waited (wait_all before a backward, a checkpoint, a benchmark's step; wait_params for one group):
        on the 131-group decoder 262 wake-ups per pass, each taking the GIL back from the worker to
        find it was not what it waited for. Now a group's change wakes only the threads waiting for
        that group (`_awaited`), and wait_all is woken once, by the end of the pass; an error and the
        pass's end wake everyone, as before."""
        if not pending() or self._error is not None:
            return
        self._awaited[gi] = self._awaited.get(gi, 0) + 1
        try:
            while pending() and self._error is None:
                self._cond.wait()
        finally:
            left = self._awaited[gi] - 1
            if left:
                self._awaited[gi] = left
            else:
                del self._awaited[gi]

    def _wait_fill(self, fill: ParamFill) -> None:
        """Block until the pass is over with `fill` (issued every copy, or failed); counted as exposed
        optimizer time: the load waits for the group's update."""
        with self._cond:
            if fill._state in _OVER:
                return
        self.start()
        start = time.perf_counter()
        with self._cond:
            self._await(fill.gi, lambda: fill._state not in _OVER)
            assert fill._state in _OVER, "the pass stopped with a fill not over"
        self.stats.optimizer_exposed_s += time.perf_counter() - start

    def _fill_failed(self, fill: ParamFill) -> None:
        """The wait of a fill the pass did not finish: the pass's failure, raised once (held on several
        ranks, the wait then goes on: [Note: An update pass that failed on one rank]); where it was
        raised already, an error naming the group."""
        with self._cond:
            self._raise_error()
            if self.hold_errors:
                return
        raise RuntimeError(
            f"group {fill.gi}'s parameters were to be filled by the optimizer's update pass, which did not "
            f"finish ({self.failed_pass or 'no pass updated the group'}): its load is dropped"
        )

    def _withdraw(self, fill: ParamFill) -> None:
        """A load cancelled: its fill is dropped if the pass has not begun it."""
        with self._cond:
            if fill._state is _Fill.REGISTERED:
                del self._fills[fill.gi]
                fill._state = _Fill.WITHDRAWN
                fill.shard = None  # type: ignore[assignment]

    def _fill_over(self, fill: ParamFill, state: _Fill) -> None:
        """Under no lock: `fill` is over (ISSUED, or FAILED by a pass that stopped)."""
        with self._cond:
            self._mark_over(fill, state)

    def _mark_over(self, fill: ParamFill, state: _Fill) -> None:
        """Under _cond."""
        fill._state = state
        fill.shard = None  # type: ignore[assignment]
        if self._filling is fill:
            self._filling = None
        if fill.gi in self._awaited:  # [Note: Whom a group's update wakes]
            self._cond.notify_all()

    def wait_all(self) -> None:
        """Block until every update queued has finished and its writes have landed."""
        with self._cond:
            if not self._running and not self._writes and not self._param_writes:
                self._raise_error()
                return
        self.start()
        start = time.perf_counter()
        with self._cond:
            while self._running and self._error is None:
                self._cond.wait()
            self._raise_error()
            param_groups, groups = list(self._param_writes), list(self._writes)
        self._land(self._param_writes, param_groups)
        self._land(self._writes, groups)
        with self._cond:
            self._params_landed = set()
            self._state = [UpdateState.DONE] * len(self._state)
        self.stats.optimizer_exposed_s += time.perf_counter() - start

    def wait_all_dropping_failures(self) -> None:
        """wait_all(), for a caller about to write every home again (load_checkpoint): a write that
        failed (TransferError: the update pass's own, or one listed here) is dropped, not raised, and
        the waits go on until nothing is left. Each such failure was raised once already, at the wait
        that found it; raised again here, it refused the load that replaces what it left."""
        for _ in range(2 + sum(map(len, self._writes.values())) + sum(map(len, self._param_writes.values()))):
            try:
                self.wait_all()
                return
            except TransferError:
                continue  # each round lands at least one failed write, or the pass's own error
        self.wait_all()

    def _land(self, writes: Dict[int, List[Pending]], groups: List[int]) -> None:
        """Wait for the writes listed in `writes` (_writes or _param_writes) under each of `groups`.

        [Note: Writes leave the list once over]
        A write leaves its list only once it is over, failed or not, whatever ended the wait: a
        Ctrl-C landing in it (the likeliest place, the loop waiting there) leaves the writes not
        over listed, so the next wait (the next load of the group, a checkpoint, close) waits for
        them again. Before, they were taken off the list first: after a Ctrl-C caught by the loop
        (a notebook's interrupted cell) the group counted as written, and its next load, or the
        checkpoint saved next, read the NVMe home while the update's write was still in flight,
        and trained on (or saved) the old values, silently. A write that failed raised its error
        here and leaves, as in gradients.py's _finish_write."""
        try:
            for gi in groups:
                for pending in writes.get(gi, ()):
                    try:
                        pending.wait()
                    except Exception as error:  # noqa: B902 - a Ctrl-C is raised, held or not
                        if not self.hold_errors:
                            raise
                        with self._cond:
                            self._hold(error)
        finally:
            with self._cond:
                for gi in groups:
                    left = [pending for pending in writes.get(gi, ()) if not pending.done()]
                    if left:
                        writes[gi] = left
                    else:
                        writes.pop(gi, None)

    def forget_failed_pass(self) -> None:
        """Every home was written again (a checkpoint loaded): no failed pass is left in them.

        [Note: A pass that failed part-way]
        An update pass that fails (a read's EIO, a checksum that does not match, a write found failed
        while the pass went on) stops at a group: the groups before it hold the step's update, it
        and those after it the step before's (a group updated in chunks, part of each), and the
        step's count and learning rate have moved on. Its error is raised once, at the wait that
        finds it; a loop that caught it and went on trained on that mix without a word (a failed
        read's groups simply missed an update). The engine refuses to compute, save or export from
        it (PartialStateError) until load_checkpoint has written every home again."""
        self.failed_pass = None
        self._held = None

    def has_failed(self) -> bool:
        """Whether a failure of the last pass is held for an agreement (hold_errors), or is yet to be
        found by a wait (the worker's, once it stopped): this rank's side of the agreement."""
        with self._cond:
            return self._held is not None or (self._error is not None and self.hold_errors)

    def take_held(self) -> Optional[BaseException]:
        """The failure held for the agreement that found some rank failed (None on a rank that did not
        fail), given once; every rank then marks its pass failed (fail())."""
        with self._cond:
            self._raise_error()
            held, self._held = self._held, None
        return held

    def fail(self, reason: str) -> None:
        """The last pass failed part-way, here or on another rank (`reason`): refused until a load
        writes every home again ([Note: A pass that failed part-way])."""
        if self.failed_pass is None:
            self.failed_pass = reason

    def collect(self) -> List[StepStats]:
        """The counts of the update passes finished since the last call (bytes moved, time taken)."""
        with self._cond:
            done, self._finished = self._finished, []
        return done

    def close(self) -> None:
        """Finish what was queued, then stop the worker. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_all()
            self.drop_ahead()
        finally:
            self._stop()
            join_through_interrupts([self._thread])  # [Note: A close interrupted while a thread runs]
        held = self.take_held()  # no agreement came after it: raised here, as on one rank
        if held is not None:
            raise held

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._running = False
            self._state = [UpdateState.DONE] * len(self._state)
            self._params_landed = set()
            # Its own type, not a RuntimeError around it: a swap write that failed is the TransferError
            # (path, offset, size, errno) that README promises, which offload-train reports in one line.
            error.add_note("raised on the optimizer's update thread (runtime/optimizer_pipeline.py)")
            if self.hold_errors:
                self._hold(error)
                return
            raise error

    def _hold(self, error: BaseException) -> None:
        """Under _cond: keep the first failure for the agreement; the waits go on as if it was over.

        [Note: An update pass that failed on one rank]
        On several ranks each rank runs its own update pass, and the disk of one may fail it. That
        rank raised at the wait that found it (a forward's load of a group the pass had not written,
        the next backward, step), or refused its next call (PartialStateError); its peers meanwhile
        went on to the next collective (the check before an all-gather, a reduce-scatter) and waited
        there for it until the process group's timeout: a hang of many minutes on every other rank,
        then an error that named no cause. Now the failed rank holds its failure instead and goes on
        to its next agreement, which every rank reaches in the same order: the check before each
        all-gather (Collectives.check_same, which carries a rank's failure at no cost), each step's
        global-norm all-reduce (Collectives.all_reduce_sum_agreed, at no cost either), and one before
        each save or export (check_none_failed, one all-gather of one number per rank). There every rank learns of it: the failed one raises its own error, the
        others PartialStateError naming it, and each refuses from then on until a checkpoint's load
        (agreed too: [Note: A load that failed part-way on one rank] in persist/checkpoint.py)
        mends them all. What the failed rank computes between its wait and the agreement is never
        used: its loads of the groups the pass left are gathered only after a check_same, and a
        backward before the next agreement only writes the gradient homes, which the load writes
        again. One rank raises at the wait, as before."""
        if self._held is None:
            self._held = error

    # -- the worker ----------------------------------------------------------------------------

    @staticmethod
    def _worker_loop(pipeline_ref: "weakref.ref[OptimizerPipeline]", jobs: "queue.SimpleQueue[Optional[tuple]]") -> None:
        while True:
            job = jobs.get()
            pipeline = pipeline_ref()
            if job is None or pipeline is None:
                return
            pipeline._work(job)
            del pipeline, job

    def _work(self, job: tuple) -> None:
        """One pass: its updates, then the states read ahead for the next one."""
        prepared, lrs, ahead = job
        counts = StepStats()
        start = time.perf_counter()
        try:
            self.optimizer.update(
                prepared, lrs, counts, self._on_written, ahead, self._on_params_written, self._fill_for
            )
            # Every write of the pass has landed (update() drained them): read the first
            # groups' states again for the next pass, behind the next forward and backward.
            order = [group.index for group in prepared.groups]
            ahead = self.optimizer.read_ahead(order, self.groups_ahead, self.staging_kept, counts)
        except BaseException as error:  # noqa: B902 - raised again on the training thread
            with self._cond:
                self._fail_fills()
                self._error = error
                if not self.hold_errors:  # held: every rank marks it once they agree (fail())
                    self.failed_pass = f"{type(error).__name__}: {error}"
                self._cond.notify_all()
            return
        counts.optimizer_total_s = time.perf_counter() - start
        with self._cond:
            self._fail_fills()  # none is left, unless asked for a group no pass stores (a bug: loud)
            self._finished.append(counts)
            self._ahead = ahead
            self._running = False
            self._cond.notify_all()

    def _fill_for(self, group: ShardGroup) -> Optional[ParamTarget]:
        """The pass is about to store the group's first chunk: the load to fill, if one asked."""
        with self._cond:
            self._begun.add(group.index)
            fill = self._fills.pop(group.index, None)
            if fill is not None:
                fill._state = _Fill.BEGUN
                self._filling = fill
        return fill

    def _fail_fills(self) -> None:
        """Under _cond: the pass stopped; every fill it did not finish is over (what it issued of one)."""
        for fill in [*self._fills.values(), *([self._filling] if self._filling is not None else [])]:
            self._mark_over(fill, _Fill.FAILED)
        self._fills = {}
        self._cond.notify_all()

    def _on_params_written(self, group: ShardGroup, param_writes: List[Pending]) -> None:
        with self._cond:
            self._param_writes[group.index] = param_writes
            self._state[group.index] = UpdateState.PARAM_WRITING
            if group.index in self._awaited:  # [Note: Whom a group's update wakes]
                self._cond.notify_all()

    def _on_written(self, group: ShardGroup, writes: List[Pending]) -> None:
        with self._cond:
            if writes:
                self._writes[group.index] = writes
            if writes or group.index in self._param_writes:
                self._state[group.index] = UpdateState.WRITING
            else:
                self._state[group.index] = UpdateState.DONE
            if group.index in self._awaited:  # [Note: Whom a group's update wakes]
                self._cond.notify_all()


__all__ = ["OptimizerPipeline", "ParamFill", "UpdateState"]
