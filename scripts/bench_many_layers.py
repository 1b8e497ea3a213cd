"""The engine's extra time per group per step on a deep thin decoder, against plain PyTorch, interleaved.

Usage and flags: `python3 scripts/bench_many_layers.py --help`; the code is offload_trainer/app/bench/many_layers.py.
"""

import sys

from offload_trainer.app.bench.many_layers import main

if __name__ == "__main__":
    sys.exit(main())
