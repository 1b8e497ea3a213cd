"""Tests of offload_trainer/machine.py: measured rates, the test file's cleanup, and the rate cache.

Real measurements use 8 MiB and small IO settings so they take a fraction of a second; the cache
tests swap measure_rates for a counting stand-in. No test asserts how fast anything was.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

import io_engine.file_store
import offload_trainer.planning.machine as machine
from io_engine import FileStore, IOConfig
from offload_trainer.planning.machine import MachineRates, default_cache_path, machine_key, machine_rates, measure_rates

MiB = 1 << 20

SIZE_BYTES = 8 << 20
SMALL_IO = IOConfig(num_threads=2, queue_depth=4, block_bytes=1 << 20)
CPU = torch.device("cpu")
FAKE_RATES = MachineRates(
    nvme_read_bytes_per_s=2e9,
    nvme_write_bytes_per_s=1e9,
    nvme_direct_io=True,
    host_to_device_bytes_per_s=1e10,
    device_to_host_bytes_per_s=9e9,
    adamw_elements_per_s=1e9,
    sgd_elements_per_s=2e9,
)


def io_engine_threads() -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("io_engine-")]


def tree(directory: Path) -> List[str]:
    """Every path under `directory`, relative to it."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


class CountingMeasure:
    """Stands in for measure_rates: returns FAKE_RATES and records each call's arguments."""

    def __init__(self) -> None:
        self.calls: List[Dict[str, Any]] = []

    def __call__(self, nvme_dir: Optional[str], io: IOConfig, device: torch.device, **kwargs: Any) -> MachineRates:
        self.calls.append({"nvme_dir": nvme_dir, "io": io, "device": device, **kwargs})
        return FAKE_RATES


@pytest.fixture
def counting_measure(monkeypatch: pytest.MonkeyPatch) -> CountingMeasure:
    measure = CountingMeasure()
    monkeypatch.setattr(machine, "measure_rates", measure)
    return measure


# -- measuring -----------------------------------------------------------------------------------


def test_measured_rates_are_positive_and_finite_and_the_test_file_is_gone(tmp_path: Path) -> None:
    nvme_dir = tmp_path / "nvme"
    messages: List[str] = []
    rates = measure_rates(str(nvme_dir), SMALL_IO, CPU, size_bytes=SIZE_BYTES, repeats=2, progress=messages.append)
    for name, value in rates.to_dict().items():
        if name == "nvme_direct_io":
            assert isinstance(value, bool)
        else:
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
    assert tree(nvme_dir) == []  # FileStore's private directory and the test file are removed
    assert not io_engine_threads()
    text = "\n".join(messages)
    for what in ("NVMe write (8 MiB)", "NVMe read (8 MiB)", "host-to-device", "device-to-host", "AdamW", "SGD"):
        assert f"measuring {what}" in text, (what, messages)


def test_an_unaligned_size_smaller_than_a_block_is_measured(tmp_path: Path) -> None:
    rates = measure_rates(str(tmp_path), SMALL_IO, CPU, size_bytes=4096 * 10 + 1, repeats=1)
    assert rates.nvme_read_bytes_per_s is not None and rates.nvme_read_bytes_per_s > 0
    assert tree(tmp_path) == []


def test_the_measurement_buffers_keep_within_the_memory_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a 400 MiB container `placement = "auto"` was OOM-killed while it measured (two 256 MiB copy
    buffers on a CPU, then 256 MiB of optimizer tensors), before it could plan or say anything."""
    sizes: Dict[str, int] = {}

    def copies(device: torch.device, nbytes: int, repeats: int, progress: Any) -> tuple:
        sizes["copy"] = nbytes
        return 1e9, 1e9

    def optimizers(numel: int, repeats: int, progress: Any) -> tuple:
        sizes["optimizer"] = numel * machine.OPTIMIZER_TENSORS * 4
        return 1e9, 1e9

    monkeypatch.setattr(machine, "_measure_copies", copies)
    monkeypatch.setattr(machine, "_measure_optimizers", optimizers)
    monkeypatch.setattr(machine, "memory_available_bytes", lambda: 64 * MiB, raising=False)
    measure_rates(None, IOConfig(), torch.device("cpu"))
    assert 2 * sizes["copy"] <= 16 * MiB and sizes["optimizer"] <= 16 * MiB, sizes
    monkeypatch.setattr(machine, "memory_available_bytes", lambda: 64 * 2**30)  # plenty: the full default size
    measure_rates(None, IOConfig(), torch.device("cpu"))
    assert sizes == {"copy": machine.MAX_COPY_BYTES, "optimizer": machine.DEFAULT_SIZE_BYTES}


def test_no_nvme_dir_gives_no_nvme_rates(tmp_path: Path) -> None:
    rates = measure_rates(None, SMALL_IO, CPU, size_bytes=SIZE_BYTES, repeats=1)
    assert rates.nvme_read_bytes_per_s is None
    assert rates.nvme_write_bytes_per_s is None
    assert rates.nvme_direct_io is None
    assert rates.host_to_device_bytes_per_s > 0 and rates.adamw_elements_per_s > 0
    assert machine_key(None, SMALL_IO, CPU)["nvme"] is None


@pytest.mark.parametrize("error", [RuntimeError("injected"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
def test_the_test_file_is_removed_when_measuring_is_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    seen_files: List[List[str]] = []
    real_pread = FileStore.pread

    def failing_pread(self: FileStore, key: str, buf: Any, offset: int = 0, size: Optional[int] = None) -> Any:
        if offset >= 2 * SMALL_IO.block_bytes:  # some reads are in flight by now
            seen_files.append(tree(tmp_path))
            raise error
        return real_pread(self, key, buf, offset, size)

    monkeypatch.setattr(FileStore, "pread", failing_pread)
    with pytest.raises(type(error)):
        measure_rates(str(tmp_path), SMALL_IO, CPU, size_bytes=SIZE_BYTES, repeats=1)
    assert seen_files and any(name.endswith(".bin") for name in seen_files[0])  # it existed mid-measure
    assert tree(tmp_path) == []
    assert not io_engine_threads()


def test_too_little_free_space_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(io_engine.file_store, "free_bytes", lambda path: 1 << 20)
    with pytest.raises(ValueError, match=r"8388608 bytes.*1048576 bytes.*smaller size_bytes"):
        measure_rates(str(tmp_path), SMALL_IO, CPU, size_bytes=SIZE_BYTES, repeats=1)
    assert tree(tmp_path) == []
    assert not io_engine_threads()


def test_the_default_test_file_fits_a_nearly_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """offload-train's placement = "auto" measures with the default size, which its user cannot change: a
    swap directory with less than 256 MiB free (ample for a small model's swap files) was refused with
    "pass a smaller size_bytes". The default file takes at most half the free space, in whole blocks."""
    monkeypatch.setattr(io_engine.file_store, "free_bytes", lambda path: 7 * MiB)
    monkeypatch.setattr(machine, "_measure_copies", lambda device, nbytes, repeats, progress: (1e9, 1e9))
    monkeypatch.setattr(machine, "_measure_optimizers", lambda numel, repeats, progress: (1e9, 1e9))
    allocated: List[int] = []
    real_allocate = FileStore.allocate

    def allocate(self: FileStore, sizes: Dict[str, int], labels: Any = None) -> Any:
        allocated.extend(sizes.values())
        return real_allocate(self, sizes, labels)

    monkeypatch.setattr(FileStore, "allocate", allocate)
    rates = measure_rates(str(tmp_path), SMALL_IO, CPU, repeats=1)
    assert rates.nvme_read_bytes_per_s is not None and rates.nvme_read_bytes_per_s > 0
    assert allocated == [3 * MiB]  # half of 7 MiB, in whole 1 MiB blocks
    assert machine.nvme_test_file_bytes(str(tmp_path), SMALL_IO, None) == 3 * MiB
    monkeypatch.setattr(io_engine.file_store, "free_bytes", lambda path: 1 << 40)
    assert machine.nvme_test_file_bytes(str(tmp_path), SMALL_IO, None) == machine.DEFAULT_SIZE_BYTES
    assert tree(tmp_path) == []


def test_a_disk_without_room_for_one_block_names_the_nvme_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(io_engine.file_store, "free_bytes", lambda path: 1 * MiB)
    with pytest.raises(ValueError, match=rf"NVMe directory {tmp_path} .*1 MiB free.*tiers.nvme_dir"):
        measure_rates(str(tmp_path), SMALL_IO, CPU, repeats=1)
    assert tree(tmp_path) == []
    assert not io_engine_threads()


@pytest.mark.parametrize("size_bytes", [0, -1, 1.5, True])
def test_a_bad_size_is_a_value_error(size_bytes: Any) -> None:
    with pytest.raises(ValueError, match="size_bytes"):
        measure_rates(None, SMALL_IO, CPU, size_bytes=size_bytes)


def test_bad_repeats_and_devices_are_value_errors() -> None:
    with pytest.raises(ValueError, match="repeats"):
        measure_rates(None, SMALL_IO, CPU, size_bytes=SIZE_BYTES, repeats=0)
    with pytest.raises(ValueError, match="meta"):
        measure_rates(None, SMALL_IO, torch.device("meta"), size_bytes=SIZE_BYTES)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            measure_rates(None, SMALL_IO, torch.device("cuda"), size_bytes=SIZE_BYTES)


# -- MachineRates ------------------------------------------------------------------------------


def test_rates_round_trip_through_json() -> None:
    assert MachineRates.from_dict(json.loads(json.dumps(FAKE_RATES.to_dict()))) == FAKE_RATES
    no_nvme = {**FAKE_RATES.to_dict(), "nvme_read_bytes_per_s": None, "nvme_write_bytes_per_s": None}
    no_nvme["nvme_direct_io"] = None
    assert MachineRates.from_dict(no_nvme).nvme_read_bytes_per_s is None


@pytest.mark.parametrize(
    "change",
    [
        {"adamw_elements_per_s": -1.0},
        {"sgd_elements_per_s": float("inf")},
        {"host_to_device_bytes_per_s": "fast"},
        {"nvme_read_bytes_per_s": None},  # half of the NVMe fields missing
        {"extra": 1.0},
    ],
)
def test_bad_rates_are_refused(change: Dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MachineRates.from_dict({**FAKE_RATES.to_dict(), **change})


# -- the cache -------------------------------------------------------------------------------


def test_a_cache_hit_does_not_measure_again(tmp_path: Path, counting_measure: CountingMeasure) -> None:
    cache = tmp_path / "cache" / "deeper" / "machine.json"  # directories are made
    rates, from_cache = machine_rates(str(tmp_path), SMALL_IO, CPU, cache_path=cache)
    assert (rates, from_cache) == (FAKE_RATES, False)
    assert len(counting_measure.calls) == 1

    messages: List[str] = []
    rates, from_cache = machine_rates(str(tmp_path), SMALL_IO, CPU, cache_path=cache, progress=messages.append)
    assert (rates, from_cache) == (FAKE_RATES, True)
    assert len(counting_measure.calls) == 1
    assert any(str(cache) in m for m in messages)
    assert sorted(os.listdir(cache.parent)) == ["machine.json"]  # no temporary file left


def test_a_real_measurement_is_cached_and_then_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "machine.json"
    nvme_dir = tmp_path / "nvme"
    measured, from_cache = machine_rates(
        str(nvme_dir), SMALL_IO, CPU, cache_path=cache, size_bytes=SIZE_BYTES, repeats=1
    )
    assert not from_cache

    def must_not_measure(*args: Any, **kwargs: Any) -> MachineRates:
        raise AssertionError("measured again despite a cache hit")

    monkeypatch.setattr(machine, "measure_rates", must_not_measure)
    cached, from_cache = machine_rates(str(nvme_dir), SMALL_IO, CPU, cache_path=cache)
    assert from_cache and cached == measured
    (entry,) = json.loads(cache.read_text())["entries"].values()
    assert entry["key"] == machine_key(str(nvme_dir), SMALL_IO, CPU)
    assert entry["size_bytes"] == SIZE_BYTES and isinstance(entry["measured_at_unix_s"], float)


@pytest.mark.parametrize(
    "other",
    [
        {"nvme_dir": "other"},
        {"nvme_dir": None},
        {"io": IOConfig(num_threads=2, queue_depth=8, block_bytes=1 << 20)},
        {"io": IOConfig(num_threads=2, queue_depth=4, block_bytes=1 << 20, direct="off")},
        {"threads": True},
    ],
    ids=["nvme_dir", "no_nvme_dir", "queue_depth", "direct", "torch_threads"],
)
def test_a_different_machine_key_measures_again(
    tmp_path: Path, counting_measure: CountingMeasure, monkeypatch: pytest.MonkeyPatch, other: Dict[str, Any]
) -> None:
    cache = tmp_path / "machine.json"
    first_dir = tmp_path / "nvme"
    machine_rates(str(first_dir), SMALL_IO, CPU, cache_path=cache)
    nvme_dir = other.get("nvme_dir", "nvme")
    nvme_dir = str(tmp_path / nvme_dir) if nvme_dir is not None else None
    real_get_num_threads = torch.get_num_threads
    if other.get("threads"):
        monkeypatch.setattr(torch, "get_num_threads", lambda: real_get_num_threads() + 1)
    _, from_cache = machine_rates(nvme_dir, other.get("io", SMALL_IO), CPU, cache_path=cache)
    assert not from_cache
    assert len(counting_measure.calls) == 2
    assert len(json.loads(cache.read_text())["entries"]) == 2  # both kept
    monkeypatch.setattr(torch, "get_num_threads", real_get_num_threads)
    assert machine_rates(str(first_dir), SMALL_IO, CPU, cache_path=cache)[1]  # the first still hits


def test_the_key_names_the_file_system_and_the_resolved_path(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    key = machine_key(str(tmp_path / "link"), SMALL_IO, CPU)
    assert key == machine_key(str(tmp_path / "real"), SMALL_IO, CPU)
    assert key["nvme"] == {"path": str((tmp_path / "real").resolve()), "st_dev": os.stat(tmp_path).st_dev}
    assert key["io"]["direct"] == "auto" and key["io"]["queue_depth"] == 4
    assert key["device"] == "cpu" and key["torch"] == torch.__version__
    # A directory not made yet counts by the file system it will be made on.
    assert machine_key(str(tmp_path / "not" / "yet"), SMALL_IO, CPU)["nvme"]["st_dev"] == os.stat(tmp_path).st_dev


@pytest.mark.parametrize("content", [b'{"format": 99, "entries": {}}', b""], ids=["other_format", "empty"])
def test_a_cache_of_another_format_is_replaced(tmp_path: Path, counting_measure: CountingMeasure, content: bytes) -> None:
    cache = tmp_path / "machine.json"
    cache.write_bytes(content)
    rates, from_cache = machine_rates(None, SMALL_IO, CPU, cache_path=cache)
    assert (rates, from_cache) == (FAKE_RATES, False)
    assert len(json.loads(cache.read_text())["entries"]) == 1  # valid again
    assert machine_rates(None, SMALL_IO, CPU, cache_path=cache)[1]


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"\xff\xfe", b"[1, 2]", b'{"my": "notes"}'],
    ids=["bad_json", "not_utf8", "not_an_object", "users_json"],
)
def test_a_file_that_is_no_cache_is_named_and_never_written_over(
    tmp_path: Path, counting_measure: CountingMeasure, content: bytes
) -> None:
    """OFFLOAD_TRAINER_CACHE pointed at a file of the user's: offload-plan replaced it with its cache."""
    cache = tmp_path / "machine.json"
    cache.write_bytes(content)
    with pytest.warns(UserWarning, match=f"{cache}: it is not a cache file .* move it away, or set OFFLOAD_TRAINER_CACHE"):
        rates, from_cache = machine_rates(None, SMALL_IO, CPU, cache_path=cache)
    assert (rates, from_cache) == (FAKE_RATES, False)
    assert cache.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["machine.json"]  # no temporary file left


def test_a_corrupt_entry_warns_and_is_measured_again(tmp_path: Path, counting_measure: CountingMeasure) -> None:
    cache = tmp_path / "machine.json"
    machine_rates(None, SMALL_IO, CPU, cache_path=cache)
    data = json.loads(cache.read_text())
    (entry,) = data["entries"].values()
    entry["rates"]["adamw_elements_per_s"] = "lots"
    cache.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=str(cache)):
        assert machine_rates(None, SMALL_IO, CPU, cache_path=cache) == (FAKE_RATES, False)
    assert len(counting_measure.calls) == 2
    assert machine_rates(None, SMALL_IO, CPU, cache_path=cache)[1]


def test_refresh_measures_again_and_replaces_the_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "machine.json"
    slower = MachineRates(**{**FAKE_RATES.to_dict(), "adamw_elements_per_s": 5e8})
    results = iter([FAKE_RATES, slower])
    monkeypatch.setattr(machine, "measure_rates", lambda *args, **kwargs: next(results))
    assert machine_rates(None, SMALL_IO, CPU, cache_path=cache) == (FAKE_RATES, False)
    assert machine_rates(None, SMALL_IO, CPU, cache_path=cache, refresh=True) == (slower, False)
    assert machine_rates(None, SMALL_IO, CPU, cache_path=cache) == (slower, True)
    assert len(json.loads(cache.read_text())["entries"]) == 1


def test_an_unwritable_cache_warns_and_still_returns_the_rates(
    tmp_path: Path, counting_measure: CountingMeasure
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = blocker / "machine.json"  # its directory cannot be made: a file is in the way
    with pytest.warns(UserWarning) as record:
        assert machine_rates(None, SMALL_IO, CPU, cache_path=cache) == (FAKE_RATES, False)
    assert any("could not write" in str(w.message) and str(cache) in str(w.message) for w in record)


def test_default_cache_path_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFLOAD_TRAINER_CACHE", str(tmp_path / "mine.json"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_path() == tmp_path / "mine.json"
    monkeypatch.delenv("OFFLOAD_TRAINER_CACHE")
    assert default_cache_path() == tmp_path / "xdg" / "offload-trainer" / "machine.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_path() == tmp_path / "home" / ".cache" / "offload-trainer" / "machine.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_path() == tmp_path / "home" / ".cache" / "offload-trainer" / "machine.json"


def test_default_cache_path_without_a_home_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """HOME unset and no password entry (a container's arbitrary user id): Path.home() raised
    RuntimeError, a traceback from offload-plan; now a ValueError naming the fix (one line, exit 2)."""
    import pwd

    for name in ("OFFLOAD_TRAINER_CACHE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_entry(uid: int) -> None:
        raise KeyError(uid)

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with pytest.raises(ValueError, match="no home directory .* set OFFLOAD_TRAINER_CACHE"):
        default_cache_path()


def test_machine_rates_uses_the_default_cache_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counting_measure: CountingMeasure
) -> None:
    monkeypatch.setenv("OFFLOAD_TRAINER_CACHE", str(tmp_path / "env.json"))
    machine_rates(None, SMALL_IO, CPU)
    assert (tmp_path / "env.json").exists()
    assert machine_rates(None, SMALL_IO, CPU)[1]
