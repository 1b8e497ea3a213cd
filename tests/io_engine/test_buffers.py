"""HostArena and aligned_empty: page-aligned host memory allocated once."""

from __future__ import annotations

import errno
import gc
import mmap

import pytest
import torch

from io_engine import HostArena, aligned_empty, buffers
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


@pytest.mark.parametrize("huge_pages", [False, True])
def test_an_arena_past_any_address_space_is_enomem_naming_its_size(huge_pages: bool) -> None:
    # mmap's OverflowError ("Python int too large to convert to C ssize_t") named nothing: the Python API's
    # IOConfig(block_bytes=2**70) ended there, a bounce buffer of that size per IO worker.
    with pytest.raises(OSError, match=r"Cannot allocate memory: a host arena of 11805916207174\d{8} bytes") as info:
        HostArena(2**70, populate=False, huge_pages=huge_pages)
    assert info.value.errno == errno.ENOMEM


def test_an_arena_the_kernel_refuses_is_enomem_naming_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(buffers, "_Mapping", refuse)
    with pytest.raises(OSError, match=r"a host arena of 1099511627776 bytes \(1024.00 GiB\) does not fit"):
        HostArena(2**40, populate=False, huge_pages=False)


def test_arena_without_populate():
    arena = HostArena(2 * PAGE, pin=False, populate=False)
    arena.tensor.fill_(1)
    assert int(arena.tensor.sum()) == 2 * PAGE


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_pinning_without_cuda_is_a_clear_error():
    assert not HostArena(PAGE).pinned  # pin=None: pinned only where CUDA is available
    with pytest.raises(ValueError, match="needs CUDA"):
        HostArena(PAGE, pin=True)


def _rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_discard_gives_whole_pages_back_and_they_read_as_zeros():
    nbytes = 32 << 20
    arena = HostArena(nbytes, pin=False)
    assert arena.can_discard
    arena.tensor.fill_(5)
    before = _rss_anon_bytes()
    # A range that starts and ends inside pages: only the whole pages within it are given back.
    assert arena.discard(PAGE + 1, nbytes - 2 * PAGE - 2)
    assert _rss_anon_bytes() <= before - (nbytes - 4 * (2 << 20))  # huge pages at the edges may stay
    assert int(arena.tensor[: 2 * PAGE].sum()) == 5 * 2 * PAGE  # the partial first page (and the one before) kept
    assert int(arena.tensor[-2 * PAGE :].sum()) == 5 * 2 * PAGE
    assert not bool(arena.tensor[2 * PAGE : -2 * PAGE].any())
    arena.tensor.fill_(3)  # writable again: the pages come back
    assert int(arena.tensor.sum()) == 3 * nbytes
    with pytest.raises(ValueError, match="outside the arena"):
        arena.discard(0, nbytes + 1)


def test_discard_does_nothing_on_a_shared_arena():
    arena = HostArena(4 * PAGE, pin=False)  # under 2 MiB: MAP_SHARED, which MADV_DONTNEED does not free
    arena.tensor.fill_(2)
    assert not arena.can_discard
    assert not arena.discard(0, 4 * PAGE)
    assert int(arena.tensor.sum()) == 2 * 4 * PAGE


class FakeCudart:
    """torch.cuda.cudart() without a GPU: registrations recorded, a range registered twice refused
    with cudaErrorHostMemoryAlreadyRegistered (712), as the driver does."""

    def __init__(self) -> None:
        self.registered: dict = {}
        self.unregistered: list = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        if any(p < ptr + nbytes and ptr < p + n for p, n in self.registered.items()):
            return 712
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0 if self.registered.pop(ptr, None) is not None else 713


@pytest.fixture
def cudart(monkeypatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr("io_engine.buffers.cuda_pinning_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


@pytest.mark.parametrize("nbytes", [3 * PAGE, 4 << 20])  # MAP_SHARED, and huge-page MAP_PRIVATE
def test_aligned_empty_is_unpinned_when_its_last_tensor_goes(cudart: FakeCudart, nbytes: int) -> None:
    """aligned_empty drops its arena at once, so nothing ever closed it: its memory was unmapped still
    registered, and the next buffer mapped at the same address (a checkpoint's staging buffer, saved
    every few steps) failed to register."""
    for _ in range(3):
        tensor = aligned_empty(nbytes)
        ptr = tensor.data_ptr()
        view = tensor[PAGE:].view(torch.int32)  # views keep the memory, and with it the registration
        del tensor
        gc.collect()
        assert ptr in cudart.registered
        del view
        gc.collect()
        assert ptr not in cudart.registered and cudart.unregistered[-1] == ptr
    assert not cudart.registered


def test_a_closed_arena_is_unpinned_once(cudart: FakeCudart) -> None:
    arena = HostArena(2 * PAGE)
    assert arena.pinned and len(cudart.registered) == 1
    piece = arena.slice(0, PAGE)
    arena.close()
    assert not arena.pinned and not cudart.registered
    del arena, piece
    gc.collect()
    assert len(cudart.unregistered) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_aligned_empty_buffers_in_turn_are_pinned_on_the_gpu() -> None:
    """Freed and made again, as a checkpoint's staging buffer is at every save: each one registers."""
    for _ in range(4):
        tensor = aligned_empty(8 << 20)
        assert tensor.is_pinned()
        del tensor
        gc.collect()
