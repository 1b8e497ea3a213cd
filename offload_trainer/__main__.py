"""`python -m offload_trainer`: the offload-train command line (see offload_trainer.cli)."""

import sys

from .cli import main

sys.exit(main())
