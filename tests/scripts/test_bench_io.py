"""Smoke tests of scripts/bench_io.py: tiny runs through a subprocess, and its input checks.

Throughput itself is not asserted (timings belong in the benchmark, not in tests).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "bench_io.py"
REQUIRED_KEYS = {
    "read_gbps", "write_gbps", "read_gbps_median", "write_gbps_median", "size_bytes", "block_bytes",
    "queue_depth", "threads", "direct", "direct_mode", "buffer", "pattern", "dir",
}
MiB = 1 << 20


def run_script(args: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )


def last_json(stdout: str) -> Dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bench_io_settings() -> ModuleType:
    return importlib.import_module("offload_trainer.app.bench.bench_io_settings")


def test_tiny_run_prints_json_and_removes_its_file(tmp_path: Path) -> None:
    # 7.5 MiB is not a multiple of the 1 MiB block: the script rounds it up to 8 MiB.
    proc = run_script([
        "--dir", str(tmp_path), "--size", "7.5MiB", "--block-size", "1MiB", "--threads", "2",
        "--queue-depth", "4", "--repeat", "2", "--pattern", "both", "--aiofiles", "--json",
    ])
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc.stdout)
    assert REQUIRED_KEYS <= out.keys()
    assert out["size_bytes"] == 8 * MiB
    assert (out["block_bytes"], out["queue_depth"], out["threads"]) == (MiB, 4, 2)
    assert (out["direct_mode"], out["buffer"], out["pattern"]) == ("auto", "mmap", "both")
    assert out["dir"] == str(tmp_path)
    for key in ("read_gbps", "write_gbps", "random_read_gbps", "random_write_gbps", "aiofiles_read_gbps"):
        assert out[key] > 0, key
    assert out["read_gbps"] >= out["read_gbps_median"]
    # Reads must not be served from the page cache: either O_DIRECT or an explicit drop.
    assert out["direct"] or out["page_cache_dropped"]
    assert "sequential read" in proc.stdout  # the human table precedes the JSON line
    assert list(tmp_path.iterdir()) == [], "the FileStore's directory must be removed at exit"


def test_tiny_sweep_reports_best_and_every_point(tmp_path: Path) -> None:
    proc = run_script([
        "--dir", str(tmp_path), "--sweep", "--sweep-blocks", "256KiB", "--sweep-threads", "1",
        "--size", "1MiB", "--direct", "off", "--json",
    ])
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc.stdout)
    assert [(p["threads"], p["queue_depth"]) for p in out["points"]] == [(1, 1), (1, 2), (1, 4)]
    assert out["best"]["ioconfig"].startswith("IOConfig(num_threads=1, ")
    assert out["direct"] is False and out["page_cache_dropped"] is True
    assert "IOConfig(" in proc.stdout


@pytest.mark.parametrize("args", [["--size", "0"], ["--size", "-1GiB"]])
def test_bad_size_exits_2_with_one_message(tmp_path: Path, args: List[str]) -> None:
    proc = run_script(["--dir", str(tmp_path), *args])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert f"--size {args[1]!r}" in proc.stderr


def test_dir_that_is_a_file_is_refused(bench_io_settings: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "not-a-dir"
    path.write_bytes(b"")
    args = bench_io_settings.build_parser().parse_args(["--dir", str(path)])
    with pytest.raises(bench_io_settings.UsageError, match="is a file, not a directory"):
        bench_io_settings.settings_from_args(args)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--size", "lots"], "'lots' is not a size"),
        (["--block-size", "1000"], "not a multiple of 4096"),
        (["--threads", "8", "--queue-depth", "4"], "use --queue-depth 8 or more"),
        (["--sweep", "--threads", "4"], "cannot be combined with --sweep"),
        (["--sweep-threads", "4"], "only applies with --sweep"),
    ],
)
def test_bad_settings_name_the_fix(bench_io_settings: ModuleType, argv: List[str], message: str) -> None:
    with pytest.raises(bench_io_settings.UsageError, match=message):
        bench_io_settings.settings_from_args(bench_io_settings.build_parser().parse_args(argv))


@pytest.mark.parametrize(
    "text, expected",
    [("4GiB", 4 << 30), ("512MiB", 512 * MiB), ("1M", MiB), ("1GB", 10**9), ("1048576", MiB), ("1.5KiB", 1536)],
)
def test_parse_size(bench_io_settings: ModuleType, text: str, expected: int) -> None:
    assert bench_io_settings.parse_size(text, "--size") == expected


def test_default_sizes_round_up_to_the_block(bench_io_settings: ModuleType) -> None:
    args = bench_io_settings.build_parser().parse_args(["--size", "1000000", "--block-size", "1MiB"])
    assert bench_io_settings.settings_from_args(args).size_bytes == MiB
    assert os.path.basename(bench_io_settings.settings_from_args(args).dir) == ".offload-scratch"
