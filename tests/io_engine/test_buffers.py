"""HostArena, aligned_empty and BufferPool: page-aligned host memory allocated once."""

from __future__ import annotations

import gc
import mmap
import threading

import pytest
import torch

from io_engine import BufferPool, HostArena, PooledBuffer, aligned_empty
from io_engine.buffers import round_up

PAGE = mmap.PAGESIZE


def test_round_up():
    assert [round_up(n, 4096) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 10 * 4096 + 1])
def test_aligned_empty(nbytes):
    tensor = aligned_empty(nbytes)
    assert tensor.dtype == torch.uint8 and tensor.device.type == "cpu"
    assert tensor.shape == (nbytes,)
    assert tensor.is_contiguous()
    assert tensor.data_ptr() % 4096 == 0
    tensor.fill_(7)  # writable, every byte
    assert int(tensor.sum()) == 7 * nbytes


def test_aligned_empty_outlives_its_arena():
    tensor = aligned_empty(4097)
    tensor.fill_(3)
    gc.collect()
    assert bool((tensor == 3).all())
    other = aligned_empty(4097)
    assert other.data_ptr() != tensor.data_ptr()


def test_arena_rounds_up_to_pages_and_slices_share_its_memory():
    arena = HostArena(3 * PAGE + 1, pin=False)
    assert arena.nbytes == 4 * PAGE
    assert arena.tensor.data_ptr() % PAGE == 0
    assert not arena.pinned
    first = arena.slice(0, 10)
    second = arena.slice(PAGE + 1, 5)
    assert second.data_ptr() == arena.tensor.data_ptr() + PAGE + 1
    second.fill_(9)
    assert arena.tensor[PAGE + 1 : PAGE + 6].tolist() == [9] * 5
    assert int(first.sum()) == 0  # populated memory starts zeroed
    assert arena.slice(arena.nbytes, 0).numel() == 0
    arena.close()
    arena.close()


@pytest.mark.parametrize("offset, nbytes", [(-1, 1), (0, 4 * PAGE + 1), (4 * PAGE, 1), (0, -1)])
def test_arena_slice_out_of_range(offset, nbytes):
    arena = HostArena(4 * PAGE, pin=False)
    with pytest.raises(ValueError, match=f"outside the arena of {4 * PAGE} bytes"):
        arena.slice(offset, nbytes)


@pytest.mark.parametrize("nbytes", [0, -4096, 1.5, True, "4096"])
def test_arena_size_must_be_a_positive_int(nbytes):
    with pytest.raises(ValueError, match=f"nbytes={nbytes!r}"):
        HostArena(nbytes)


def test_arena_without_populate():
    arena = HostArena(2 * PAGE, pin=False, populate=False)
    arena.tensor.fill_(1)
    assert int(arena.tensor.sum()) == 2 * PAGE


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_pinning_without_cuda_is_a_clear_error():
    assert not HostArena(PAGE).pinned  # pin=None: pinned only where CUDA is available
    with pytest.raises(ValueError, match="needs CUDA"):
        HostArena(PAGE, pin=True)


def test_pool_acquire_and_release():
    pool = BufferPool(num_buffers=3, buffer_bytes=4097, pin=False)
    assert pool.num_free == 3
    taken = [pool.acquire(timeout=0) for _ in range(3)]
    assert pool.num_free == 0
    assert all(isinstance(b, PooledBuffer) for b in taken)
    assert sorted(b.index for b in taken) == [0, 1, 2]
    taken[1].release()
    assert pool.num_free == 1
    again = pool.acquire(timeout=0)
    assert again is taken[1]
    for b in (taken[0], again, taken[2]):
        pool.release(b)
    assert pool.num_free == 3
    pool.close()


def test_pool_buffers_are_page_aligned_and_disjoint():
    pool = BufferPool(num_buffers=4, buffer_bytes=4097, pin=False)
    buffers = [pool.acquire() for _ in range(4)]
    starts = sorted(b.tensor.data_ptr() for b in buffers)
    assert all(start % 4096 == 0 for start in starts)
    assert all(b.tensor.numel() == 4097 and b.tensor.dtype == torch.uint8 for b in buffers)
    assert all(later - earlier >= 4097 for earlier, later in zip(starts, starts[1:]))
    for value, b in enumerate(buffers):
        b.tensor.fill_(value)
    assert [int(b.tensor.min()) for b in buffers] == [int(b.tensor.max()) for b in buffers] == [0, 1, 2, 3]


def test_pool_acquire_times_out_when_all_are_taken():
    pool = BufferPool(num_buffers=1, buffer_bytes=100, pin=False)
    held = pool.acquire()
    with pytest.raises(TimeoutError, match="no buffer of the pool's 1"):
        pool.acquire(timeout=0.01)
    held.release()
    assert pool.acquire(timeout=0) is held


def test_pool_acquire_waits_for_a_release():
    pool = BufferPool(num_buffers=1, buffer_bytes=100, pin=False)
    held = pool.acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=30)))
    waiter.start()
    held.release()
    waiter.join(30)
    assert got == [held]


def test_pool_double_release_and_foreign_buffer():
    pool = BufferPool(num_buffers=2, buffer_bytes=100, pin=False)
    other = BufferPool(num_buffers=2, buffer_bytes=100, pin=False)
    buffer = pool.acquire()
    buffer.release()
    with pytest.raises(ValueError, match="released twice"):
        buffer.release()
    foreign = other.acquire()
    with pytest.raises(ValueError, match="does not belong to this pool"):
        pool.release(foreign)
    assert pool.num_free == 2 and other.num_free == 1


def test_pool_buffer_as_context_manager():
    pool = BufferPool(num_buffers=1, buffer_bytes=10, pin=False)
    with pool.acquire() as tensor:
        assert isinstance(tensor, torch.Tensor) and tensor.numel() == 10
        assert pool.num_free == 0
    assert pool.num_free == 1


@pytest.mark.parametrize("num_buffers, buffer_bytes", [(0, 4096), (2, 0), (-1, 10)])
def test_pool_needs_positive_sizes(num_buffers, buffer_bytes):
    with pytest.raises(ValueError, match=f"num_buffers={num_buffers}, buffer_bytes={buffer_bytes}"):
        BufferPool(num_buffers, buffer_bytes, pin=False)
