"""Tests of scripts/tune_prefetch.py: a tiny tuning run end to end, Ctrl-C and SIGTERM mid-run, bad input.

Step times are not asserted (timings belong in the tuner's table, not in tests); what is: the
config written holds the best row's settings and offload-train's loader reads it back, the JSON
line, the budgets, and that no swap files are left behind on any path.

The machine's rates are cached per NVMe directory, so every run of this module shares one
directory and one cache, and measures them once (with a small test file).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Dict, List

import pytest
import torch

from io_engine import IOConfig
from tests.command_lines import argv_with

from offload_trainer.app import cli
from offload_trainer.app.run_config import DEFAULT_RUN, RunConfig
from offload_trainer.config import PlacementMode, Tier
from offload_trainer.planning.model_spec import ModelSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "tune_prefetch.py"
MiB = 1 << 20
HOST_BUDGET = "2MiB"
"""Below the tiny model's 2.4 MiB of state with everything on the host: some of it must go to NVMe."""
TINY = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1", "--rates-size", "8MiB"]


@pytest.fixture(scope="module")
def tune() -> ModuleType:
    return importlib.import_module("offload_trainer.app.bench.tune_prefetch")


@pytest.fixture(scope="module")
def tune_grid() -> ModuleType:
    return importlib.import_module("offload_trainer.app.bench.tune_grid")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tune_prefetch")


def _env(shared: Path) -> Dict[str, str]:
    return dict(os.environ, OFFLOAD_TRAINER_CACHE=str(shared / "machine.json"))


def _argv(shared: Path, *extra: str) -> List[str]:
    return [sys.executable, str(SCRIPT), *argv_with([*TINY, "--nvme-dir", str(shared / "nvme")], *extra)]


def _left_in(nvme_dir: Path) -> List[str]:
    """Whatever a run left under the NVMe directory (swap directories, the rates' test file)."""
    return sorted(p.name for p in nvme_dir.iterdir()) if nvme_dir.exists() else []


def test_tiny_run_writes_the_best_row_as_a_config_offload_train_reads(
    tune: ModuleType, shared: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tuned.toml"
    proc = subprocess.run(
        _argv(shared, "--placement", "auto", "--host-budget", HOST_BUDGET, "--steps", "1", "--max-points", "2",
              "--out", str(out), "--json"),
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_env(shared),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    points = result["points"]
    assert 2 <= len(points) <= 3  # the 2 fastest predicted, and the defaults if not among them
    assert result["defaults"] == 0 and points[0]["is_defaults"]
    best = points[result["best"]]
    assert best["is_best"] and sum(p["is_best"] for p in points) == 1
    assert best["measured_s"] == min(p["measured_s"] for p in points)
    assert result["speedup"] == pytest.approx(points[0]["measured_s"] / best["measured_s"])
    for p in points:
        assert p["problem"] is None and p["within_budgets"] is True
        assert p["predicted_s"] > 0 and p["measured_s"] > 0
        assert p["peak_bytes"]["host"] <= 2 * MiB
    assert "pred/meas" in proc.stdout and f"wrote {out}" in proc.stdout

    cfg = RunConfig.from_file(out, defaults=DEFAULT_RUN)  # what `offload-train --config` does
    assert cfg.placement is PlacementMode.MANUAL
    assert cfg.tiers.uses(Tier.NVME), "the host budget leaves some state for NVMe"
    assert cfg.tiers.host_budget_bytes == int(2 * MiB)
    assert (cfg.model.preset, cfg.data.batch_size, cfg.data.seq_len) == ("tiny", 2, 32)
    assert {
        "prefetch.lookahead_groups": cfg.prefetch.lookahead_groups,
        "prefetch.lookahead_bytes": cfg.prefetch.lookahead_bytes,
        "grouping.max_group_bytes": cfg.grouping.max_group_bytes,
        "io.num_threads": cfg.io.num_threads,
        "io.queue_depth": cfg.io.queue_depth,
    } == best["settings"]
    kinds = ("params", "grads", "optimizer")
    assert result["placement"] == {k: tune.placement_text(getattr(cfg.tiers, k)) for k in kinds}
    assert _left_in(shared / "nvme") == []


@pytest.mark.parametrize(
    "signum, status",
    # SIGTERM takes the same path (4 s a run): slow
    [(signal.SIGINT, 130), pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)], ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_mid_run_closes_the_engine_and_writes_no_config(
    shared: Path, tmp_path: Path, signum: int, status: int
) -> None:
    out = tmp_path / "tuned.toml"
    # Enough steps that the first point is still running when the signal lands.
    proc = subprocess.Popen(
        _argv(shared, "--steps", "2000", "--max-points", "1", "--out", str(out)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env(shared),
    )
    try:
        seen = []
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if "point 1/" in line:
                proc.send_signal(signum)
                break
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, "".join(seen) + stderr
    assert "no config written" in stderr
    assert "interrupted after 0 of" in stdout  # the table of the points measured so far
    assert not out.exists()
    assert _left_in(shared / "nvme") == []


def test_a_run_that_does_not_fit_is_one_line_and_exit_2(shared: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        _argv(shared, "--host-budget", "1", "--out", str(tmp_path / "tuned.toml")),
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=_env(shared),
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("tune_prefetch: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("offload-tune-prefetch: error: the run as configured") and "host needs" in lines[0]
    assert not (tmp_path / "tuned.toml").exists()
    assert _left_in(shared / "nvme") == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "data.batch_size=0 must be at least 1"),
        (["--steps", "0"], "--steps 0 must be at least 1"),
        (["--max-points", "two"], "'two' is not a whole number"),
        (["--out", "tuned.yaml"], "must end in .toml or .json"),
        (["--host-budget", "lots"], "is not a byte size"),
        (["--config", "missing.toml"], "does not exist"),
    ],
)
def test_bad_settings_name_the_fix(tune: ModuleType, tmp_path: Path, argv: List[str], message: str) -> None:
    args = tune.build_parser().parse_args(argv_with([*TINY, "--nvme-dir", str(tmp_path)], *argv))
    with pytest.raises(tune.UsageError, match=message):
        tune.settings_from_args(args)


def test_grid_holds_the_defaults_and_drops_settings_that_cannot_matter(tune_grid: ModuleType, tmp_path: Path) -> None:
    spec = ModelSpec.from_preset("tiny")
    on_host = RunConfig(tiers={"params": "host", "optimizer": "host"})
    grid = tune_grid.make_grid(on_host, spec)
    defaults = tune_grid.GridPoint.of(on_host)
    assert defaults in grid and len(set(grid)) == len(grid)
    # Nothing on NVMe: IO settings change nothing, so only the run's own are kept.
    assert {(p.io_num_threads, p.io_queue_depth) for p in grid} == {(IOConfig().worker_threads(), 32)}
    # No lookahead: no cap to vary.
    assert {p.lookahead_bytes for p in grid if p.lookahead_groups == 0} == {None}
    assert {p.lookahead_groups for p in grid} == {0, 1, 2, 4}
    assert len({p.max_group_bytes for p in grid}) == 2

    on_nvme = cli.resolve_config(None, {"tiers.nvme_dir": str(tmp_path), "io.num_threads": "2", "io.queue_depth": "2"})
    io_pairs = {(p.io_num_threads, p.io_queue_depth) for p in tune_grid.make_grid(on_nvme, spec)}
    assert io_pairs == {(4, 16), (4, 32), (8, 16), (8, 32), (2, 2)}  # the grid's, and the run's own


def test_selection_keeps_the_defaults_and_breaks_ties_toward_them(tune_grid: ModuleType) -> None:
    G, P = tune_grid.GridPoint, tune_grid.Prediction
    defaults = G(2, None, None, 8, 32)
    predictions = [
        P(G(4, None, None, 4, 16), 0, 1.0, None),       # fastest, 3 changes
        P(G(1, None, None, 8, 32), 1, 1.0004, None),    # a tie with it, 1 change
        P(G(0, None, None, 8, 32), 2, 1.5, None),
        P(G(4, 1, None, 8, 32), 3, None, "does not fit"),
        P(defaults, 4, 2.0, None),                       # the slowest: kept all the same
    ]
    chosen = tune_grid.select_points(predictions, defaults, 2)
    assert [p.grid_index for p in chosen] == [4, 1, 0]
    assert [p.grid_index for p in tune_grid.select_points(predictions, defaults, 5)] == [4, 1, 0, 2]


def test_each_io_settings_rate_measurement_is_named(tune: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rates are measured per IO setting of the grid, with the same progress lines for each: a tuner
    over four settings printed what read as one measurement four times."""
    tune_grid = importlib.import_module("offload_trainer.app.bench.tune_grid")
    config = RunConfig(tiers={"nvme_dir": str(tmp_path / "nvme")})
    grid = [tune_grid.GridPoint(2, None, None, threads, 8) for threads in (1, 2)]
    lines: List[str] = []
    monkeypatch.setattr(tune, "say", lines.append)
    rates, note = tune.rates_for(grid, config, torch.device("cpu"), tmp_path / "rates.json", 1 << 20)
    assert len(rates) == 2 and "2 measured now" in note
    measuring = [line for line in lines if "measuring" in line]
    assert measuring and all(line.startswith(("IO setting 1/2 (1 threads x 8 in flight): ",
                                              "IO setting 2/2 (2 threads x 8 in flight): ")) for line in measuring), lines
    # Only the NVMe rates depend on the IO setting: copies and optimizers are measured with the first
    # setting alone (each setting measured them again) and the second setting carries the same values.
    for what in ("host-to-device", "device-to-host", "AdamW", "SGD"):
        assert [line.split(":")[0] for line in measuring if f"measuring {what}" in line] == ["IO setting 1/2 (1 threads x 8 in flight)"], lines
    first, second = rates.values()
    assert (first.host_to_device_bytes_per_s, first.adamw_elements_per_s, first.sgd_elements_per_s) == (
        second.host_to_device_bytes_per_s, second.adamw_elements_per_s, second.sgd_elements_per_s)
