"""bench_offload's devices, configurations and --compare-plain: tiny runs, no timing asserted.

What is asserted is the arithmetic of the report (the bound is the largest of its terms, the ratio
is the step over the bound, TFLOPS are the model's FLOPs over the step), the counts it rests on,
and that --compare-plain's workers each report their own process.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "bench_offload.py"
TINY = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--steps", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def settings_module() -> ModuleType:
    return importlib.import_module("offload_trainer.app.bench.bench_offload_settings")


def _run(argv: List[str], tmp_path: Path) -> Dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv, "--nvme-dir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=240, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.iterdir()) == [], "swap files and the disk test file must be removed at exit"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_simulated_accelerator_run_counts_its_copies_in_the_bound(tmp_path: Path) -> None:
    delay_s = 0.001
    out = _run([*TINY, "--device", "sim", "--copy-delay-ms", "1", "--params", "host", "--grads", "nvme",
                "--optimizer", "nvme", "--disk-size", "4MiB", "--disk-repeat", "1"], tmp_path)
    assert (out["device"], out["copy_delay_s"], out["compute_dtype"]) == ("sim", delay_s, "fp32")
    # The copies are late and the destinations NaN until they land: fp32 parity still holds bit for bit.
    assert out["bitwise_equal"] is True and out["max_abs_diff"] == 0.0
    # Host-homed parameters cross to the simulated device at least once per step, gradients come back.
    param_bytes = 4 * out["num_params"]
    assert out["h2d_bytes_per_step"] >= param_bytes and out["h2d_copies_per_step"] >= 1
    assert out["d2h_bytes_per_step"] >= param_bytes and out["d2h_copies_per_step"] >= 1
    assert out["param_bytes_read_per_step"] >= param_bytes
    # Every copy costs at least its injected delay in the bound, in the slower direction.
    slowest = max(out["h2d_copies_per_step"], out["d2h_copies_per_step"]) * delay_s
    assert out["bound_copy_s"] >= slowest
    terms = {"compute": out["bound_compute_s"], "copies": out["bound_copy_s"], "NVMe": out["nvme_bound_s"]}
    assert out["bound_s"] == max(terms.values()) and terms[out["bound_limit"]] == out["bound_s"]
    assert out["ratio"] == pytest.approx(out["step_s"] / out["bound_s"], rel=1e-3)
    assert out["tflops"] == pytest.approx(out["model_flops_per_step"] / out["step_s"] / 1e12)
    # Off CUDA the peak device memory is the engine's tracked device-tier peak.
    assert out["peak_device_bytes"] == out["peak_bytes"]["device"] > 0
    assert out["peak_device_source"] == "engine device-tier peak"
    assert out["peak_rss_bytes"] > 0
    # What the training thread waited for, of the work's whole time (the report's "exposed" line).
    assert 0.0 <= out["optimizer_exposed_s"] and 0.0 < out["optimizer_total_s"]
    assert out["comm_exposed_s"] == 0.0 == out["comm_total_s"]  # one rank


def _settings(settings_module: ModuleType, argv: List[str], tmp_path: Path) -> Any:
    parse = settings_module.build_parser().parse_args
    return settings_module.settings_from_args(parse([*argv, "--nvme-dir", str(tmp_path)]))


def test_compare_plain_alternates_who_goes_first_and_reports_each_process(
    settings_module: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compare = importlib.import_module("offload_trainer.app.bench.bench_offload_compare")
    settings = _settings(settings_module, ["--compare-plain", "--rounds", "3", *TINY], tmp_path)
    calls: List[str] = []

    def fake_worker(worker_settings: Any, side: Any) -> Dict[str, Any]:
        calls.append(side.value)
        n = len(calls)
        common = {"peak_rss_bytes": 1000 * n, "baseline_peak_device_bytes": None, "peak_device_bytes": 5}
        if side.value == "baseline":
            return {**common, "baseline_step_s": 2.0, "baseline_optimizer_s": 0.1, "baseline_tflops": 1.0}
        return {**common, "step_s": 1.0 * n, "optimizer_s": 0.5, "optimizer_exposed_s": 0.25, "io_wait_s": 0.0,
                "param_bytes_read_per_step": 7, "tflops": 2.0}

    monkeypatch.setattr(compare, "run_worker", fake_worker)
    out = compare.run_compare(settings, settings.offload_config(), lambda line: None)
    assert calls == ["baseline", "engine", "engine", "baseline", "baseline", "engine"]
    assert [r["first"] for r in out["rounds"]] == ["baseline", "engine", "baseline"]
    assert [r["step_ratio"] for r in out["rounds"]] == [1.0, 1.5, 3.0]
    assert [r["rss_ratio"] for r in out["rounds"]] == [2.0, 3 / 4, 6 / 5]
    assert out["step_ratio"] == 1.5 and out["rss_ratio"] == 3 / 4  # the median round's
    assert out["config"] == "gpt2-124m" and out["placement"] == {"params": "nvme", "grads": "host", "optimizer": "nvme"}


@pytest.mark.slow  # a subprocess that imports torch: seconds on a quiet machine, a minute on a busy one
def test_a_compare_plain_worker_is_a_process_of_its_own(settings_module: ModuleType, tmp_path: Path) -> None:
    compare = importlib.import_module("offload_trainer.app.bench.bench_offload_compare")
    settings = _settings(settings_module, ["--compare-plain", *TINY, "--compute-dtype", "bf16"], tmp_path)
    out = compare.run_worker(settings, settings_module.Side.BASELINE)
    assert out["side"] == "baseline" and out["compute_dtype"] == "bf16" and out["config"] == "gpt2-124m"
    assert out["baseline_step_s"] > 0 and out["peak_rss_bytes"] > 0
    assert "step_s" not in out and out["ratio"] is None


def test_only_engine_reports_no_bound(settings_module: ModuleType, tmp_path: Path, capsys) -> None:
    bench = importlib.import_module("offload_trainer.app.bench.bench_offload")
    settings = _settings(settings_module, [*TINY, "--only", "engine", "--params", "host", "--grads", "host",
                                           "--optimizer", "host"], tmp_path)
    out = bench.run(settings)
    assert out["side"] == "engine" and out["step_s"] > 0 and out["param_bytes_read_per_step"] > 0
    assert out["ratio"] is None and out["bound_s"] is None and out["max_abs_diff"] is None
    assert "baseline_step_s" not in out
    assert "peak RSS of this process (engine)" in capsys.readouterr().out


def test_configs_set_defaults_and_flags_win(settings_module: ModuleType, tmp_path: Path) -> None:
    parse = settings_module.build_parser().parse_args
    io_bound = settings_module.settings_from_args(parse(["--config", "io-bound", "--nvme-dir", str(tmp_path)]))
    assert (io_bound.batch_size, io_bound.seq_len) == (1, 16)
    assert all(p.nvme == 1.0 for p in io_bound.placement.values())
    compute = settings_module.settings_from_args(parse(["--nvme-dir", str(tmp_path)]))
    assert compute.config_name == "compute-bound" and (compute.batch_size, compute.seq_len) == (16, 512)
    assert compute.model == io_bound.model
    gpt2 = settings_module.settings_from_args(parse(["--compare-plain", "--nvme-dir", str(tmp_path)]))
    assert gpt2.config_name == "gpt2-124m" and gpt2.model.tie_embeddings and gpt2.model.vocab_size == 50304
    assert (gpt2.model.dim, gpt2.model.n_layers, gpt2.batch_size, gpt2.seq_len) == (768, 12, 2, 256)
    mixed = settings_module.settings_from_args(parse(
        ["--config", "io-bound", "--batch-size", "4", "--grads", "host", "--nvme-dir", str(tmp_path)]
    ))
    assert mixed.batch_size == 4 and mixed.placement["grads"].host == 1.0 and mixed.seq_len == 16


def test_a_worker_gets_the_parents_settings(settings_module: ModuleType, tmp_path: Path) -> None:
    parse = settings_module.build_parser().parse_args
    parent = settings_module.settings_from_args(parse([
        "--compare-plain", "--rounds", "3", "--batch-size", "1", "--lookahead", "0", "--no-verify-checksums",
        "--compute-dtype", "bf16", "--nvme-dir", str(tmp_path), "--json",
    ]))
    worker = settings_module.settings_from_args(parse([*parent.worker_flags, "--only", "engine", "--json"]))
    same = ("config_name", "model", "batch_size", "seq_len", "placement", "lookahead", "verify_checksums",
            "compute_dtype", "nvme_dir", "device", "num_steps", "num_warmup_steps", "seed")
    assert {k: getattr(worker, k) for k in same} == {k: getattr(parent, k) for k in same}
    assert worker.side.value == "engine" and not worker.compare_plain


def test_model_flops_count_matmuls_and_causal_attention() -> None:
    report = importlib.import_module("offload_trainer.app.bench.bench_offload_report")
    models = importlib.import_module("offload_trainer.models")
    cfg = models.DecoderConfig(vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16)
    tokens, seq_len = 6, 3
    head_dim = 4
    block = 8 * 8 + 2 * 8 * head_dim + 8 * 8 + 3 * 8 * 16  # q, k and v (one kv head), o, SwiGLU
    forward = 2 * tokens * (2 * block + 100 * 8) + 2 * (2 * tokens * seq_len * 8)
    assert report.model_flops_per_step(cfg, tokens, seq_len) == 3 * forward


TIED_TINY = ["--config", "gpt2-124m", "--dim", "32", "--layers", "2", "--heads", "2", "--kv-heads", "2", "--vocab", "64",
             "--ffn-dim", "64", "--batch-size", "2", "--seq-len", "16", "--steps", "1", "--threads", "1"]
"""The gpt2-124m configuration's tied embeddings at the tiny preset's size."""


@pytest.mark.parametrize("shape", [TINY, TIED_TINY], ids=["untied", "tied"])
def test_layer_major_order_is_bitwise_and_reads_fewer_parameter_bytes(settings_module: ModuleType, tmp_path: Path,
                                                                       capsys, shape: List[str]) -> None:
    """--micro-batch-order layer_major through the bench: the same numbers as plain PyTorch, and with 4
    micro-batches at most 1/3 of micro-batch-major's parameter bytes (the engine's own counter). Lookahead
    1: with more slots than the tiny model has groups, micro-batch-major would keep them all resident."""
    bench = importlib.import_module("offload_trainer.app.bench.bench_offload")
    common = [*shape, "--grad-accum", "4", "--params", "nvme", "--grads", "host", "--optimizer", "host",
              "--lookahead", "1", "--disk-size", "4MiB", "--disk-repeat", "1"]
    outs = {}
    for order in ("micro_batch_major", "layer_major"):
        outs[order] = bench.run(_settings(settings_module, [*common, "--micro-batch-order", order], tmp_path / order))
        assert outs[order]["micro_batch_order"] == order and outs[order]["bitwise_equal"] is True
    assert "(layer-major)" in capsys.readouterr().out
    mbm, lm = (outs[o]["param_bytes_read_per_step"] for o in ("micro_batch_major", "layer_major"))
    assert 0 < lm <= mbm / 3


def test_layer_major_takes_the_tied_gpt2_config_and_refuses_an_unknown_order(settings_module: ModuleType,
                                                                              tmp_path: Path) -> None:
    tied = _settings(settings_module, ["--config", "gpt2-124m", "--micro-batch-order", "layer_major"], tmp_path)
    assert tied.layer_major and tied.model.tie_embeddings
    with pytest.raises(settings_module.UsageError, match="--micro-batch-order 'sideways' is not one of"):
        _settings(settings_module, [*TINY, "--micro-batch-order", "sideways"], tmp_path)


def test_a_compare_plain_worker_gets_the_flags_given_and_none_of_help_or_version(settings_module: ModuleType) -> None:
    """The worker's command line is rebuilt from the parser's actions: --version (an action with no
    value in the namespace) made every --compare-plain run fail with an AttributeError."""
    parser = settings_module.build_parser()
    args = parser.parse_args(["--compare-plain", "--steps", "7", "--no-verify-checksums"])
    flags = settings_module._worker_flags(args, "gpt2-124m")
    assert flags[:2] == ("--config", "gpt2-124m")
    assert "--steps=7" in flags and "--no-verify-checksums" in flags
    assert not any(f.startswith(("--version", "--help", "--compare-plain")) for f in flags), flags
