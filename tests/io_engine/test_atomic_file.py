"""atomic_file: files replaced all at once, never through a symlink, leaving no temporary behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from io_engine.atomic_file import (
    STALE_TEMPORARY_S,
    TEMP_MARKER,
    atomic_open,
    fsync_dir,
    make_dirs,
    open_append,
    open_exclusive,
    remove_stale_temporaries,
    write_atomic,
)
from tests.forked_kill import killed_at


def temporaries(directory: Path) -> list:
    return [p.name for p in directory.iterdir() if TEMP_MARKER in p.name]


@pytest.mark.parametrize("data", ["text, é\n", b"\x00bytes\xff"], ids=["text", "bytes"])
def test_write_atomic_replaces_the_file(tmp_path, data):
    target = tmp_path / "config.json"
    target.write_bytes(b"old contents, longer than the new ones")
    write_atomic(target, data)
    expected = data.encode("utf-8") if isinstance(data, str) else data
    assert target.read_bytes() == expected
    assert temporaries(tmp_path) == []


def test_write_atomic_creates_a_missing_file(tmp_path):
    write_atomic(str(tmp_path / "new.txt"), "x")
    assert (tmp_path / "new.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.txt"]


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("not yours")
    target = tmp_path / "out" / "model.bin"
    target.parent.mkdir()
    target.symlink_to(elsewhere)
    write_atomic(target, b"new")
    assert not target.is_symlink() and target.read_bytes() == b"new"
    assert elsewhere.read_text() == "not yours"
    assert temporaries(target.parent) == []


def test_an_exception_inside_atomic_open_keeps_the_old_file(tmp_path):
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_open(target) as f:
            f.write(b"half of the new")
            raise RuntimeError("interrupted")
    assert target.read_bytes() == b"old"
    assert temporaries(tmp_path) == []


def test_atomic_open_streams_text(tmp_path):
    target = tmp_path / "log.txt"
    with atomic_open(target, binary=False) as f:
        f.write("a\n")
        f.write("b\n")
        assert not target.exists(), "the target appeared before the block ended"
    assert target.read_text() == "a\nb\n"


def test_open_append_appends_and_refuses_a_symlink(tmp_path):
    log = tmp_path / "log.txt"
    for line in ("one\n", "two\n"):
        with open_append(log) as f:
            f.write(line)
    assert log.read_text() == "one\ntwo\n"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("untouched")
    link = tmp_path / "link.txt"
    link.symlink_to(elsewhere)
    with pytest.raises(OSError):
        open_append(link)
    assert elsewhere.read_text() == "untouched"


def test_open_exclusive_refuses_an_existing_name(tmp_path):
    path = tmp_path / "made"
    fd = open_exclusive(path)
    try:
        os.write(fd, b"first")
    finally:
        os.close(fd)
    with pytest.raises(FileExistsError):
        open_exclusive(path)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        open_exclusive(dangling)
    assert not (tmp_path / "nowhere").exists()
    assert path.read_bytes() == b"first"


def _fsync_of_directories_fails_with(monkeypatch, code):
    import stat

    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("code", ["EINVAL", "EOPNOTSUPP", "EBADF"])
def test_a_file_system_that_cannot_fsync_a_directory_still_takes_atomic_files(tmp_path, monkeypatch, code):
    """SMB/CIFS and some FUSE or 9p mounts refuse fsync of a directory: every checkpoint and config
    write of a run there failed ("Invalid argument"); the rename is as durable as they make it."""
    import errno

    _fsync_of_directories_fails_with(monkeypatch, getattr(errno, code))
    write_atomic(tmp_path / "config.json", "{}")
    assert (tmp_path / "config.json").read_text() == "{}"
    fsync_dir(tmp_path)


def test_other_directory_fsync_errors_still_raise(tmp_path, monkeypatch):
    import errno

    _fsync_of_directories_fails_with(monkeypatch, errno.EIO)
    with pytest.raises(OSError) as raised:
        write_atomic(tmp_path / "config.json", "{}")
    assert raised.value.errno == errno.EIO


def test_the_next_write_removes_what_a_killed_write_of_the_same_file_left(tmp_path: Path) -> None:
    """offload-plan --write-config planned.toml (or any write_atomic) SIGKILLed before each of its
    file-system changes: the file is the old one or the new one, and the next write of it removes
    the killed one's temporary (it stayed for good): at once, or once it is stale if the kill came
    before anything was written into it; another file's is left alone."""
    kills = 0
    for n in range(1, 20):
        target = tmp_path / f"trial{n}" / "planned.toml"
        target.parent.mkdir()
        target.write_text("old")
        (target.parent / "other.toml.tmp-0123456789abcdef").write_text("not this file's")
        if not killed_at(n, lambda: write_atomic(target, "new")):
            break
        kills += 1
        assert target.read_text() in ("old", "new"), f"killed before change {n}"
        write_atomic(target, "again")
        for left in target.parent.glob("planned.toml.tmp-*"):  # killed between its creation and its first byte
            assert left.stat().st_size == 0, f"killed before change {n}: {left.name} was not removed"
            long_ago = left.stat().st_mtime - STALE_TEMPORARY_S - 1
            os.utime(left, (long_ago, long_ago))  # the next write, later
            write_atomic(target, "again")
        assert sorted(p.name for p in target.parent.iterdir()) == ["other.toml.tmp-0123456789abcdef", "planned.toml"]
        assert target.read_text() == "again"
    assert kills >= 2, "the sweep never reached the write"


@pytest.mark.parametrize("name", ["c" * 250 + ".toml", "é" * 125, "config.toml"], ids=["ascii-255", "utf8-250", "short"])
def test_a_name_near_the_length_limit_is_written_and_its_leftovers_found(tmp_path: Path, name: str) -> None:
    """A name of up to 255 bytes is valid, but its temporary (21 bytes longer) was not: offload-plan
    --write-config <a 245-byte name> ended with "File name too long". The temporary's name is cut
    short instead, by whole characters, and a killed writer's is still found by the next write."""
    target = tmp_path / name
    write_atomic(target, "first")
    assert target.read_text() == "first" and temporaries(tmp_path) == []
    with pytest.raises(RuntimeError):
        with atomic_open(target, binary=False) as f:
            f.write("partial")
            f.flush()
            (left,) = temporaries(tmp_path)  # as a killed writer would leave it
            assert len(os.fsencode(left)) <= 255 and left.encode("utf-8").decode("utf-8") == left
            os.link(tmp_path / left, tmp_path / "kept")
            raise RuntimeError("killed")
    os.rename(tmp_path / "kept", tmp_path / left)
    assert remove_stale_temporaries(target) == [tmp_path / left]
    write_atomic(target, "second")
    assert target.read_text() == "second" and temporaries(tmp_path) == []


def test_only_a_temporary_no_writer_holds_is_removed(tmp_path: Path) -> None:
    """A live writer holds the flock of its temporary (atomic_open): it is left alone, however old;
    an empty one is left while it is young (the instant between its creation and its lock)."""
    import fcntl
    import time

    target = tmp_path / "planned.toml"
    long_ago = time.time() - STALE_TEMPORARY_S - 60
    names = {"live": "planned.toml.tmp-1", "young_empty": "planned.toml.tmp-2", "old_empty": "planned.toml.tmp-3",
             "killed": "planned.toml.tmp-4"}
    with atomic_open(target) as writing:  # a live writer: its temporary is locked
        for what, name in names.items():  # left meanwhile (atomic_open removed those there before it)
            (tmp_path / name).write_text("" if "empty" in what else "half written")
            if what != "young_empty":
                os.utime(tmp_path / name, (long_ago, long_ago))
        os.mkdir(tmp_path / "planned.toml.tmp-5")  # a directory (atomic_dir's): never this function's
        with open(tmp_path / names["live"], "rb") as held:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)
            removed = remove_stale_temporaries(target)
        mine = [n for n in os.listdir(tmp_path) if n.startswith("planned.toml.tmp-") and n not in names.values()]
        assert len(mine) == 2  # atomic_open's own temporary, still there, and the directory
        writing.write(b"x")
    assert sorted(p.name for p in removed) == sorted([names["killed"], names["old_empty"]])
    assert sorted(os.listdir(tmp_path)) == ["planned.toml", names["live"], names["young_empty"], "planned.toml.tmp-5"]


def test_make_dirs_makes_each_new_directory_durable_outermost_first(tmp_path: Path, monkeypatch) -> None:
    """A new directory's entry is as volatile as a rename's: its parent is fsynced, for each one made."""
    import io_engine.atomic_file as atomic_file

    synced: list = []
    real = atomic_file.fsync_dir
    monkeypatch.setattr(atomic_file, "fsync_dir", lambda d: (synced.append(Path(d)), real(d))[1])
    (tmp_path / "a").mkdir()
    make_dirs(tmp_path / "a" / "b" / "c")
    assert (tmp_path / "a" / "b" / "c").is_dir() and synced == [tmp_path / "a", tmp_path / "a" / "b"]
    os.symlink(tmp_path / "a", tmp_path / "link")
    synced.clear()
    make_dirs(tmp_path / "a" / "b" / "c")
    make_dirs(tmp_path / "link")  # a symlink to a directory is one (a scratch out_dir often is)
    assert synced == []
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="file"):
        make_dirs(tmp_path / "file" / "d")
