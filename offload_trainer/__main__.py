"""`python -m offload_trainer`: the offload-train command line (see offload_trainer.app.cli), entered
through app/launch.py so that a signal during its imports is answered too."""

import sys

from offload_trainer.app.launch import train

sys.exit(train())
