"""Collectives over the data-parallel ranks: all-gather of parameter shards, reduce-scatter of
gradients, all-reduce of norms. World size 1 (no process group) is a no-op path.

    work = coll.start_all_gather(full, shard)     # issued now, runs behind compute
    ...                                            # the current group computes
    work.finish()                                  # the compute from now on sees `full`

gloo on CPU, NCCL on CUDA, with gloo beside it for the small host tensors (carries_host_tensors):
whatever `torch.distributed` was initialised with. All-gathers and reduce-scatters are issued
with `async_op=True` and finished later (gloo runs them on its own threads; NCCL on its stream,
after the collectives' stream of runtime/device/cuda.py). On the CPU a reduce-scatter is an
in-place all-reduce of the bucket, as gloo's reduce-scatter does not run asynchronously. Called
through the non-deprecated API of the torch in use (`all_gather_single`/`reduce_scatter_single`
where they exist, else `all_gather_into_tensor`/`reduce_scatter_tensor`, the only ones torch 2.6 has).

[Note: Collectives in one order]
Every collective is *issued* from the training thread, in an order that is the same on every
rank: acquisitions in the recorded module order (and the one all-gather issued ahead of them, see
[Note: All-gather ahead] in residency/scheduler.py), gradient flushes in autograd's order, then
group order. Nothing is issued from another thread or from prefetch's local decisions alone: a
choice that depends on local facts (a free slot, a finished read) is agreed first (all_true), and
each all-gather is preceded by check_same on its group. Only the waiting (finish) may happen at
different points on different ranks, which pairs nothing. A rank that failed where its peers cannot
see (its update pass) says so at its next check_same, check_none_failed or all_reduce_sum_agreed,
where every rank raises instead of issuing what comes next (failed_here, on_agreed_failure).

[Note: A step that failed on one rank]
engine.step() does local work between the last update pass's wait and the global norm's all-reduce:
it waits for the gradient writes, checks that no parameter was written outside the engine's use of
it, reads the gradient homes the norm needs. Any of it may raise on one rank alone (its disk, a
parameter that rank's loop wrote, a Ctrl-C). That rank raised; its peers went on to the norm's
all-reduce and waited there, until the process group's timeout, or until the failed rank's next
collective met them: a check before an all-gather, whose size differs, aborted the process in gloo
("Received data size doesn't match expected size"). Now the failed rank goes on to the all-reduce
with its error, which carries a flag per rank (of the update pass that failed on it, and of an error
on the way), and every rank raises there, before anything is submitted: the failed one its own
error, the others a RuntimeError naming it. The same all-reduce carries the update pass's failure
that check_none_failed used to carry in an all-gather of its own, one collective per step fewer.

[Note: A rank that left a call alone]
The agreements above carry the failures the engine meets in its own work. An error the engine does
not see coming leaves a call on one rank alone: a forward hook or a module's forward raising on rank
1 only, a bad argument on one rank, a loss that raises there while it runs inside the `with` block.
Rank 1 left; rank 0 went on to its next collective and waited there until the process group's
timeout (30 minutes by default), or rank 1's next call met it with another collective (gloo aborted
the process on the sizes, or worse, paired two unrelated ones). Now every call of the engine that
may communicate runs inside `call()`, and one that raises there posts it on a board in the process
group's store (rank_failures.py: the rank, how many collectives it had issued, the error) unless the
ranks agreed on that error at the collective just before (`failure_agreed`). A rank waiting in a
collective looks at the board every POLL_S (the wait ends at once when the collective completes):
a post from a rank that issued fewer collectives than it has means that rank is not coming, so it
raises RanksOutOfStepError naming the rank, its call and its error, and posts that it did. The rank
that left, at its next collective, first waits for every peer's post: all left at the same point
(the same error on every rank, a bad argument given to all) and the ranks are in step, and it goes
on; any went on past it, or closed its engine, and it raises RanksOutOfStepError too. Either way the
ranks' collectives no longer pair, so from then on the engine refuses every collective on every rank,
with the same error, and a close() does not wait for the ones no peer will issue: the run ends on
every rank within POLL_S of the failure, each naming the rank that failed, and resumes from its last
checkpoint. A close() posts too: a rank still waiting for a peer that closed learns so. Only host
(gloo) waits poll: an NCCL work's wait is the stream's, and the host agreement before each
all-gather is where a rank waits on the host. An error raised outside every engine call (the loss,
computed between the forward and the backward) is posted once it leaves the `with` block
(`__exit__`); a loop that catches it on one rank and goes on with another forward makes no post,
but its collectives go apart from its peers' (its forward's agreement against their backward's
reduce-scatter, which never pair): so a rank that has waited POLL_S for its collective number k
also notes that on the board, with k's kind, and a rank waiting for its own k of another kind
raises RanksOutOfStepError naming the rank (post_waiting; a number the ranks share while in step).
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from offload_trainer.errors import RanksOutOfStepError
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.rank_failures import POLL_S, FailureBoard
from offload_trainer.runtime.trace import Tracer

# The non-deprecated names (torch >= 2.10 warns on the *_tensor ones); torch 2.6 has only those.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def data_parallel_world_size() -> int:
    """Ranks the engine shards over: torch.distributed's world size once initialised, else 1."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def carries_host_tensors(backend: str) -> bool:
    """Whether a process group of `backend` (dist.get_backend's string) runs collectives on CPU
    tensors: NCCL alone does not; "cpu:gloo,cuda:nccl" (a backend per device type) does."""
    if ":" in backend:
        return any(part.split(":")[0].strip() == "cpu" for part in backend.split(","))
    return backend != "nccl"


class CollectiveWork:
    """One all-gather or reduce-scatter in flight; finish() once, before its output is used."""

    def __init__(
        self,
        owner: "Collectives",
        kind: str,
        name: str,
        work: Optional[dist.Work],
        keep: List[torch.Tensor],
        then: Optional[Callable[[], None]] = None,
        host: bool = True,
    ) -> None:
        self._owner = owner
        self._host = host
        self.kind = kind
        """"all-gather" or "reduce-scatter"."""
        self._name = name
        self._work = work
        self._keep = keep
        """Tensors the collective reads or writes that nothing else may hold (a clone of the input)."""
        self._then = then
        self._seq = owner.num_issued
        """Its number among the collectives issued (owner._issue() was its last)."""
        self._issued_s = time.perf_counter()
        self._ready_s = self._issued_s + owner.injected_delay_s
        self._completed_s: Optional[float] = None
        if work is not None:
            try:
                work.get_future().add_done_callback(self._on_complete)
            except RuntimeError:  # a backend whose work cannot report completion: finish() tells
                pass
        self.finished = work is None

    def _on_complete(self, _future: object) -> None:
        self._completed_s = time.perf_counter()

    def done(self) -> bool:
        """True if finish() would not wait (never blocks)."""
        return self.finished or (
            (self._work is None or self._work.is_completed()) and time.perf_counter() >= self._ready_s
        )

    def finish(self) -> None:
        """Wait for the collective (gloo: the host; NCCL: the current stream), then its follow-up.
        The wait is the exposed communication; from issue to completion is its total."""
        if self.finished:
            return
        start = time.perf_counter()
        if self._work is not None:
            try:
                self._owner._wait(self._work, f"{self.kind} {self._name}".rstrip(), self._host, self._seq)
            except RanksOutOfStepError:
                self.finished = True  # abandoned: no peer will issue it ([Note: A rank that left a call alone])
                self._keep = []
                raise
        remaining = self._ready_s - time.perf_counter()
        if remaining > 0:  # the test hook: a slow link completes no earlier than issue + delay
            time.sleep(remaining)
        end = time.perf_counter()
        completed = max(self._completed_s if self._completed_s is not None else end, self._ready_s)
        completed = min(completed, end)
        self.finished = True
        self._keep = []
        if self._then is not None:
            self._then()
        self._owner._account(self.kind, self._name, self._issued_s, completed, end - start)


class Collectives:
    """The data-parallel group this engine shards over."""

    def __init__(
        self, stats: StepStats, group: Optional[dist.ProcessGroup] = None, tracer: Optional[Tracer] = None
    ) -> None:
        self.group = group
        self.stats = stats
        self.tracer = tracer if tracer is not None else Tracer()
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            backend = str(dist.get_backend(group))
            if self.world_size > 1 and not carries_host_tensors(backend):
                raise ValueError(
                    f"the process group's backend is {backend!r}, which carries only CUDA tensors, and the engine "
                    "also reduces host tensors (the ranks' agreements, the gradient norm): initialise it with "
                    "dist.init_process_group('cpu:gloo,cuda:nccl'), NCCL for CUDA tensors and gloo for host ones"
                )
        else:
            self.world_size = 1
            self.rank = 0
        self.num_issued = 0
        """Collectives issued so far: the same number on every rank while the ranks are in step."""
        self._board: Optional[FailureBoard] = None
        if self.world_size > 1:
            global _num_boards
            _num_boards += 1
            self._board = FailureBoard.of_group(group, self.rank, self.world_size, _num_boards)
        self._seen: Dict[int, int] = {}
        """Per peer, the serial of its last post this rank has acted on."""
        self._left: Optional[Tuple[int, str]] = None
        """(num_issued, what and its error) where this rank left a call on an error not yet known to be everyone's."""
        self._out_of_step: Optional[RanksOutOfStepError] = None
        """Set once the ranks' collectives no longer pair: raised by every collective from then on."""
        self._agreed_at = -1
        """num_issued at the last agreement that found a failure (every rank raises from it, in step)."""
        self._disagreed_at = -1
        """num_issued at the last agreement that found the ranks at different points (every rank raised)."""
        self._depth = 0
        self.failed_here: Callable[[], bool] = lambda: False
        """Whether this rank failed in a way its peers must learn of at the next agreement (its update
        pass: [Note: An update pass that failed on one rank] in runtime/optimizer_pipeline.py)."""
        self.on_agreed_failure: Callable[[List[int]], None] = _refuse_failed_ranks
        """Called on every rank, with the ranks that failed, where an agreement found any: it raises."""
        self.injected_delay_s = 0.0
        """Tests only: every all-gather and reduce-scatter completes no earlier than this many
        seconds after it was issued (a slow link), so overlap shows in the counters."""

    @contextlib.contextmanager
    def call(self, what: str) -> Iterator[None]:
        """An engine call that may communicate (`what`, e.g. "engine.forward"): an error leaving it (the
        outermost) is posted for the peers unless they agreed on it ([Note: A rank that left a call alone])."""
        self._depth += 1
        try:
            yield
        except BaseException as error:  # noqa: B902 - raised again
            if self._depth == 1:
                self.left(what, error)
            raise
        finally:
            self._depth -= 1

    def left(self, what: str, error: BaseException) -> None:
        """This rank left `what` on `error`: post it, unless the ranks are in step on it (an agreement
        just found a failure, every rank raises from it) or already out of step."""
        if self._board is None or self._out_of_step is not None or self._agreed_at == self.num_issued:
            return
        if self._left is not None and self._left[0] == self.num_issued:
            return  # posted already (an engine call's error leaving the `with` block)
        self._left = (self.num_issued, f"{what} raised {type(error).__name__}: {error}")
        self._board.post(self.num_issued, "left", self._left[1])

    def failure_agreed(self) -> None:
        """Every rank learnt of a failure at the collective just completed (each raises, or the failed
        ones do and the others go on in step): an error leaving this call is not posted."""
        self._agreed_at = self.num_issued

    def just_disagreed(self) -> bool:
        """Whether the last collective was an agreement that found the ranks at different points (a forward
        of its own on one rank): every rank raised from it, in step, and what each holds resident may differ."""
        return self._disagreed_at == self.num_issued and self._disagreed_at >= 0

    def closed(self) -> None:
        """The engine is closing: a peer still waiting for this rank's collectives learns it."""
        if self._board is None or self._out_of_step is not None:
            return
        why = f" after {self._left[1]}" if self._left is not None and self._left[0] == self.num_issued else ""
        self._board.post(self.num_issued, "closed", "closed its engine" + why)

    def _issue(self) -> None:
        """Before each collective: refused once out of step; after this rank left a call, first
        learn whether every rank left it at the same point ([Note: A rank that left a call alone])."""
        if self._out_of_step is not None:
            raise self._out_of_step
        if self._left is not None:
            self._resolve_left()
        self.num_issued += 1

    def _resolve_left(self) -> None:
        assert self._left is not None and self._board is not None
        at, what = self._left
        deadline = time.monotonic() + self._board.timeout_s()
        while True:
            posts = self._board.read()
            fresh = {r: p for r, p in posts.items() if p.serial > self._seen.get(r, 0)}
            gone = {r: p for r, p in fresh.items() if p.kind != "left" or p.num_issued != at}
            if gone:
                rank, post = min(gone.items())
                self._break(f"this rank left after its collective #{at} ({what}), and rank {rank} {post.text}")
            if len(fresh) == self.world_size - 1:  # every rank left at the same point: in step
                for rank, post in fresh.items():
                    self._seen[rank] = post.serial
                self._left = None
                return
            if time.monotonic() > deadline:
                silent = sorted(set(range(self.world_size)) - {self.rank} - set(fresh))
                self._break(f"this rank left after its collective #{at} ({what}), and rank(s) {silent} said nothing "
                            f"of where they are within the process group's timeout ({self._board.timeout_s():.0f} s)")
            time.sleep(POLL_S / 4)

    def _break(self, why: str, what: str = "") -> None:
        """Out of step from here, on this rank: post it, and raise (now and at every collective)."""
        self._out_of_step = RanksOutOfStepError(
            f"rank {self.rank}: the ranks' collectives no longer pair: {why}. Every rank's engine refuses to "
            "communicate from here, and the process group is out of step too: end the run on every rank and resume "
            "from the last checkpoint"
        )
        if self._board is not None:
            self._board.post(self.num_issued, "waited", f"went on to its collective #{self.num_issued} {what}".rstrip())
        raise self._out_of_step

    def _wait(self, work: dist.Work, what: str, host: bool = True, seq: Optional[int] = None) -> None:
        """work.wait() of collective number `seq` (the last issued where None); on the host, between looks
        at the board every POLL_S: a peer that left a call before this collective, or that waits for
        its own number `seq` of another kind, raises RanksOutOfStepError here instead of a wait for the
        timeout."""
        if self._board is None or not host:
            work.wait()
            return
        seq = self.num_issued if seq is None else seq
        kind = what.split(" ")[0]
        told = False
        while True:
            if self._out_of_step is not None and not work.is_completed():
                raise self._out_of_step
            try:
                work.wait(timeout=datetime.timedelta(seconds=POLL_S))
                return
            except RuntimeError as error:
                if work.is_completed():  # the collective's own error: a peer's connection closed, the timeout
                    try:
                        self._look_at_board(what)  # a peer that posted, then ended its process, is named
                    except RanksOutOfStepError as named:
                        raise named from error
                    raise
            if not told:
                self._board.post_waiting(seq, kind)
                told = True
            self._look_at_board(what)
            for rank, (other_seq, other_kind) in sorted(self._board.read_waiting().items()):
                if other_seq == seq and other_kind != kind:
                    self._break(
                        f"rank {rank} waits in its collective #{seq} ({other_kind}), where this rank's #{seq} is "
                        f"another ({what}): their engine calls went apart (a loop that caught an error on one rank "
                        "and went on with another call, say)",
                        f"({what})",
                    )

    def _look_at_board(self, what: str) -> None:
        for rank, post in sorted(self._board.read().items()) if self._board is not None else []:
            if post.serial > self._seen.get(rank, 0) and post.num_issued < self.num_issued:
                self._seen[rank] = post.serial
                self._break(
                    f"rank {rank} {post.text} after its collective #{post.num_issued}, while this rank waited in "
                    f"its #{self.num_issued} ({what})",
                    f"({what})",
                )

    @contextlib.contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        """A blocking collective: all of its time is exposed; traced on the communication track."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.stats.communication_s += end - start
            self.stats.comm_total_s += end - start
            self.tracer.span("communication", what, start, end)

    def _account(self, kind: str, name: str, issued_s: float, completed_s: float, waited_s: float) -> None:
        total = max(completed_s - issued_s, 0.0)
        self.stats.communication_s += waited_s
        self.stats.comm_total_s += total
        if kind == "all-gather":
            self.stats.all_gather_exposed_s += waited_s
            self.stats.all_gather_total_s += total
        else:
            self.stats.reduce_scatter_exposed_s += waited_s
            self.stats.reduce_scatter_total_s += total
        self.tracer.span("communication", f"{kind} {name}".rstrip(), issued_s, completed_s)

    def start_all_gather(self, full: torch.Tensor, shard: torch.Tensor, name: str = "") -> CollectiveWork:
        """Start filling `full` (world_size shards) from each rank's `shard` (this rank's may alias its
        place in `full`); neither may be touched until the returned work is finished."""
        if self.world_size == 1:
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return CollectiveWork(self, "all-gather", name, None, [])
        self._issue()
        start = time.perf_counter()
        source = shard.clone() if _overlaps(full, shard) else shard
        work = _all_gather(full, source, group=self.group, async_op=True)
        self.stats.communication_s += time.perf_counter() - start
        return CollectiveWork(self, "all-gather", name, work, [source], host=full.device.type == "cpu")

    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """start_all_gather, finished at once."""
        self.start_all_gather(full, shard).finish()

    def start_reduce_scatter_mean(
        self, shard: torch.Tensor, full: torch.Tensor, name: str = "", then: Optional[Callable[[], None]] = None
    ) -> CollectiveWork:
        """Start `shard` = this rank's shard of the mean over ranks of `full`; `then()` runs on
        finish(), once `shard` holds it. Neither tensor may be touched until then."""
        if self.world_size == 1:
            shard.copy_(full)
            work = CollectiveWork(self, "reduce-scatter", name, None, [], None)
            if then is not None:
                then()
            return work
        self._issue()
        start = time.perf_counter()
        if full.device.type == "cpu":
            # gloo's reduce-scatter is not asynchronous (measured: issuing 80 MB blocks for ~0.25 s
            # and the rest waits for wait()); its all-reduce is. So on the CPU the bucket is
            # all-reduced in place (twice the bytes, no extra memory) and this rank's part taken.
            work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            part = full[self.rank * shard.numel() : (self.rank + 1) * shard.numel()]
        else:
            work = _reduce_scatter(shard, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            part = None
        self.stats.communication_s += time.perf_counter() - start

        def mean() -> None:
            if part is not None:
                shard.copy_(part)
            shard.div_(self.world_size)
            if then is not None:
                then()

        return CollectiveWork(self, "reduce-scatter", name, work, [full], mean, host=full.device.type == "cpu")

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        if self.world_size == 1:
            return
        self._issue()
        with self._timed("all-reduce"):
            self._wait(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True), "all-reduce")

    def all_reduce_sum_agreed(self, t: torch.Tensor, error: Optional[BaseException] = None) -> None:
        """all_reduce_sum of `t` (float64, on the host) that is also an agreement, at no extra collective:
        it carries, per rank, whether that rank failed_here() (its update pass) or met `error` on its way
        here. Where any rank did, every rank raises instead of returning: on_agreed_failure(those ranks)
        for a failed update pass, else the rank's own `error`, and on the others a RuntimeError naming
        the ranks ([Note: A step that failed on one rank]). One rank: `error` is raised."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        flags = torch.zeros(2 * self.world_size, dtype=t.dtype)
        flags[self.rank] = 1.0 if self.failed_here() else 0.0
        flags[self.world_size + self.rank] = 1.0 if error is not None else 0.0
        both = torch.cat([t.reshape(-1), flags])
        self.all_reduce_sum(both)
        t.copy_(both[: t.numel()].reshape(t.shape))
        passes = both[t.numel() : t.numel() + self.world_size].tolist()
        raised = both[t.numel() + self.world_size :].tolist()
        failed = [rank for rank, v in enumerate(passes) if v != 0.0]
        if failed or any(v != 0.0 for v in raised):
            self.failure_agreed()
        if failed:
            self.on_agreed_failure(failed)
            raise AssertionError("on_agreed_failure returned")
        failed = [rank for rank, v in enumerate(raised) if v != 0.0]
        if error is not None:
            error.add_note(f"every rank's engine raised at this point (rank(s) {failed} failed)")
            raise error
        if failed:
            raise RuntimeError(
                f"rank(s) {failed} raised in engine.step() before the update (their errors name why), so no rank "
                "updated and the step is not counted on any: fix the cause, then call engine.step() again on every rank"
            )

    def all_true(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on every rank (so local decisions stay identical)."""
        if self.world_size == 1:
            return flag
        return min(self._gather_values(_Site.ALL_TRUE, 1 if flag else 0, carry_failed=False)) == 1

    def check_same(self, value: int, what: str, error: Optional[BaseException] = None) -> None:
        """Raise on every rank if the ranks disagree on `value` (e.g. which group they all-gather),
        instead of letting mismatched collectives hang or abort; or if a rank met `error` on its way
        here (its read of the shard to all-gather: [Note: A load that failed on one rank] in
        groups/shard_group.py): that rank raises it, the others a RuntimeError naming the rank."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        every = torch.tensor(self._gather_values(_Site.GATHER, value, error))
        raised = [rank for rank, v in enumerate(every.tolist()) if v == _RAISED]
        if raised or bool((every != value).any()):
            self.failure_agreed()
        if bool((every != value).any()) and not raised and error is None:
            self._disagreed_at = self.num_issued
        if error is not None:
            error.add_note(f"every rank raised at the check before {what} (rank(s) {raised} failed)")
            raise error
        if raised:
            raise RuntimeError(
                f"rank(s) {raised} failed on the way to {what} (their errors name why: a read of their shard, "
                "say), so no rank issued it; every rank raises here, and the next call tries again"
            )
        if bool((every != value).any()):
            raise RuntimeError(
                f"ranks disagree on {what}: rank r has {every.tolist()}[r] (this is rank {self.rank}); every rank "
                "must run the same modules in the same order (data-dependent routing that differs between ranks is "
                "not supported)"
            )

    def check_none_failed(self) -> None:
        """On every rank, on_agreed_failure(the ranks that failed) if any rank failed_here(): an agreement
        for a point that has no all-gather before it (a save, an export; a step's rides on its global
        norm: all_reduce_sum_agreed)."""
        if self.world_size > 1:
            self._gather_values(_Site.NONE_FAILED, 0)

    def _gather_values(
        self, site: "_Site", value: int, error: Optional[BaseException] = None, carry_failed: bool = True
    ) -> List[int]:
        """Every rank's `value`, or _FAILED from a rank that failed_here() (where `carry_failed`), or _RAISED
        from one that met `error`; where any failed_here(), every rank calls on_agreed_failure instead of
        returning (the ranks' next collectives stay paired: none issues the collective the agreement was
        for). Each rank's `site` goes with it: where they differ, every rank raises ([Note: Agreements
        of one shape])."""
        failed_here = carry_failed and self.failed_here()
        told = _FAILED if failed_here else _RAISED if error is not None else value
        mine = torch.tensor([int(site), told], dtype=torch.int64)
        every = torch.empty(2 * self.world_size, dtype=torch.int64)
        self._issue()
        with self._timed("agreement"):
            self._wait(_all_gather(every, mine, group=self.group, async_op=True), "agreement")
        sites, values = every[0::2].tolist(), every[1::2].tolist()
        failed = [rank for rank, v in enumerate(values) if v == _FAILED]
        if failed:
            self.failure_agreed()
            self.on_agreed_failure(failed)
            raise AssertionError("on_agreed_failure returned")  # it raises; a collective after it would pair out of step
        if any(other != site for other in sites):
            self.failure_agreed()
            self._disagreed_at = self.num_issued
            where = "; ".join(f"rank {r} at {_Site(s).describe(v)}" for r, (s, v) in enumerate(zip(sites, values)))
            raise RuntimeError(
                f"ranks disagree on what they do: {where} (this is rank {self.rank}); every rank must make the same "
                "engine calls in the same order (a forward of its own on one rank, say, is not supported): every rank "
                "raises here, and their next collectives pair again"
            )
        return values

    def barrier(self) -> None:
        if self.world_size > 1:
            self._issue()
            self._wait(dist.barrier(group=self.group, async_op=True), "barrier")

    def broadcast_from_0(self, t: torch.Tensor) -> None:
        """`t` (on the host) = rank 0's."""
        if self.world_size > 1:
            self._issue()
            self._wait(dist.broadcast(t, src=0, group=self.group, async_op=True), "broadcast")


_num_boards = 0
"""Collectives of several ranks made so far in this process: each engine's board is its own."""

_FAILED = -1
"""The value an agreement carries from a rank that failed (what it agrees on is never negative)."""
_RAISED = -2
"""The value a check carries from a rank that met an error on its way to it (check_same's `error`)."""


class _Site(enum.IntEnum):
    """Which agreement a rank is at; every agreement is one all-gather of (site, value) per rank.

    [Note: Agreements of one shape]
    The agreements were three collectives of three shapes: check_same and check_none_failed an
    all-gather of one number per rank, all_true an all-reduce of one. A rank whose loop ran a forward
    of its own while its peer saved met the save's check_none_failed with the forward's first
    agreement: an all-true for a device slot (gloo waited until the process group's timeout: the two
    collectives never pair), or the check before group 0's all-gather, which passed (both carried 0)
    and sent the ranks on to unrelated collectives. Every agreement is now the same all-gather,
    carrying where the rank is: ranks at different agreements all raise there, in step, naming where
    each is."""

    GATHER = 1
    """check_same before an all-gather; the value is the group."""
    NONE_FAILED = 2
    """check_none_failed, at the start of a save or an export."""
    ALL_TRUE = 3
    """all_true: a device slot's agreement, a checkpoint's."""

    def describe(self, value: int) -> str:
        if self is _Site.GATHER:
            return f"the check before group {value}'s all-gather"
        if self is _Site.NONE_FAILED:
            return "a save's or an export's check"
        return "an agreement (a device slot's, a checkpoint's)"


def _refuse_failed_ranks(ranks: List[int]) -> None:
    raise RuntimeError(f"rank(s) {ranks} failed and told the others at an agreement")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
