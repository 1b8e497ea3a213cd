"""Checksums of swap extents: bytes changed on disk fail the read, bytes as written never do.

The swap files are changed behind the store's back with plain buffered writes (O_DIRECT reads
write back and then bypass the page cache, so they see them). make_engine's 8 KiB blocks make
each extent many chunks; the extents under test start at 4096, off the 8 KiB chunk grid of the
file, so chunks are counted from the extent, not the file.
"""

from __future__ import annotations

import errno
import os
from typing import Iterator, Tuple

import numpy as np
import pytest

import io_engine.checksums
import io_engine.transfer
from io_engine import DirectMode, FileStore, IntegrityError, LostWriteError, TransferError, aligned_empty
from io_engine.checksums import CHECKSUM_BACKEND, checksum

BLOCK = 8192  # SMALL_ENGINE's block_bytes: the chunk size
SIZE = 5 * BLOCK + 1234  # five whole chunks and a short last one
LABEL = "group 'layers.3' exp_avg"


@pytest.fixture(params=["system", "zlib"])
def crc_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The checksum in use ("system": XXH3-64 from the xxhash package where installed), and zlib's fallback."""
    if request.param == "zlib":
        monkeypatch.setattr(io_engine.checksums, "_xxh3_64", None)
    yield request.param


def corrupt(store: FileStore, key: str, extent_offset: int, data: bytes) -> None:
    """Overwrite bytes of extent `key` on disk, as a failing disk or a stray program would."""
    extent = store.extent(key)
    with open(extent.path, "r+b") as f:
        f.seek(extent.offset + extent_offset)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def flip(store: FileStore, key: str, extent_offset: int, nbytes: int) -> None:
    extent = store.extent(key)
    with open(extent.path, "rb") as f:
        f.seek(extent.offset + extent_offset)
        old = np.frombuffer(f.read(nbytes), dtype=np.uint8)
    corrupt(store, key, extent_offset, (old ^ 0xFF).tobytes())


def chunk_of(extent_offset: int) -> Tuple[int, int]:
    """(start in the extent, bytes) of the chunk holding byte `extent_offset` of a SIZE extent."""
    start = extent_offset // BLOCK * BLOCK
    return start, min(BLOCK, SIZE - start)


def make_store(tmp_path, make_engine, random_bytes, **config) -> Tuple[FileStore, np.ndarray]:
    store = FileStore(make_engine(**config), tmp_path)
    store.allocate({"before": 4096, "x": SIZE, "after": 4097}, labels={"x": LABEL})
    data = random_bytes(SIZE, 7)
    store.write("before", random_bytes(4096, 1))
    store.write("x", data)
    store.write("after", random_bytes(4097, 2))
    return store, data


@pytest.mark.parametrize("direct", [DirectMode.ON, DirectMode.OFF], ids=lambda m: m.value)
def test_flipped_bytes_fail_the_read_naming_path_offset_size_key_and_label(
    tmp_path, make_engine, random_bytes, direct, crc_backend
):
    store, data = make_store(tmp_path, make_engine, random_bytes, direct=direct)
    with store:
        where = SIZE // 2 - 32
        flip(store, "x", where, 64)
        out = aligned_empty(SIZE)
        handle = store.pread("x", out)
        with pytest.raises(IntegrityError) as info:
            handle.wait()
        err = info.value
        extent = store.extent("x")
        chunk_start, chunk_bytes = chunk_of(where)
        assert isinstance(err, TransferError) and isinstance(err, OSError) and err.errno == errno.EIO
        assert (err.path, err.offset, err.size_bytes) == (extent.path, extent.offset + chunk_start, chunk_bytes)
        assert (err.key, err.label, err.extent_offset) == ("x", LABEL, chunk_start)
        message = str(err)
        for part in (extent.path, f"offset {extent.offset + chunk_start}", f"{chunk_bytes} bytes", "'x'", LABEL):
            assert part in message, f"{part!r} not in {message!r}"
        assert handle.exception() is err
        # the neighbours were not touched, and read back verified
        for key, seed in (("before", 1), ("after", 2)):
            back = np.empty(store.extent(key).size_bytes, dtype=np.uint8)
            store.read(key, back)
            assert np.array_equal(back, random_bytes(len(back), seed))


@pytest.mark.parametrize("fill", ["zeros", "nan"])
def test_an_extent_overwritten_with_zeros_or_nan_is_caught(tmp_path, make_engine, random_bytes, fill):
    store, _ = make_store(tmp_path, make_engine, random_bytes)
    with store:
        if fill == "zeros":
            junk = bytes(SIZE)
        else:
            junk = np.full(SIZE // 4 + 1, np.nan, dtype=np.float32).tobytes()[:SIZE]
        corrupt(store, "x", 0, junk)
        with pytest.raises(IntegrityError) as info:
            store.read("x", np.empty(SIZE, dtype=np.uint8))
        assert info.value.key == "x" and info.value.extent_offset % BLOCK == 0


def test_every_chunk_of_a_whole_extent_read_is_verified(tmp_path, make_engine, random_bytes):
    store, data = make_store(tmp_path, make_engine, random_bytes)
    with store:
        sums = store._checksums["x"]
        assert sums.num_chunks == 6 and sums.num_valid() == 6  # the whole write recorded them all
        out = np.empty(SIZE, dtype=np.uint8)
        for chunk in range(6):
            where = min(chunk * BLOCK + 100, SIZE - 1)
            flip(store, "x", where, 1)
            with pytest.raises(IntegrityError) as info:
                store.read("x", out)
            assert info.value.extent_offset == chunk * BLOCK
            flip(store, "x", where, 1)  # back as written
            store.read("x", out)
            assert np.array_equal(out, data)


def test_reads_of_sub_ranges_check_the_chunks_they_hold_whole(tmp_path, make_engine, random_bytes):
    store, data = make_store(tmp_path, make_engine, random_bytes)
    with store:
        flip(store, "x", 2 * BLOCK + 10, 8)
        # bytes 1.5 to 3.5 chunks: chunk 2 is whole in it
        with pytest.raises(IntegrityError) as info:
            store.read("x", np.empty(2 * BLOCK, dtype=np.uint8), offset=BLOCK + BLOCK // 2)
        assert info.value.extent_offset == 2 * BLOCK
        # a part of chunk 2 only: not checked, the bytes are what the disk holds
        part = np.empty(100, dtype=np.uint8)
        store.read("x", part, offset=2 * BLOCK)
        assert not np.array_equal(part[10:18], data[2 * BLOCK + 10 : 2 * BLOCK + 18])
        # chunks 0 and 1 whole, untouched: verified and fine
        out = np.empty(2 * BLOCK, dtype=np.uint8)
        store.read("x", out)
        assert np.array_equal(out, data[: 2 * BLOCK])


def test_the_first_whole_read_after_a_partial_write_records(tmp_path, make_engine, random_bytes):
    """[Note: Checksums of swap extents]: a partial write leaves its chunks unchecked until read whole."""
    store, data = make_store(tmp_path, make_engine, random_bytes)
    with store:
        sums = store._checksums["x"]
        piece = random_bytes(300, 9)
        store.write("x", piece, offset=BLOCK + 4000)  # inside chunk 1
        data[BLOCK + 4000 : BLOCK + 4300] = piece
        assert sums.num_valid() == 5
        flip(store, "x", BLOCK + 10, 4)  # chunk 1 changed after the partial write: not seen ...
        flip(store, "x", 3 * BLOCK + 10, 4)  # ... but chunk 3 still has its checksum
        out = np.empty(SIZE, dtype=np.uint8)
        with pytest.raises(IntegrityError) as info:
            store.read("x", out)
        assert info.value.extent_offset == 3 * BLOCK
        flip(store, "x", 3 * BLOCK + 10, 4)
        store.read("x", out)  # records chunk 1 as it is now
        assert sums.num_valid() == 6
        flip(store, "x", BLOCK + 20, 1)  # from now on chunk 1 is checked again
        with pytest.raises(IntegrityError) as info:
            store.read("x", out)
        assert info.value.extent_offset == BLOCK


def test_a_failed_write_leaves_its_chunks_lost_until_written_whole(tmp_path, make_engine, random_bytes, monkeypatch):
    """[Note: Checksums of swap extents]: the chunk a failed write touched holds neither the old bytes nor
    the new; a read of it (whole, or a part) is refused naming the file, offset, size, key and label, the
    other chunks read as written. Before, the read recorded whatever the disk held, and a loop that caught
    the write's error and went on read a mix of old and new state silently. A whole write heals it.
    One block per system call, so that the call failed is one chunk's."""
    store, data = make_store(tmp_path, make_engine, random_bytes, direct=DirectMode.OFF, blocks_per_call=1)
    with store:
        real_pwritev = os.pwritev
        calls = {"n": 0}

        def fail_the_third_block(fd, buffers, offset, *flags):
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(errno.EIO, "Input/output error")
            return real_pwritev(fd, buffers, offset, *flags)

        monkeypatch.setattr(io_engine.transfer.os, "pwritev", fail_the_third_block)
        new = random_bytes(SIZE, 10)
        with pytest.raises(TransferError) as info:
            store.write("x", new)
        assert not isinstance(info.value, (IntegrityError, LostWriteError))
        monkeypatch.undo()
        assert store._checksums["x"].num_valid() == 5
        lost = (info.value.offset - store.extent("x").offset) // BLOCK
        extent = store.extent("x")
        for offset, size in ((0, SIZE), (lost * BLOCK + 10, 20)):
            with pytest.raises(LostWriteError) as refused:
                store.read("x", np.empty(size, dtype=np.uint8), offset=offset)
            err = refused.value
            assert (err.path, err.offset, err.size_bytes) == (extent.path, extent.offset + lost * BLOCK, BLOCK)
            assert (err.key, err.label, err.extent_offset) == ("x", LABEL, lost * BLOCK) and err.errno == errno.EIO
            assert "failed" in str(err) and LABEL in str(err)
        others = [c for c in range(6) if c != lost]
        for chunk in others:  # the chunks written: as written, and checked
            out = np.empty(chunk_of(chunk * BLOCK)[1], dtype=np.uint8)
            store.read("x", out, offset=chunk * BLOCK)
            assert np.array_equal(out, new[chunk * BLOCK : chunk * BLOCK + len(out)])
        store.write("x", new)  # written whole again: readable
        out = np.empty(SIZE, dtype=np.uint8)
        store.read("x", out)
        assert np.array_equal(out, new) and store._checksums["x"].num_valid() == 6


def test_a_write_cancelled_by_close_leaves_its_chunks_lost(tmp_path, make_engine, random_bytes):
    """A block cancelled before it ran wrote nothing of what it carried: its chunks are lost too."""
    store, _ = make_store(tmp_path, make_engine, random_bytes)
    with store:
        sums = store._checksums["x"]
        extent = store.extent("x")
        store.engine._cancel = True  # what close(cancel=True) sets before the queued blocks run
        try:
            with pytest.raises(TransferError):
                store.write("x", random_bytes(SIZE, 11))
        finally:
            store.engine._cancel = False
        assert sums.num_valid() == 0
        with pytest.raises(LostWriteError) as refused:
            store.read("x", np.empty(SIZE, dtype=np.uint8))
        assert refused.value.offset == extent.offset


@pytest.mark.parametrize("block_bytes", [4096, BLOCK, 3 * 4096])
@pytest.mark.parametrize("seed", range(4))
def test_no_false_positive_over_random_whole_and_partial_requests(
    tmp_path, make_engine, make_buffer, random_bytes, block_bytes, seed, crc_backend
):
    rng = np.random.default_rng(seed)
    sizes = {"a": 4 * block_bytes + 777, "b": block_bytes, "c": 1, "d": 3 * block_bytes - 5}
    engine = make_engine(block_bytes=block_bytes, direct=DirectMode.AUTO)
    with FileStore(engine, tmp_path) as store:
        store.allocate({"pad": 4096})  # the next file's extents are off the chunk grid
        store.allocate(sizes)
        model = {key: np.zeros(size, dtype=np.uint8) for key, size in sizes.items()}
        kinds = ["aligned", "tensor_at_byte_1", "bytearray", "numpy_at_byte_3"]
        for step in range(120):
            key = list(sizes)[rng.integers(len(sizes))]
            size = sizes[key]
            if rng.random() < 0.4:
                offset, nbytes = 0, size
            else:
                offset = int(rng.integers(size))
                nbytes = int(rng.integers(1, size - offset + 1))
            buffer = make_buffer(kinds[rng.integers(len(kinds))], nbytes)
            if rng.random() < 0.5:
                payload = random_bytes(nbytes, seed * 1000 + step)
                buffer.data[:nbytes] = payload
                assert store.write(key, buffer.obj, offset, buffer.size) == nbytes
                model[key][offset : offset + nbytes] = payload
            else:
                assert store.read(key, buffer.obj, offset, buffer.size) == nbytes
                assert np.array_equal(buffer.data[:nbytes], model[key][offset : offset + nbytes])
        # every chunk ends up checked once read whole, and a change is then caught
        for key, size in sizes.items():
            store.read(key, np.empty(size, dtype=np.uint8))
            assert store._checksums[key].num_valid() == store._checksums[key].num_chunks
        flip(store, "a", sizes["a"] - 1, 1)
        with pytest.raises(IntegrityError) as info:
            store.read("a", np.empty(sizes["a"], dtype=np.uint8))
        assert info.value.extent_offset == 4 * block_bytes and info.value.size_bytes == 777


def test_writes_in_flight_together_on_several_extents(tmp_path, make_engine, random_bytes):
    engine = make_engine(num_threads=4, queue_depth=16)
    with FileStore(engine, tmp_path) as store:
        sizes = {f"k{i}": 3 * BLOCK + 100 * i + 1 for i in range(8)}
        store.allocate(sizes)
        data = {key: random_bytes(size, i) for i, (key, size) in enumerate(sizes.items())}
        for handle in [store.pwrite(key, data[key]) for key in sizes]:
            handle.wait()
        outs = {key: np.empty(size, dtype=np.uint8) for key, size in sizes.items()}
        for handle in [store.pread(key, outs[key]) for key in sizes]:
            handle.wait()
        assert all(np.array_equal(outs[key], data[key]) for key in sizes)
        assert all(store._checksums[key].num_valid() == 4 for key in sizes)


def test_verify_checksums_off_reads_without_checking(tmp_path, make_engine, random_bytes):
    store, data = make_store(tmp_path, make_engine, random_bytes, verify_checksums=False)
    with store:
        assert store._checksums == {}
        flip(store, "x", 100, 64)
        out = np.empty(SIZE, dtype=np.uint8)
        store.read("x", out)
        assert np.array_equal(out[:100], data[:100]) and not np.array_equal(out[100:164], data[100:164])


def test_an_unlabelled_extent_is_named_by_its_key(tmp_path, make_engine, random_bytes):
    with FileStore(make_engine(), tmp_path) as store:
        store.allocate({"plain": 4096})
        store.write("plain", random_bytes(4096, 3))
        flip(store, "plain", 0, 1)
        with pytest.raises(IntegrityError) as info:
            store.read("plain", np.empty(4096, dtype=np.uint8))
        assert info.value.label is None and "in extent 'plain', bytes [0, 4096)" in str(info.value)


def test_labels_are_checked(tmp_path, make_engine):
    with FileStore(make_engine(), tmp_path) as store:
        with pytest.raises(ValueError, match="key 'nope', which is not among the keys"):
            store.allocate({"a": 1}, labels={"nope": "x"})
        with pytest.raises(ValueError, match="label 3 of extent 'a' must be a string"):
            store.allocate({"a": 1}, labels={"a": 3})  # type: ignore[dict-item]
        assert store.extents == {}
        (made,) = store.allocate({"a": 1}, labels={"a": "group 'a' param"})
        assert made.label == "group 'a' param"


def test_xxh3_is_in_use_where_installed():
    """xxhash is a declared dependency (scripts/install.sh installs it): the checks run at XXH3's speed,
    with 64-bit values (an IntegrityError shows them whole)."""
    import importlib.util

    if importlib.util.find_spec("xxhash") is None:
        pytest.skip("the xxhash package is not installed: zlib computes the checksums")
    import xxhash

    assert CHECKSUM_BACKEND == "xxh3_64"
    data = memoryview(np.arange(1 << 17, dtype=np.uint8).tobytes())  # above the size where it releases the GIL
    assert checksum(data) == xxhash.xxh3_64_intdigest(data)
    assert checksum(memoryview(b"123456789")) > 2**32  # 64-bit: not a crc32
    sums = io_engine.checksums.ExtentChecksums("f", 0, 1 << 17, 1 << 16, key="a")
    assert sums._sums.dtype == np.uint64


def test_a_flipped_byte_fails_a_request_of_several_extents_naming_the_one_it_is_in(
    tmp_path, make_engine, random_bytes, crc_backend
):
    """pread_many checks each part against its own extent's chunks: the error names that extent."""
    store, data = make_store(tmp_path, make_engine, random_bytes, direct=DirectMode.ON)
    with store:
        before, after = aligned_empty(4096), aligned_empty(4097)
        store.pwrite_many([("before", before, 0), ("after", after, 0)])  # the neighbours, written together
        where = 3 * BLOCK + 5
        flip(store, "x", where, 1)
        out = aligned_empty(SIZE)
        handle = store.pread_many([("before", aligned_empty(4096), 0), ("x", out, 0), ("after", aligned_empty(4097), 0)])
        with pytest.raises(IntegrityError) as info:
            handle.wait()
        chunk_start, chunk_bytes = chunk_of(where)
        err = info.value
        assert (err.path, err.offset, err.size_bytes) == (store.extent("x").path, store.extent("x").offset + chunk_start, chunk_bytes)
        assert (err.key, err.label) == ("x", LABEL)
        # Every chunk but the flipped one reads back as written.
        assert np.array_equal(out.numpy()[:chunk_start], data[:chunk_start])
        assert np.array_equal(out.numpy()[chunk_start + chunk_bytes :], data[chunk_start + chunk_bytes :])


def test_a_refused_request_of_several_extents_leaves_every_checksum_as_it_was(tmp_path, make_engine, random_bytes):
    """A pwrite_many whose later part is refused (here a buffer io_engine cannot move) starts none of
    its parts: the first part's chunks keep their checksum, so a corruption of them is still caught."""
    store, data = make_store(tmp_path, make_engine, random_bytes)
    with store:
        strided = np.zeros(2 * 4096, dtype=np.uint8)[::2]  # not contiguous: refused by byte_view
        with pytest.raises(ValueError, match="contiguous"):
            store.pwrite_many([("x", random_bytes(SIZE, 9), 0), ("before", strided, 0)])
        where = BLOCK + 17
        flip(store, "x", where, 1)
        with pytest.raises(IntegrityError):
            store.read("x", aligned_empty(SIZE))


@pytest.mark.parametrize("blocks_per_call", [1, 4, 8])
@pytest.mark.parametrize("chunk", range(6))
def test_a_changed_chunk_fails_the_read_wherever_it_lies_in_a_system_call(
    tmp_path, make_engine, random_bytes, blocks_per_call, chunk
):
    """[Note: Blocks per call]: a worker reads several chunks with one system call and checks each; a
    byte changed on disk in any of them fails the read naming that chunk's path, offset and size (not
    the call's), whatever its place in the call."""
    store, _ = make_store(tmp_path, make_engine, random_bytes, num_threads=1, blocks_per_call=blocks_per_call)
    with store:
        where = chunk * BLOCK + 5
        flip(store, "x", where, 1)
        with pytest.raises(IntegrityError) as info:
            store.read("x", aligned_empty(SIZE))
        extent = store.extent("x")
        chunk_start, chunk_bytes = chunk_of(where)
        err = info.value
        assert (err.path, err.offset, err.size_bytes) == (extent.path, extent.offset + chunk_start, chunk_bytes)
        assert (err.key, err.extent_offset) == ("x", chunk_start)
        assert f"offset {extent.offset + chunk_start}" in str(err) and extent.path in str(err)


def _shift_the_call_at(monkeypatch: pytest.MonkeyPatch, name: str, file_offset: int, by: int) -> None:
    """Make the IO path misplace one system call: the os.preadv or os.pwritev that starts at
    `file_offset` moves its bytes at `file_offset + by` instead (an offset fault in the engine)."""
    real = getattr(os, name)

    def misplaced(fd, buffers, offset, *flags):
        return real(fd, buffers, offset + by if offset == file_offset else offset, *flags)

    monkeypatch.setattr(io_engine.transfer.os, name, misplaced)


@pytest.mark.parametrize("blocks_per_call", [1, 4])
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_misplaced_system_call_fails_the_read_naming_path_offset_and_size(
    tmp_path, make_engine, random_bytes, monkeypatch, blocks_per_call, op
):
    """An offset fault in the IO path (a read that fetched the next chunk's bytes, a write that
    landed one chunk too far) fails loudly at the read, naming the file, offset and size of the first
    chunk that holds the wrong bytes, instead of handing the caller another chunk's data."""
    store, data = make_store(tmp_path, make_engine, random_bytes, num_threads=1, blocks_per_call=blocks_per_call)
    with store:
        extent = store.extent("x")
        new = random_bytes(SIZE, 12)
        if op == "write":
            _shift_the_call_at(monkeypatch, "pwritev", extent.offset, BLOCK)
            store.write("x", new)  # the write "succeeds": the fault is silent at the disk
            monkeypatch.undo()
        else:
            store.write("x", new)
            _shift_the_call_at(monkeypatch, "preadv", extent.offset, BLOCK)
        with pytest.raises(IntegrityError) as info:
            store.read("x", aligned_empty(SIZE))
        err = info.value
        assert (err.path, err.offset, err.size_bytes) == (extent.path, extent.offset, BLOCK)
        assert (err.key, err.label, err.extent_offset) == ("x", LABEL, 0)
        for part in (extent.path, f"offset {extent.offset}", f"{BLOCK} bytes"):
            assert part in str(err), f"{part!r} not in {str(err)!r}"


def test_lost_chunks_are_refused_until_each_is_written_whole_again() -> None:
    """A read's check skips its scan of the lost chunks while none is lost (a count): the count
    must follow every chunk a failed write lost and every whole write that heals one."""
    from io_engine.checksums import ExtentChecksums
    from io_engine.transfer import Block

    sums = ExtentChecksums("/swap", 4096, 4 * BLOCK, BLOCK, key="x", label=LABEL)
    memory = memoryview(bytearray(4 * BLOCK))

    def block(chunk: int, is_read: bool, token=None) -> Block:
        return Block(None, None, is_read, memory, 0, chunk * BLOCK, 4096 + chunk * BLOCK, BLOCK, sums, (token,))

    def read(chunk: int) -> None:
        sums.start(True, 4096 + chunk * BLOCK, [(0, BLOCK)])

    for chunk in range(4):
        read(chunk)  # nothing lost yet
    sums.failed(Block(None, None, False, memory, 0, BLOCK, 4096 + BLOCK, 2 * BLOCK, sums))  # chunks 1 and 2
    for chunk in (1, 2):
        with pytest.raises(LostWriteError):
            read(chunk)
    read(0)
    read(3)
    (token,) = sums.start(False, 4096 + BLOCK, [(0, BLOCK)])
    sums.finish(block(1, is_read=False, token=token))  # chunk 1 written whole again
    read(1)
    with pytest.raises(LostWriteError):
        read(2)
    (token,) = sums.start(False, 4096 + 2 * BLOCK, [(0, BLOCK)])
    sums.finish(block(2, is_read=False, token=token))
    for chunk in range(4):
        read(chunk)
