"""Benchmark of io_engine on one directory's disk: sequential (and random) read and write GB/s.

Usage and flags: `python3 scripts/bench_io.py --help`; the code is offload_trainer/app/bench/bench_io.py.
"""

import sys

from offload_trainer.app.bench.bench_io import main

if __name__ == "__main__":
    sys.exit(main())
