"""What a caller waits on (runtime/device/pending.py): a Chain (an NVMe read, then the copy its
completion issues) is done only once its copy is issued and done; all_of keeps whatever is still in
flight; wait_all raises the first error after waiting for the rest. Each test stands for an ordering
mutation that no engine test caught: a Chain taken for done before its read finished is dropped by
all_of, and the compute that uses the slot then reads it before the copy lands."""

from __future__ import annotations

import errno
import threading
from typing import List

import pytest

from io_engine import IOHandle, TransferError
from offload_trainer.runtime.device.pending import DONE, Chain, HostEvent, all_of, wait_all


def _read(size: int = 8) -> IOHandle:
    """An io_engine read in flight: one block, finished by `_finish_read`."""
    return IOHandle("read", "/swap/params.bin", 4096, size, 1, buffer=None)


def _finish_read(handle: IOHandle, error: bool = False) -> None:
    failure = TransferError("read", handle.path, handle.offset, handle.size_bytes, errno.EIO) if error else None
    handle._block_finished(0 if error else handle.size_bytes, failure)


def test_a_chain_is_not_done_before_its_read_finishes_and_its_copy_is_issued() -> None:
    read, copy = _read(), HostEvent()
    issued: List[bool] = []

    def then() -> HostEvent:
        issued.append(True)
        return copy

    chain = Chain(read, then)
    assert not chain.done() and not issued
    # all_of keeps it: a consumer that waits on all_of([...]) waits for this load too.
    assert all_of([DONE, chain]) is chain
    _finish_read(read)
    assert issued == [True]
    assert not chain.done()  # issued, not yet copied
    copy.set()
    assert chain.done() and all_of([chain]) is DONE


def test_a_chain_whose_read_fails_never_issues_its_copy_and_raises_the_read_error_to_its_waiter() -> None:
    read = _read()
    chain = Chain(read, lambda: pytest.fail("the copy of a failed read was issued"))
    _finish_read(read, error=True)
    assert chain.done()
    chain.wait_issued()  # returns: the error goes to whoever waits for the copy
    with pytest.raises(TransferError, match=r"read of 8 bytes at offset 4096 in /swap/params.bin failed"):
        chain.wait()


def test_wait_issued_blocks_until_the_copy_is_issued_not_until_it_is_done() -> None:
    read, copy = _read(), HostEvent()
    chain = Chain(read, lambda: copy)
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (chain.wait_issued(), returned.set()), daemon=True)
    waiter.start()
    assert not returned.wait(0.2)  # the read is not done: nothing issued yet
    _finish_read(read)
    assert returned.wait(10)  # issued; the copy itself is still in flight
    assert not copy.done()
    copy.set()
    chain.wait()
    waiter.join(10)


def test_all_of_waits_for_every_part_and_wait_all_raises_the_first_error_after_the_rest() -> None:
    first, second, third = HostEvent(), HostEvent(), HostEvent()
    combined = all_of([first, DONE, second, third])
    assert set(map(id, combined.parts())) == {id(first), id(second), id(third)}
    first.set()
    assert not combined.done()
    second.fail(RuntimeError("copy failed"))
    finished = threading.Event()

    def wait() -> None:
        with pytest.raises(RuntimeError, match="copy failed"):
            wait_all([first, second, third])
        finished.set()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    assert not finished.wait(0.2)  # the error is held until the third is done too
    third.set()
    assert finished.wait(10)
    waiter.join(10)
