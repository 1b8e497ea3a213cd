"""FileStore: named extents in private preallocated swap files, and their boundaries."""

from __future__ import annotations

import errno
import gc
import os
import stat
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

import io_engine.file_store
from io_engine import DirectMode, Extent, FileStore, NotEnoughSpaceError, TransferError, aligned_empty
from io_engine.swap_dirs import LOCK_NAME

MiB = 1 << 20
SIZES = [1, 4095, 4096, 4097, MiB + 1]
MODES = [DirectMode.ON, DirectMode.AUTO, DirectMode.OFF]


def swap_files(store: FileStore) -> List[str]:
    """Names of the files in the store's directory, less its lock file."""
    return sorted(p.name for p in Path(store.root).iterdir() if p.name != LOCK_NAME)


def on_disk(store: FileStore, key: str) -> np.ndarray:
    """The bytes of extent `key` as a plain buffered read of the swap file sees them."""
    extent = store.extent(key)
    with open(extent.path, "rb") as f:
        f.seek(extent.offset)
        return np.frombuffer(f.read(extent.size_bytes), dtype=np.uint8)


def read_back(store: FileStore, key: str) -> np.ndarray:
    out = np.full(store.extent(key).size_bytes, 0xEE, dtype=np.uint8)
    assert store.read(key, out) == len(out)
    return out


def fill(store: FileStore, random_bytes, seed: int) -> Dict[str, np.ndarray]:
    """Write random bytes to every extent; return them by key."""
    written = {}
    for i, (key, extent) in enumerate(sorted(store.extents.items())):
        written[key] = random_bytes(extent.size_bytes, seed + i)
        assert store.write(key, written[key]) == extent.size_bytes
    return written


def assert_holds(store: FileStore, expected: Dict[str, np.ndarray]) -> None:
    for key, data in expected.items():
        assert np.array_equal(on_disk(store, key), data), f"extent {key!r} changed on disk"
        assert np.array_equal(read_back(store, key), data), f"extent {key!r} reads back changed"


@pytest.mark.parametrize("direct", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("offset", [0, 4097])
@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip(tmp_path, make_engine, make_buffer, buffer_kind, random_bytes, direct, offset, nbytes):
    engine = make_engine(direct=direct)
    with FileStore(engine, tmp_path) as store:
        store.allocate({"before": 4097, "x": offset + nbytes, "after": 4097})
        neighbours = fill(store, random_bytes, 1)
        payload = random_bytes(nbytes, nbytes)
        src = make_buffer(buffer_kind, nbytes)
        src.data[:nbytes] = payload
        assert store.write("x", src.obj, offset, src.size) == nbytes
        assert np.array_equal(on_disk(store, "x")[offset:], payload)
        assert np.array_equal(on_disk(store, "x")[:offset], neighbours["x"][:offset])

        dst = make_buffer(buffer_kind, nbytes)
        dst.data[:] = 0x5A
        assert store.pread("x", dst.obj, offset, dst.size).wait() == nbytes
        assert np.array_equal(dst.data[:nbytes], payload)
        assert (dst.data[nbytes:] == 0x5A).all()
        del neighbours["x"]
        assert_holds(store, neighbours)


def test_round_trip_64_mib(tmp_path, make_engine, random_bytes):
    offset = 4097
    engine = make_engine(num_threads=4, queue_depth=16, block_bytes=MiB, direct=DirectMode.AUTO)
    payload = random_bytes(64 * MiB, 64)
    with FileStore(engine, tmp_path) as store:
        store.allocate({"small": 4097, "big": offset + 64 * MiB})
        small = random_bytes(4097, 1)
        store.write("small", small)
        src = aligned_empty(64 * MiB)
        src.numpy()[:] = payload
        assert store.pwrite("big", src, offset).wait() == 64 * MiB
        out = np.empty(64 * MiB + 1, dtype=np.uint8)[1:]
        assert store.read("big", out, offset) == 64 * MiB
        assert np.array_equal(out, payload)
        assert np.array_equal(on_disk(store, "big")[offset:], payload)
        assert_holds(store, {"small": small})


def test_extents_are_aligned_disjoint_and_preallocated(tmp_path, make_engine):
    engine = make_engine()
    with FileStore(engine, tmp_path) as store:
        sizes = {"a": 1, "b": 4095, "c": 4096, "d": 4097, "empty": 0, "e": MiB + 1}
        made = store.allocate(sizes)
        assert [e.key for e in made] == list(sizes)
        assert store.extents == {e.key: e for e in made}
        assert all(isinstance(e, Extent) and e.size_bytes == sizes[e.key] for e in made)
        assert len({e.path for e in made}) == 1
        assert [e.offset for e in made] == [0, 4096, 8192, 12288, 20480, 24576]
        total = 24576 + MiB + 4096
        assert os.path.getsize(made[0].path) == total
        assert os.stat(made[0].path).st_blocks * 512 >= total  # reserved, not a sparse file
        assert store.allocated_bytes == total


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 3 * 4096])
def test_full_extent_write_leaves_neighbours_unchanged(tmp_path, make_engine, random_bytes, size):
    engine = make_engine(direct=DirectMode.ON)
    with FileStore(engine, tmp_path) as store:
        store.allocate({"left": 4097, "middle": size, "right": 4095})
        before = fill(store, random_bytes, 10)
        new = random_bytes(size, 99)
        assert store.write("middle", new) == size
        assert np.array_equal(read_back(store, "middle"), new)
        assert np.array_equal(on_disk(store, "middle"), new)
        assert_holds(store, {"left": before["left"], "right": before["right"]})


def test_requests_outside_an_extent_are_refused_and_change_nothing(tmp_path, make_engine, random_bytes):
    engine = make_engine()
    with FileStore(engine, tmp_path) as store:
        store.allocate({"left": 4096, "middle.param": 4097, "right": 4096})
        before = fill(store, random_bytes, 20)
        swap_file = Path(store.extent("left").path).read_bytes()
        too_long = bytearray(b"\xff" * 4098)
        with pytest.raises(ValueError) as info:
            store.write("middle.param", too_long)
        assert "'middle.param'" in str(info.value) and "4098 bytes" in str(info.value)
        with pytest.raises(ValueError, match="'middle.param'"):
            store.pwrite("middle.param", too_long, offset=1, size=4097)
        with pytest.raises(ValueError, match="'middle.param'"):
            store.write("middle.param", b"\xff", offset=4097)
        with pytest.raises(ValueError, match="'middle.param'"):
            store.write("middle.param", b"\xff", offset=-1)
        with pytest.raises(ValueError, match="'middle.param'"):
            store.read("middle.param", bytearray(4098))
        assert Path(store.extent("left").path).read_bytes() == swap_file
        assert_holds(store, before)


def test_store_is_private(tmp_path, make_engine):
    engine = make_engine()
    old_umask = os.umask(0)  # even with a permissive umask
    try:
        store = FileStore(engine, tmp_path / "scratch")
        store.allocate({"a": 10})
        store.allocate({"b": 10})
    finally:
        os.umask(old_umask)
    assert Path(store.root).parent == tmp_path / "scratch"
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    files = sorted(Path(store.root).iterdir())
    assert [f.name for f in files] == [LOCK_NAME, "swap-0000.bin", "swap-0001.bin"]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    store.close()


def test_close_removes_files_and_directory(tmp_path, make_engine):
    engine = make_engine()
    store = FileStore(engine, tmp_path)
    store.allocate({"a": 4097})
    store.allocate({"b": 1})
    store.write("a", b"x" * 4097)
    root = Path(store.root)
    assert swap_files(store) == ["swap-0000.bin", "swap-0001.bin"]
    store.close()
    assert not root.exists()
    assert tmp_path.exists()
    store.close()  # idempotent
    calls = [lambda: store.write("a", b"x"), lambda: store.read("a", bytearray(1)), lambda: store.allocate({"c": 1})]
    for call in calls:
        with pytest.raises(ValueError, match="closed"):
            call()
    with FileStore(engine, tmp_path) as store:
        store.allocate({"a": 1})
        root = Path(store.root)
    assert not root.exists()


def test_a_close_interrupted_by_a_signal_still_removes_everything(tmp_path, make_engine, monkeypatch):
    """SIGTERM (or Ctrl-C) arriving while a finished run's engine removed its swap files raised in the
    middle of the removal: the directory stayed (until a later run in that directory reclaimed it)
    while the run's last line said the swap files were removed. The removal is finished first."""
    engine = make_engine()
    store = FileStore(engine, tmp_path)
    store.allocate({"a": 4097})
    store.allocate({"b": 1})
    root = Path(store.root)
    unlink, calls = os.unlink, []

    def interrupted_once(path, *args, **kwargs):  # the signal's exception, right after the first file went
        unlink(path, *args, **kwargs)
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "unlink", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        store.close()
    monkeypatch.undo()
    assert not root.exists() and len(calls) == 3  # both swap files and the lock file
    store.close()  # closed: nothing more happens


def test_forgotten_store_is_removed_when_collected(tmp_path, make_engine):
    engine = make_engine()
    store = FileStore(engine, tmp_path)
    store.allocate({"a": 4097})
    root = Path(store.root)
    del store
    gc.collect()
    assert not root.exists()


def test_several_allocations(tmp_path, make_engine, random_bytes):
    engine = make_engine()
    with FileStore(engine, tmp_path) as store:
        first = store.allocate({"a": 4097, "b": 1})
        second = store.allocate({"c": 4095})
        third = store.allocate({"d": MiB + 1, "e": 4096})
        assert len({first[0].path, second[0].path, third[0].path}) == 3
        assert second[0].offset == 0 and third[0].offset == 0
        assert sorted(store.extents) == ["a", "b", "c", "d", "e"]
        assert store.allocate({}) == []
        assert len(swap_files(store)) == 3
        assert_holds(store, fill(store, random_bytes, 30))


def test_free_gives_a_file_back_once_all_its_extents_are_freed_and_never_reuses_a_name(
    tmp_path, make_engine, random_bytes
):
    engine = make_engine()
    with FileStore(engine, tmp_path) as store:
        store.allocate({"a": 4097, "b": 1})
        store.allocate({"c": 3 * 4096})
        before = store.allocated_bytes
        store.free("a")  # "b" shares its file: the space stays reserved
        assert sorted(store.extents) == ["b", "c"] and store.allocated_bytes == before
        assert swap_files(store) == ["swap-0000.bin", "swap-0001.bin"]
        with pytest.raises(KeyError, match="'a'.*known: b, c"):
            store.write("a", b"x")
        store.free("b")
        assert swap_files(store) == ["swap-0001.bin"] and store.allocated_bytes == 3 * 4096
        with pytest.raises(KeyError, match="no extent 'b'"):
            store.free("b")
        # A new allocation never lands on a live file's name (the count of files made names it).
        store.allocate({"a": 4096})
        assert swap_files(store) == ["swap-0001.bin", "swap-0002.bin"]
        assert store.extent("a").path.endswith("swap-0002.bin")
        assert_holds(store, fill(store, random_bytes, 31))
    with pytest.raises(ValueError, match="closed"):
        store.free("a")


def test_duplicate_key_is_refused_and_allocates_nothing(tmp_path, make_engine):
    engine = make_engine()
    with FileStore(engine, tmp_path) as store:
        store.allocate({"layer0.param": 4096})
        with pytest.raises(ValueError) as info:
            store.allocate({"fresh": 10, "layer0.param": 4096})
        assert "'layer0.param' is already allocated" in str(info.value) and store.root in str(info.value)
        assert sorted(store.extents) == ["layer0.param"]
        assert len(swap_files(store)) == 1


@pytest.mark.parametrize(
    "sizes, match",
    [
        ({"": 1}, "key ''"),
        ({3: 1}, "key 3"),
        ({"k": -1}, "'k' size -1"),
        ({"k": 1.5}, "'k' size 1.5"),
        ({"k": True}, "'k' size True"),
    ],
)
def test_bad_keys_and_sizes(tmp_path, make_engine, sizes, match):
    engine = make_engine()
    with FileStore(engine, tmp_path) as store:
        with pytest.raises(ValueError, match=match):
            store.allocate({"good": 1, **sizes})
        assert store.extents == {} and swap_files(store) == []


def test_unknown_key_names_the_known_ones(tmp_path, make_engine):
    engine = make_engine()
    with FileStore(engine, tmp_path) as store:
        store.allocate({"a": 1, "b": 2})
        with pytest.raises(KeyError, match="no extent 'z' in this store \\(known: a, b\\)"):
            store.read("z", bytearray(1))


def test_directory_handling(tmp_path, make_engine):
    engine = make_engine()
    (tmp_path / "a_file").write_bytes(b"")
    with pytest.raises(ValueError, match="exists but is not a directory"):
        FileStore(engine, tmp_path / "a_file")
    with FileStore(engine, tmp_path / "new" / "nested") as store:
        assert Path(store.root).parent == tmp_path / "new" / "nested"
        assert Path(store.root).name.startswith(f"offload-swap-{os.getpid()}-")


def test_not_enough_space_for_a_petabyte(tmp_path, make_engine):
    engine = make_engine()
    with FileStore(engine, tmp_path) as store:
        with pytest.raises(NotEnoughSpaceError) as info:
            store.allocate({"huge": 2**50})
        err = info.value
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC
        assert err.needed_bytes == 2**50 and err.directory == store.root
        assert 0 <= err.free_bytes < 2**50
        assert f"need {2**50} bytes" in str(err) and f"has {err.free_bytes} bytes" in str(err)
        assert swap_files(store) == [] and store.extents == {}
        store.allocate({"small": 1})  # the store is still usable


def test_not_enough_space_as_reported_by_the_file_system(tmp_path, make_engine, monkeypatch):
    engine = make_engine()
    monkeypatch.setattr(io_engine.file_store, "free_bytes", lambda path: 10000)
    with FileStore(engine, tmp_path) as store:
        with pytest.raises(NotEnoughSpaceError) as info:
            store.allocate({"a": 4096, "b": 4097})  # 12288 bytes once aligned
        message = str(info.value)
        assert "need 12288 bytes" in message and "has 10000 bytes" in message and "free 2288 more bytes" in message
        assert swap_files(store) == []
        assert store.allocate({"fits": 8192})[0].size_bytes == 8192


@pytest.mark.parametrize("err, raised", [(errno.ENOSPC, NotEnoughSpaceError), (errno.EIO, TransferError)])
def test_failed_preallocation_leaves_no_file(tmp_path, make_engine, monkeypatch, err, raised):
    engine = make_engine()

    def refuse(fd, offset, length):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(io_engine.file_store.os, "posix_fallocate", refuse)
    with FileStore(engine, tmp_path) as store:
        with pytest.raises(raised) as info:
            store.allocate({"a": 4097})
        assert info.value.errno == err
        assert swap_files(store) == [] and store.extents == {}


@pytest.mark.parametrize("err", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_a_file_system_that_cannot_preallocate_gets_a_sparse_swap_file(tmp_path, make_engine, monkeypatch, random_bytes, err):
    """musl (Alpine images) does not emulate posix_fallocate: on ZFS before 2.2 or some network file
    systems it fails, and allocate() raised TransferError, so no run could put anything on NVMe there."""
    engine = make_engine()

    def unsupported(fd, offset, length):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(io_engine.file_store.os, "posix_fallocate", unsupported)
    with FileStore(engine, tmp_path) as store:
        (extent,) = store.allocate({"a": 3 * 4096 + 1})
        assert os.path.getsize(extent.path) == 4 * 4096
        data = random_bytes(3 * 4096 + 1, 7)
        store.write("a", data)
        back = np.zeros_like(data)
        store.read("a", back)
        assert np.array_equal(back, data)


def test_free_bytes_of_a_directory_not_made_yet_is_its_parents(tmp_path) -> None:
    from io_engine.file_store import existing_ancestor, free_bytes

    missing = tmp_path / "not" / "made" / "yet"
    assert existing_ancestor(str(missing)) == str(tmp_path)
    assert abs(free_bytes(str(missing)) - free_bytes(str(tmp_path))) < 64 << 20  # other writers may run


def _mount_types() -> Dict[str, str]:
    """Mount point -> file-system type, from /proc/self/mounts (the last mount of a point wins)."""
    try:
        lines = Path("/proc/self/mounts").read_text(encoding="utf-8").splitlines()
    except OSError:
        return {}
    return {fields[1]: fields[2] for fields in (line.split() for line in lines) if len(fields) > 2}


def test_memory_file_system_names_tmpfs_and_nothing_on_a_disk(tmp_path) -> None:
    """Swap files on tmpfs are host memory: the planner counts them so (planning/planner.py resident_host_bytes)."""
    from io_engine.file_store import memory_file_system

    mounts = _mount_types()
    if mounts.get("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    assert memory_file_system("/dev/shm") == "tmpfs"
    assert memory_file_system("/dev/shm/not/made/yet") == "tmpfs"  # its nearest existing parent's
    disk = next((point for point, kind in mounts.items() if kind in ("ext4", "xfs", "btrfs") and os.path.isdir(point)), None)
    if disk is not None:
        assert memory_file_system(disk) is None


@pytest.mark.parametrize("direct", MODES, ids=lambda m: m.value)
def test_several_extents_move_as_one_request(tmp_path, make_engine, make_buffer, buffer_kind, random_bytes, direct):
    """pread_many/pwrite_many: one handle for every part, each part where pread/pwrite would put it."""
    engine = make_engine(direct=direct)
    sizes = {"a": 1, "b": 4097, "c": MiB + 1, "d": 4096}
    with FileStore(engine, tmp_path) as store:
        store.allocate(sizes)
        untouched = fill(store, random_bytes, 3)
        parts = [("c", 1), ("a", 0), ("b", 4000)]  # any order, any offset within each extent
        payloads = {key: random_bytes(sizes[key] - offset, len(key) + offset) for key, offset in parts}
        sources = {}
        for key, offset in parts:
            sources[key] = make_buffer(buffer_kind, sizes[key] - offset)
            sources[key].data[: len(payloads[key])] = payloads[key]
        # A bf16 buffer of an odd byte count is one byte longer: write exactly the payload's bytes.
        write = [(key, sources[key].obj if sources[key].size is None else sources[key].data[: sizes[key] - offset], offset)
                 for key, offset in parts]
        handle = store.pwrite_many(write)
        assert handle.wait() == sum(len(p) for p in payloads.values())
        for key, offset in parts:
            assert np.array_equal(on_disk(store, key)[offset:], payloads[key])
            assert np.array_equal(on_disk(store, key)[:offset], untouched[key][:offset])
        assert_holds(store, {"d": untouched["d"]})

        outs = {key: np.full(sizes[key] - offset + 1, 0x5A, dtype=np.uint8) for key, offset in parts}
        handle = store.pread_many([(key, outs[key][:-1], offset) for key, offset in parts])
        assert handle.wait() == sum(len(p) for p in payloads.values())
        for key, _ in parts:
            assert np.array_equal(outs[key][:-1], payloads[key]) and outs[key][-1] == 0x5A


def test_one_request_of_several_extents_is_refused_across_files_or_empty(tmp_path, make_engine):
    with FileStore(make_engine(), tmp_path) as store:
        store.allocate({"a": 4096})
        store.allocate({"b": 4096})
        buf = np.zeros(4096, dtype=np.uint8)
        with pytest.raises(ValueError, match="different swap files"):
            store.pread_many([("a", buf, 0), ("b", buf.copy(), 0)])
        with pytest.raises(ValueError, match="at least one"):
            store.pwrite_many([])
        with pytest.raises(ValueError, match="outside extent 'a'"):
            store.pwrite_many([("a", np.zeros(4097, dtype=np.uint8), 0)])
