"""The command lines' entry points: a signal is answered from their first instant.

    offload-train  ->  offload_trainer.app.launch:train   (also `python -m offload_trainer`)
    offload-plan   ->  offload_trainer.app.launch:plan

A command imports torch, the config and the engine before its main() can install anything: seconds
in which SIGTERM or SIGHUP killed it silently and Ctrl-C printed a traceback. Here the signals'
handlers (app/signals.py) are installed first, with nothing imported but this file, and the
command is imported inside them; an interruption during that import ends with one line and the
exit status the command documents (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP). Nothing was written by
then. The command's own ending_signals() inside these handlers does nothing, so everything after
the import is the command's to answer as before.

offload-train with several ranks also sets TORCH_CPP_LOG_LEVEL=ERROR before torch is imported
(unless it is set already): [Note: A request in flight as the store dies] in app/ranks.py.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable, List, MutableMapping, Optional

from offload_trainer.app.signals import Terminated, ending_signals, interruption_status


def _launched(module: str, prog: str, argv: Optional[List[str]]) -> int:
    with ending_signals():
        try:
            main: Callable[[Optional[List[str]]], int] = importlib.import_module(module).main
        except (KeyboardInterrupt, Terminated) as stopped:
            name, status = interruption_status(stopped)
            try:
                print(f"{prog}: interrupted by {name} while starting; nothing was written: run the same command "
                      "again", file=sys.stderr, flush=True)
            except OSError:
                pass  # stderr is gone (a closed terminal after SIGHUP): the exit status still says it
            return status
        return main(argv)


def quiet_cpp_warnings(environ: MutableMapping[str, str] = os.environ) -> None:
    """Before torch is imported, in a run of several ranks (WORLD_SIZE > 1, torchrun's or set by hand):
    torch's C++ log lines below ERROR are off, unless TORCH_CPP_LOG_LEVEL says otherwise
    ([Note: A request in flight as the store dies] in app/ranks.py). torch reads the variable once,
    as it loads: set later, it changes nothing."""
    world = environ.get("WORLD_SIZE", "")
    if "TORCH_CPP_LOG_LEVEL" not in environ and world.isdigit() and int(world) > 1:
        environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"


def train(argv: Optional[List[str]] = None) -> int:
    """offload-train (app/cli.py)."""
    quiet_cpp_warnings()
    return _launched("offload_trainer.app.cli", "offload-train", argv)


def plan(argv: Optional[List[str]] = None) -> int:
    """offload-plan (app/plan_cli.py)."""
    return _launched("offload_trainer.app.plan_cli", "offload-plan", argv)
