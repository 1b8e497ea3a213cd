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
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

from offload_trainer.runtime.metrics import StepStats
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
    ) -> None:
        self._owner = owner
        self.kind = kind
        """"all-gather" or "reduce-scatter"."""
        self._name = name
        self._work = work
        self._keep = keep
        """Tensors the collective reads or writes that nothing else may hold (a clone of the input)."""
        self._then = then
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
            self._work.wait()
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
        self.failed_here: Callable[[], bool] = lambda: False
        """Whether this rank failed in a way its peers must learn of at the next agreement (its update
        pass: [Note: An update pass that failed on one rank] in runtime/optimizer_pipeline.py)."""
        self.on_agreed_failure: Callable[[List[int]], None] = _refuse_failed_ranks
        """Called on every rank, with the ranks that failed, where an agreement found any: it raises."""
        self.injected_delay_s = 0.0
        """Tests only: every all-gather and reduce-scatter completes no earlier than this many
        seconds after it was issued (a slow link), so overlap shows in the counters."""

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
        start = time.perf_counter()
        source = shard.clone() if _overlaps(full, shard) else shard
        work = _all_gather(full, source, group=self.group, async_op=True)
        self.stats.communication_s += time.perf_counter() - start
        return CollectiveWork(self, "all-gather", name, work, [source])

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

        return CollectiveWork(self, "reduce-scatter", name, work, [full], mean)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        if self.world_size == 1:
            return
        with self._timed("all-reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

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
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        with self._timed("agreement"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def check_same(self, value: int, what: str, error: Optional[BaseException] = None) -> None:
        """Raise on every rank if the ranks disagree on `value` (e.g. which group they all-gather),
        instead of letting mismatched collectives hang or abort; or if a rank met `error` on its way
        here (its read of the shard to all-gather: [Note: A load that failed on one rank] in
        groups/shard_group.py): that rank raises it, the others a RuntimeError naming the rank."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        every = self._gather_values(value, error)
        raised = [rank for rank, v in enumerate(every.tolist()) if v == _RAISED]
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
                f"ranks disagree on {what}: rank r has {every.tolist()}[r] (this is rank {self.rank}); "
                "every rank must run the same modules in the same order (data-dependent routing that "
                "differs between ranks is not supported)"
            )

    def check_none_failed(self) -> None:
        """On every rank, on_agreed_failure(the ranks that failed) if any rank failed_here(): an agreement
        for a point that has no all-gather before it (a save, an export; a step's rides on its global
        norm: all_reduce_sum_agreed)."""
        if self.world_size > 1:
            self._gather_values(0)

    def _gather_values(self, value: int, error: Optional[BaseException] = None) -> torch.Tensor:
        """Every rank's `value`, or _FAILED from a rank that failed_here(), or _RAISED from one that met
        `error`; where any failed_here(), every rank calls on_agreed_failure instead of returning (the
        ranks' next collectives stay paired: none issues the collective the agreement was for)."""
        mine = torch.tensor(
            [_FAILED if self.failed_here() else _RAISED if error is not None else value], dtype=torch.int64
        )
        every = torch.empty(self.world_size, dtype=torch.int64)
        with self._timed("agreement"):
            _all_gather(every, mine, group=self.group)
        failed = [rank for rank, v in enumerate(every.tolist()) if v == _FAILED]
        if failed:
            self.on_agreed_failure(failed)
            raise AssertionError("on_agreed_failure returned")  # it raises; a collective after it would pair out of step
        return every

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


_FAILED = -1
"""The value an agreement carries from a rank that failed (what it agrees on is never negative)."""
_RAISED = -2
"""The value a check carries from a rank that met an error on its way to it (check_same's `error`)."""


def _refuse_failed_ranks(ranks: List[int]) -> None:
    raise RuntimeError(f"rank(s) {ranks} failed and told the others at an agreement")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
