"""Smoke tests of scripts/bench_many_layers.py: a tiny run through a subprocess, and its input checks.

Times are not asserted (they belong in the benchmark); that the engine's parameters equal plain
PyTorch's bit for bit after the run is, and that the table, the profile and the JSON are printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "bench_many_layers.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


def test_tiny_run_prints_the_table_the_profile_and_json_and_stays_bitwise(tmp_path: Path) -> None:
    proc = _run("--layers", "3", "--dim", "16", "--ffn-dim", "32", "--vocab", "32", "--steps", "2",
                "--warmup-steps", "1", "--threads", "1", "--nvme-dir", str(tmp_path), "--profile", "--profile-top", "5",
                "--disk-size", "4MiB", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert [p["placement"] for p in out["placements"]] == ["host", "nvme"]
    for placement in out["placements"]:
        assert placement["bitwise_equal"] and placement["max_abs_diff"] == 0.0
        assert placement["num_groups"] >= 3
        assert set(placement["extra_ms_per_group"]) == {"total", "forward", "backward", "gradients", "optimizer"}
        # The engine's hooks with empty callbacks were timed too (a third model, plain PyTorch under them).
        assert isinstance(placement["hook_floor_ms_per_group"], float)
        # ...and a fourth without the saved-tensor hooks: their part of that floor.
        assert isinstance(placement["saved_tensor_hooks_ms_per_group"], float)
    assert "cProfile of the engine's timed steps, nvme" in proc.stdout
    host, nvme = out["placements"]
    assert host["disk_floor_ms_per_group"] is None and host["nvme_read_bytes_per_step"] == 0
    # All on NVMe: parameters (forward and backward), gradients and AdamW states cross the disk,
    # and the floor is those bytes at the measured rates.
    assert nvme["nvme_read_bytes_per_step"] > 0 and nvme["nvme_written_bytes_per_step"] > 0
    floor_s = (nvme["nvme_read_bytes_per_step"] / (nvme["disk_read_gbps"] * 1e9)
               + nvme["nvme_written_bytes_per_step"] / (nvme["disk_write_gbps"] * 1e9))
    assert nvme["disk_floor_ms_per_group"] == pytest.approx(1e3 * floor_s / nvme["num_groups"])
    assert "disk floor (nvme)" in proc.stdout
    assert "hook floor: plain PyTorch under the engine's hooks" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # the swap files are gone


def test_bad_placement_is_one_line_and_exit_2() -> None:
    proc = _run("--placements", "disk")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "--placements 'disk'" in proc.stderr


@pytest.mark.parametrize("value", ["nonsense", pytest.param("-5", marks=pytest.mark.slow)])  # 3 s a run
def test_bad_disk_size_is_one_line_and_exit_2(value: str) -> None:
    proc = _run("--disk-size", value)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert f"--disk-size {value!r}" in proc.stderr
