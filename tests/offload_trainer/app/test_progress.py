"""Where a run's progress shows: a bar only on a terminal one can be drawn on, step lines otherwise."""

from __future__ import annotations

import os
import sys
from typing import Tuple

import pytest

from offload_trainer.app import progress
from offload_trainer.app.progress import RunProgress


class _Terminal:
    """A stream that says it is a terminal; os.get_terminal_size is faked with `size`."""

    def __init__(self) -> None:
        self.written = ""

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return 2

    def write(self, text: str) -> int:
        self.written += text
        return len(text)

    def flush(self) -> None:
        pass


def _on_terminal(monkeypatch: pytest.MonkeyPatch, size: Tuple[int, int], term: str) -> Tuple[RunProgress, _Terminal]:
    out, err = _Terminal(), _Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd: os.terminal_size(size))
    monkeypatch.setenv("TERM", term)
    return RunProgress(total_steps=2, done_steps=0, bar=True), out


ROW = {"step": 1, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 100.0, "step_s": 0.5, "nvme_gbps": 0.0}


@pytest.mark.parametrize(
    "size, term", [((0, 0), "xterm"), ((100, 0), "xterm"), ((100, 40), "dumb")], ids=["0x0", "zero-rows", "TERM=dumb"]
)
def test_a_terminal_that_cannot_show_a_bar_gets_the_step_lines(
    monkeypatch: pytest.MonkeyPatch, size: Tuple[int, int], term: str
) -> None:
    """Under `script` with no terminal of its own (a pty of 0 x 0) the bar was zero characters wide and,
    stdout being a terminal too, no step lines were written: nothing showed from the start to the summary."""
    run, out = _on_terminal(monkeypatch, size, term)
    run.step(ROW)
    run.close()
    assert "step 1/2  loss 2.5000" in out.written


def test_a_sized_terminal_gets_the_bar_and_no_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    run, out = _on_terminal(monkeypatch, (100, 40), "xterm")
    assert run.lines is False and run._bar.disable is False
    run.close()
