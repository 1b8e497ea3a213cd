"""Benchmark of offload_trainer: a decoder LM trained under a placement, against the same model in memory.

    python scripts/bench_offload.py                          # compute-bound: "small" (9.6 M), 16 x 512, all on NVMe
    python scripts/bench_offload.py --config io-bound        # the same model, 1 x 16 tokens: the disk dominates
    python scripts/bench_offload.py --json                   # ...and one JSON object on the last stdout line
    python scripts/bench_offload.py --device sim --copy-delay-ms 2    # the simulated accelerator (CI)
    python scripts/bench_offload.py --device cuda --compute-dtype bf16
    python scripts/bench_offload.py --compare-plain --rounds 2          # GPT-2-style 124 M, separate processes
    python scripts/bench_offload.py --preset 125m --batch-size 1 --seq-len 256 --steps 2
    python scripts/bench_offload.py --params host --grads host --optimizer host:0.2,nvme:0.8
    python scripts/bench_offload.py --json --no-verify-checksums    # io.verify_checksums off: its cost
    python scripts/bench_offload.py --compare-plain --malloc-mmap-threshold 1MiB   # freed heap not kept (both sides)

What one run measures, all in the same process on the same machine:
- the disk: sequential O_DIRECT write and read GB/s of --disk-size bytes through io_engine under
  --nvme-dir with the engine's own IOConfig, best of --disk-repeat passes (skipped when no state
  is on NVMe); and the copy path's host<->device GB/s on --device (bench_offload_rates.py);
- the in-memory baseline: the same model trained by plain PyTorch on --device with
  torch.optim.AdamW(fused=True) and the engine's weight-decay groups;
- the engine: ot.initialize(model, cfg, device=...) with the placement, on the same batches.
The two take their steps in turn, who goes first alternating; the first --warmup-steps steps are
untimed; the step reported is the median one and the engine's breakdown (engine.stats()) is that
step's own. Reported: achieved TFLOPS (model FLOPs per step / step time), the step's lower bound
max(compute, copies, NVMe) with each term and the ratio engine / bound (bench_offload_report.py),
what part of the optimizer and communication time is exposed (n/a until the engine counts it),
parameter bytes loaded per step, peak device memory (torch.cuda.max_memory_allocated under
CUDA, the engine's device-tier peak elsewhere) and peak RSS.

--compare-plain runs plain PyTorch and the engine each in a process of its own for --rounds
rounds (bench_offload_compare.py), so each peak RSS is its own.

Correctness, cheaply: after an interleaved run every parameter of the engine is compared with
the baseline's; in fp32 they must be bitwise equal (max_abs_diff 0.0).

Exit status: 0 done, 1 an IO failure (the TransferError is printed), 2 bad input (one message
naming the value and the fix), 130 Ctrl-C, 143 SIGTERM. Swap files are removed on every exit path.

The code, one concept a file in this folder: bench_offload_settings.py (the command line, the
named configurations, Settings), bench_offload_rates.py (disk and copy rates), bench_offload_runs.py
(the timed steps of both sides), bench_offload_report.py (TFLOPS, the bound, the table and the
JSON object), bench_offload_compare.py (--compare-plain); run() here ties them together.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence

from offload_trainer.app.bench.bench_cli import UsageError, run_cli
from offload_trainer.app.bench.bench_offload_compare import run_compare
from offload_trainer.app.bench.bench_offload_rates import measure_copies, measure_disk
from offload_trainer.app.bench.bench_offload_report import report
from offload_trainer.app.bench.bench_offload_runs import run_steps
from offload_trainer.app.bench.bench_offload_settings import (
    VALUE_FLAGS, Settings, Side, build_parser, settings_from_args,
)

__all__ = ["UsageError", "build_parser", "main", "run", "settings_from_args"]


def run(settings: Settings) -> Dict[str, Any]:
    def progress(line: str) -> None:
        print(f"bench_offload: {line}", file=sys.stderr, flush=True)

    cfg = settings.offload_config()
    if settings.compare_plain:
        return run_compare(settings, cfg, progress)
    # The rates are needed for the bound, which needs both sides.
    both = settings.side is Side.BOTH
    disk = measure_disk(settings, cfg.io, progress) if both and settings.uses_nvme else None
    copies = measure_copies(settings, progress) if both else None
    result = run_steps(settings, cfg, progress)
    return report(settings, cfg, disk, copies, result)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(argv, build_parser(), VALUE_FLAGS, settings_from_args, run,
                   cleaned_up="the swap files were removed", path_flags={"nvme_dir": "--nvme-dir"})


if __name__ == "__main__":
    sys.exit(main())
