"""Benchmark of offload_trainer: a decoder LM trained under a placement, against the same model in memory.

Usage and flags: `python3 scripts/bench_offload.py --help`; the code is offload_trainer/app/bench/bench_offload.py.
"""

import sys

from offload_trainer.app.bench.bench_offload import main

if __name__ == "__main__":
    sys.exit(main())
