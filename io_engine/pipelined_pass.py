"""run_pass: move a file block by block, len(slices) requests in flight, each in a buffer of its own.

    slices = [buffer[k * block_bytes : (k + 1) * block_bytes] for k in range(queue_depth)]
    seconds = run_pass(f.pread, slices, range(0, size_bytes, block_bytes), size_bytes)
    seconds = run_pass(functools.partial(store.pwrite, "key"), slices, offsets, size_bytes)

`submit(buffer_slice, offset, nbytes) -> IOHandle` starts one request: IOFile.pread/pwrite as
they are, FileStore.pread/pwrite bound to a key. What the benchmarks (offload_trainer's
MachineRates, bench_io.py) time, and what moves a whole file at the disk's speed.

[Note: Keeping the queue full]
Each request in flight owns one slice of a buffer allocated once; nothing is allocated per
block. A slice is handed back the moment its request completes, in whatever order requests
complete: the request's done callback (run by the worker thread) puts the slot's index on a
SimpleQueue, and the next block starts in the first slot to come back. Waiting on requests in
the order they were submitted would instead let the queue drain behind one slow request. Before
a slot is reused its previous handle is waited on: it is already done, so this never blocks, but
it raises that request's TransferError, which the done callback cannot.
"""

from __future__ import annotations

import time
from queue import SimpleQueue
from typing import Any, Callable, List, Optional, Sequence

from .handle import IOHandle

Submit = Callable[[Any, int, int], IOHandle]
"""submit(buffer_slice, offset, nbytes): start moving `nbytes` between the slice and the file at `offset`."""


def _nbytes(buf: Any) -> int:
    nbytes = getattr(buf, "nbytes", None)  # torch.Tensor, numpy.ndarray, memoryview
    if isinstance(nbytes, int):
        return nbytes
    return memoryview(buf).nbytes  # bytearray and other buffer-protocol objects


def run_pass(submit: Submit, slices: Sequence[Any], offsets: Sequence[int], size_bytes: Optional[int] = None) -> float:
    """Move one block at each of `offsets`, len(slices) requests in flight; return the seconds taken.

    A block is as large as a slice (every slice must have the same size in bytes). With
    `size_bytes` (the end of the file's data) the block at an offset within a slice of the end is
    shorter: only the bytes up to size_bytes move, and every offset must lie in [0, size_bytes).
    Slices are reused as soon as their request completes (see [Note: Keeping the queue full]).

    A failed request's TransferError is raised, after waiting for every other request still in
    flight, so that the slices are free again whenever run_pass returns or raises.
    """
    if not slices:
        raise ValueError("run_pass needs at least one buffer slice (one per request in flight); got none")
    block_bytes = _nbytes(slices[0])
    sizes = {_nbytes(s) for s in slices}
    if len(sizes) != 1 or block_bytes < 1:
        raise ValueError(
            f"run_pass needs slices of one non-zero size in bytes (one block each); got sizes {sorted(sizes)}: "
            "cut them from one buffer in equal parts"
        )
    if size_bytes is not None:
        outside = [offset for offset in offsets if not 0 <= offset < size_bytes]
        if outside:
            raise ValueError(
                f"offset {outside[0]} is outside the {size_bytes} bytes of data: pass offsets in "
                f"[0, {size_bytes}), for example range(0, {size_bytes}, {block_bytes})"
            )
    num_slots = len(slices)
    free_slots: "SimpleQueue[int]" = SimpleQueue()
    for slot in range(num_slots):
        free_slots.put(slot)
    # One callback per slot, made once: completion hands the slot back from the worker thread.
    callbacks = [lambda _handle, slot=slot: free_slots.put(slot) for slot in range(num_slots)]
    handles: List[Optional[IOHandle]] = [None] * num_slots
    start_s = time.perf_counter()
    try:
        for offset in offsets:
            slot = free_slots.get()
            previous = handles[slot]
            if previous is not None:
                previous.wait()  # already done; raises its TransferError if it failed
            nbytes = block_bytes if size_bytes is None else min(block_bytes, size_bytes - offset)
            handle = submit(slices[slot], offset, nbytes)
            handles[slot] = handle
            handle.add_done_callback(callbacks[slot])
        for handle in handles:
            if handle is not None:
                handle.wait()
    except BaseException:
        _wait_for_all(handles)
        raise
    return time.perf_counter() - start_s


def _wait_for_all(handles: List[Optional[IOHandle]]) -> None:
    """Wait for every request, ignoring their errors: one is already on its way to the caller."""
    for handle in handles:
        if handle is not None:
            try:
                handle.wait()
            except Exception:
                pass


__all__ = ["Submit", "run_pass"]
