"""Smoke tests of scripts/bench_offload.py: a tiny run through a subprocess, and its input checks.

Step times and the ratio are not asserted (timings belong in the benchmark, not in tests); that
the engine's parameters equal the in-memory baseline's bit for bit is.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import List

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "bench_offload.py"
REQUIRED_KEYS = {
    "ratio", "step_s", "baseline_step_s", "nvme_bound_s", "read_gbps", "write_gbps", "nvme_read_bytes_per_step",
    "nvme_written_bytes_per_step", "compute_s", "io_wait_s", "optimizer_s", "num_params", "placement",
    "tokens_per_step", "max_abs_diff", "bitwise_equal", "peak_bytes", "preset", "batch_size", "seq_len", "steps",
    "warmup_steps", "grad_accum", "lookahead", "threads", "nvme_dir",
    # The bound, its terms, and what the accelerator leg and the overlap work report.
    "bound_s", "bound_compute_s", "bound_copy_s", "bound_limit", "tflops", "baseline_tflops", "model_flops_per_step",
    "peak_device_bytes", "peak_rss_bytes", "optimizer_exposed_s", "optimizer_total_s", "comm_exposed_s", "comm_total_s", "param_bytes_read_per_step",
    "h2d_bytes_per_step", "d2h_bytes_per_step", "h2d_gbps", "d2h_gbps", "device", "compute_dtype", "config",
}
MiB = 1 << 20


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return importlib.import_module("offload_trainer.app.bench.bench_offload")


def test_tiny_run_prints_json_matches_the_baseline_and_removes_its_files(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--steps", "1",
            "--grad-accum", "2", "--grad-clip", "0.5", "--disk-size", "4MiB", "--disk-repeat", "1", "--threads", "1",
            "--nvme-dir", str(tmp_path), "--json",
        ],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert REQUIRED_KEYS <= out.keys()
    assert out["max_abs_diff"] == 0.0 and out["bitwise_equal"] is True
    assert out["placement"] == {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}
    assert out["tokens_per_step"] == 2 * 16 * 2
    assert (out["steps"], out["warmup_steps"], out["threads"]) == (1, 1, 1)
    # Every state kind is on NVMe: parameters, gradients and AdamW moments all cross the disk.
    num_params = out["num_params"]
    assert out["nvme_read_bytes_per_step"] >= 4 * 4 * num_params  # param, grad, exp_avg, exp_avg_sq
    assert out["nvme_written_bytes_per_step"] >= 3 * 4 * num_params
    assert out["read_gbps"] > 0 and out["write_gbps"] > 0 and out["nvme_bound_s"] > 0
    terms = (out["bound_compute_s"], out["bound_copy_s"], out["nvme_bound_s"])
    assert out["bound_compute_s"] == out["baseline_step_s"] and out["bound_s"] == max(terms)
    assert out["ratio"] == pytest.approx(out["step_s"] / out["bound_s"], rel=1e-3)
    assert "ratio = engine / max(compute, copies, NVMe)" in proc.stdout  # the table precedes the JSON line
    # Where the CPU went, by kind of thread (Linux): the training thread always computes.
    if sys.platform.startswith("linux"):
        assert out["engine_cpu_s_per_step"]["training"] > 0 and out["baseline_cpu_s_per_step"]["training"] > 0
        assert out["engine_cpu_bound_s"] == pytest.approx(sum(out["engine_cpu_s_per_step"].values()) / out["cpu_cores"])
    assert list(tmp_path.iterdir()) == [], "swap files and the disk test file must be removed at exit"


def test_bad_input_exits_2_with_one_message(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "-1", "--nvme-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--steps -1 must be at least 1" in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "huge"], "'huge' is not a preset"),
        (["--params", "disk"], "'disk' is not a tier"),
        (["--optimizer", "host:0.5,nvme:0.4"], "must sum to 1"),
        (["--host-budget", "lots"], "is not a byte size"),
        (["--heads", "5"], "not a multiple of n_heads=5"),
        (["--grad-clip", "0"], "must be a number above 0"),
        (["--batch-size", "two"], "'two' is not a whole number"),
        (["--preset", "70b"], "pick a smaller --preset"),
        (["--config", "huge"], "--config 'huge' is not one of compute-bound, io-bound, gpt2-124m"),
        (["--device", "tpu"], "--device 'tpu' is not one of cpu, cuda, sim"),
        (["--copy-delay-ms", "2"], "--copy-delay-ms is for the simulated accelerator; add --device sim"),
        (["--device", "sim", "--copy-delay-ms", "-1"], "must be a number at least 0"),
        (["--compute-dtype", "fp8"], "--compute-dtype 'fp8' is not one of fp32, bf16"),
        (["--only", "both-ish"], "--only 'both-ish' is not one of both, baseline, engine"),
        (["--compare-plain", "--only", "engine"], "drop one of them"),
        (["--rounds", "0"], "--rounds 0 must be at least 1"),
        (["--malloc-mmap-threshold", "lots"], "is not a size"),
        (["--malloc-mmap-threshold", "64MiB"], "above glibc's ceiling of 32.00 MiB"),
    ],
)
def test_bad_settings_name_the_fix(bench: ModuleType, tmp_path: Path, argv: List[str], message: str) -> None:
    args = bench.build_parser().parse_args(["--nvme-dir", str(tmp_path), *argv])
    with pytest.raises(bench.UsageError, match=message):
        bench.settings_from_args(args)


def test_plan_that_does_not_fit_is_a_usage_error(bench: ModuleType, tmp_path: Path) -> None:
    args = bench.build_parser().parse_args([
        "--preset", "tiny", "--seq-len", "8", "--batch-size", "1", "--steps", "1", "--device-budget", "1KiB",
        "--disk-size", "1MiB", "--disk-repeat", "1", "--nvme-dir", str(tmp_path),
    ])
    with pytest.raises(bench.UsageError, match="device_budget_bytes"):
        bench.run(bench.settings_from_args(args))
    assert list(tmp_path.iterdir()) == []


def test_malloc_mmap_threshold_reaches_both_workers_and_glibc(bench: ModuleType, tmp_path: Path) -> None:
    args = bench.build_parser().parse_args(["--compare-plain", "--malloc-mmap-threshold", "1MiB", "--nvme-dir", str(tmp_path)])
    settings = bench.settings_from_args(args)
    assert settings.malloc_mmap_threshold_bytes == 1 << 20
    assert "--malloc-mmap-threshold=1MiB" in settings.worker_flags  # the same flags for both sides
    # mallopt changes the process it runs in: asked in a process of its own.
    code = "from offload_trainer.app.bench.heap_threshold import fix_mmap_threshold as f; print(f(1 << 20))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert proc.stdout.split() == ["True"], proc.stderr
