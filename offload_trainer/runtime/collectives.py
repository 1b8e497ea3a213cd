"""Collectives over the data-parallel ranks: all-gather of parameter shards, reduce-scatter of
gradients, all-reduce of norms. World size 1 (no process group) is a no-op path.

gloo on CPU, NCCL on CUDA: whatever `torch.distributed` was initialised with. Every collective
is issued from the training thread in an order that is the same on every rank (acquisitions in
module order, gradient flushes in autograd's order, then group order), never from prefetch.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.trace import Tracer


def data_parallel_world_size() -> int:
    """Ranks the engine shards over: torch.distributed's world size once initialised, else 1."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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
        else:
            self.world_size = 1
            self.rank = 0

    @contextlib.contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        """Count a collective's host time in the step's communication and trace it on its own track."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.stats.communication_s += end - start
            self.tracer.span("communication", what, start, end)

    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Fill `full` (world_size shards) from each rank's `shard`; this rank's may alias its place in `full`."""
        if self.world_size == 1:
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return
        with self._timed("all-gather"):
            dist.all_gather_into_tensor(full, shard.clone() if _overlaps(full, shard) else shard, group=self.group)

    def reduce_scatter_mean(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """`shard` = this rank's shard of the mean over ranks of `full`."""
        if self.world_size == 1:
            shard.copy_(full)
            return
        with self._timed("reduce-scatter"):
            dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.SUM, group=self.group)
            shard.div_(self.world_size)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        if self.world_size == 1:
            return
        with self._timed("all-reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    def all_true(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on every rank (so local decisions stay identical)."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        with self._timed("agreement"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def check_same(self, value: int, what: str) -> None:
        """Raise on every rank if the ranks disagree on `value` (e.g. which group they all-gather),
        instead of letting mismatched collectives hang or abort."""
        if self.world_size == 1:
            return
        mine = torch.tensor([value], dtype=torch.int64)
        every = torch.empty(self.world_size, dtype=torch.int64)
        with self._timed("agreement"):
            dist.all_gather_into_tensor(every, mine, group=self.group)
        if bool((every != value).any()):
            raise RuntimeError(
                f"ranks disagree on {what}: rank r has {every.tolist()}[r] (this is rank {self.rank}); "
                "every rank must run the same modules in the same order (data-dependent routing that "
                "differs between ranks is not supported)"
            )

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
