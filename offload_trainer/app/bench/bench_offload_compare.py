"""bench_offload --compare-plain: plain PyTorch in memory against the engine, each in a process of its own.

    python scripts/bench_offload.py --compare-plain --rounds 2      # the GPT-2-style 124 M configuration

Each round starts one worker for plain PyTorch and one for the engine (this same program with
--only baseline / --only engine), which goes first alternating between rounds, so that a change in
the machine's load hits both alike. A worker runs the warm-up and timed steps and prints its JSON
object; its peak RSS is its own, so neither side's memory shows in the other's. The worker's
stderr (its progress) passes through. On Ctrl-C or a signal the running worker is sent SIGTERM and
waited for, so that it removes its swap files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Callable, Dict, List

import offload_trainer as ot
from offload_trainer.app.bench.bench_cli import UsageError
from offload_trainer.app.bench.bench_offload_report import describe_settings, median_index, settings_fields
from offload_trainer.app.bench.bench_offload_settings import Settings, Side, format_bytes

WORKER_MODULE = "offload_trainer.app.bench.bench_offload"
_STOP_TIMEOUT_S = 120


def run_worker(settings: Settings, side: Side) -> Dict[str, Any]:
    """One worker process timing `side`; its JSON object. UsageError with its last message if it fails."""
    cmd = [sys.executable, "-m", WORKER_MODULE, *settings.worker_flags, "--only", side.value, "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        proc.terminate()  # the worker's own handler removes its swap files
        proc.wait(timeout=_STOP_TIMEOUT_S)
        raise
    progress_lines = [line for line in stderr.splitlines() if line.strip()]
    for line in progress_lines:
        print(f"  [{side.value}] {line}", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        last = progress_lines[-1] if progress_lines else "(no message)"
        raise UsageError(f"the {side.value} worker exited with status {proc.returncode}: {last}")
    return json.loads(stdout.strip().splitlines()[-1])


def run_compare(settings: Settings, cfg: ot.OffloadConfig, progress: Callable[[str], None]) -> Dict[str, Any]:
    """--rounds rounds of one plain and one engine worker, order alternating; prints the table, returns the JSON."""
    rounds: List[Dict[str, Any]] = []
    for r in range(settings.num_rounds):
        order = (Side.BASELINE, Side.ENGINE) if r % 2 == 0 else (Side.ENGINE, Side.BASELINE)
        got: Dict[Side, Dict[str, Any]] = {}
        for side in order:
            progress(f"round {r + 1}/{settings.num_rounds}: {side.value}")
            got[side] = run_worker(settings, side)
        plain, engine = got[Side.BASELINE], got[Side.ENGINE]
        rounds.append({
            "first": order[0].value,
            "plain_step_s": plain["baseline_step_s"],
            "engine_step_s": engine["step_s"],
            "step_ratio": engine["step_s"] / plain["baseline_step_s"],
            "plain_peak_rss_bytes": plain["peak_rss_bytes"],
            "engine_peak_rss_bytes": engine["peak_rss_bytes"],
            "rss_ratio": engine["peak_rss_bytes"] / plain["peak_rss_bytes"],
            "plain_optimizer_s": plain["baseline_optimizer_s"],
            "engine_optimizer_s": engine["optimizer_s"],
            "engine_optimizer_exposed_s": engine["optimizer_exposed_s"],
            "engine_io_wait_s": engine["io_wait_s"],
            "engine_param_bytes_read_per_step": engine["param_bytes_read_per_step"],
            "plain_peak_device_bytes": plain["baseline_peak_device_bytes"],
            "engine_peak_device_bytes": engine["peak_device_bytes"],
            "engine_tflops": engine["tflops"],
            "plain_tflops": plain["baseline_tflops"],
        })
    for line in describe_settings(settings):
        print(line)
    print(f"  plain PyTorch in memory vs the engine, each in its own process, {settings.num_rounds} round(s), "
          "order alternating")
    print(f"  {'round':<6} {'first':<9} {'plain s':>8} {'engine s':>9} {'ratio':>6} {'plain RSS':>11} "
          f"{'engine RSS':>11} {'RSS ratio':>9} {'plain AdamW s':>13} {'engine opt s':>12} {'opt exposed s':>13}")
    for i, row in enumerate(rounds):
        print(f"  {i + 1:<6} {row['first']:<9} {row['plain_step_s']:>8.3f} {row['engine_step_s']:>9.3f} "
              f"{row['step_ratio']:>6.3f} {format_bytes(row['plain_peak_rss_bytes']):>11} "
              f"{format_bytes(row['engine_peak_rss_bytes']):>11} {row['rss_ratio']:>9.3f} "
              f"{row['plain_optimizer_s']:>13.3f} {row['engine_optimizer_s']:>12.3f} "
              f"{row['engine_optimizer_exposed_s']:>13.3f}")
    mid = rounds[median_index([row["step_ratio"] for row in rounds])]
    ratios = [row["step_ratio"] for row in rounds]
    print(f"  step ratio engine / plain: median {mid['step_ratio']:.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); "
          f"peak RSS engine / plain {mid['rss_ratio']:.3f}")
    out: Dict[str, Any] = {
        "compare_plain": True,
        "rounds": rounds,
        "plain_step_s": mid["plain_step_s"],
        "engine_step_s": mid["engine_step_s"],
        "step_ratio": mid["step_ratio"],
        "plain_peak_rss_bytes": mid["plain_peak_rss_bytes"],
        "engine_peak_rss_bytes": mid["engine_peak_rss_bytes"],
        "rss_ratio": mid["rss_ratio"],
    }
    out.update(settings_fields(settings, cfg))
    return out
