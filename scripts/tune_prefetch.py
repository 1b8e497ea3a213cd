"""Prefetch tuner: a few short steps of your offload-train run over a grid of prefetch, grouping and IO settings.

Usage and flags: `python3 scripts/tune_prefetch.py --help`; the code is offload_trainer/app/bench/tune_prefetch.py.
"""

import sys

from offload_trainer.app.bench.tune_prefetch import main

if __name__ == "__main__":
    sys.exit(main())
