"""`python -m offload_trainer`: the offload-train command line (see offload_trainer.app.cli)."""

import sys

from offload_trainer.app.cli import main

sys.exit(main())
