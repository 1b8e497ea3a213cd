"""app/progress.py: a bar only on a terminal one can be drawn on, a line per step wherever it cannot."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import sys
import termios
from typing import Iterator, Tuple

import pytest

from offload_trainer.app import progress
from offload_trainer.app.progress import RunProgress, format_step

ROW = {"step": 1, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 100.0, "step_s": 0.1, "nvme_gbps": 0.0}


@pytest.fixture
def terminal() -> Iterator[Tuple[int, int]]:
    """A fresh pty: (its master, its slave) fds. A fresh pty has no size: 0 x 0."""
    master, slave = pty.openpty()
    yield master, slave
    os.close(slave)
    os.close(master)


def on(slave: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """stdout and stderr on the pty from now on (in the test itself: pytest's capture swaps them back
    between a fixture's setup and the test)."""
    stream = open(slave, "w", buffering=1, closefd=False)
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", stream)


def read_all(master: int) -> str:
    out = b""
    while select.select([master], [], [], 0.5)[0]:
        chunk = os.read(master, 65536)
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


def test_a_terminal_of_no_width_gets_a_line_per_step(terminal: Tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A pty made without a size (`script`, CI runners, containers): the bar had 0 columns and, stdout
    being a terminal, no step lines were written: the run showed nothing."""
    master, slave = terminal
    on(slave, monkeypatch)
    progress = RunProgress(3, 0, bar=True)
    progress.step(ROW)
    progress.close()
    assert progress.lines
    assert "step 1/3  loss 2.5000" in read_all(master)


def test_a_terminal_with_a_width_gets_the_bar(terminal: Tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    master, slave = terminal
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    monkeypatch.setenv("TERM", "xterm")  # CI's may be dumb: no bar there (draws_bars)
    on(slave, monkeypatch)
    progress = RunProgress(3, 0, bar=True)
    progress.step(ROW)
    progress.close()
    assert not progress.lines
    shown = read_all(master)
    assert "1/3" in shown and "step 1/3  loss" not in shown


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


def test_a_step_line_says_how_long_the_steps_left_take(capsys: pytest.CaptureFixture) -> None:
    """A batch job's log (one line per step) had no ETA, which the bar has: the lines now end with the
    time the steps left take at this process's pace, counted from its own first step (a resumed run's
    earlier steps are not in it)."""
    now = [100.0]
    shown = RunProgress(total_steps=10, done_steps=4, bar=False, clock=lambda: now[0])
    now[0] += 3.0  # two steps of this process in 3 s: 1.5 s each, 4 steps left after step 6
    shown.step({**ROW, "step": 6})
    now[0] += 7.5  # four steps in 10.5 s; 90 steps left of 100 below
    shown.total_steps = 100
    shown.step({**ROW, "step": 10})
    shown.total_steps = 10
    shown.step({**ROW, "step": 10})  # the last step: nothing left
    shown.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("0.10 s  eta 6s"), lines
    assert lines[1].endswith("eta 2m38s"), lines  # 90 x 10.5 / 6
    assert "eta" not in lines[2], lines
    assert progress.format_duration(3 * 3600 + 7 * 60 + 40) == "3h07m"
    assert progress.format_step(ROW, 10, eta_s=0.3).endswith("eta 1s")  # a step left is never "eta 0s"


def test_the_bar_shows_the_last_eval_loss(terminal: Tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal the bar is all a person sees of the steps: it showed the training loss, tokens/s and
    NVMe GB/s, and "evaluated in 0.4 s" after each eval, but never what the eval measured (train.eval_every's
    losses were in metrics.jsonl alone, the last one in the summary at the end). The bar now keeps the last
    eval loss beside the training loss, as the step lines show it."""
    master, slave = terminal
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))
    monkeypatch.setenv("TERM", "xterm")
    on(slave, monkeypatch)
    progress = RunProgress(3, 0, bar=True)
    progress.step({**ROW, "eval_loss": 2.25})
    progress.step({**ROW, "step": 2})  # no eval at this step: the last one stays shown
    progress.close()
    assert not progress.lines
    shown = read_all(master).split("\r")
    assert any("2/3" in s and "eval_loss=2.250" in s for s in shown), shown


def test_a_step_fp16_skipped_for_an_overflow_says_so() -> None:
    """Under fp16 an overflow halves the loss scale and updates nothing; the step's line said nothing of it
    (metrics.jsonl alone had "skipped": true), so a run whose first steps all overflowed showed losses as
    if it trained. A non-finite step (fp32, or fp16 at its minimum scale) keeps its own words."""
    from offload_trainer.app.progress import format_step
    from offload_trainer.app.trainer import RunSummary, format_summary

    line = format_step({**ROW, "skipped": True, "nonfinite": False, "loss_scale": 32768.0}, 3)
    assert "overflow: skipped, loss scale halved to 32768" in line, line
    assert "overflow" not in format_step({**ROW, "skipped": True, "nonfinite": True, "loss_scale": 1.0}, 3)
    assert "overflow" not in format_step({**ROW, "skipped": False, "loss_scale": 65536.0}, 3)
    assert "fp16 overflow steps skipped: 2 (1, 3; " in format_summary(RunSummary(overflow_steps=[1, 3]))
    assert "overflow" not in format_summary(RunSummary())


def test_a_step_that_trained_fewer_tokens_than_it_ran_says_both() -> None:
    """Chat data runs its prompts through the model untrained: the line said only the tokens it ran."""
    from offload_trainer.app.trainer import RunSummary, format_summary

    chat = {**ROW, "tokens": 64, "trained_tokens": 16, "trained_tokens_per_s": 25.0}
    assert "  100 tokens/s (25 trained)  " in format_step(chat, 10)
    assert "trained" not in format_step({**ROW, "tokens": 64, "trained_tokens": 64, "trained_tokens_per_s": 100.0}, 10)
    said = format_summary(RunSummary(steps=2, train_s=2.0, tokens=200, trained_tokens=50))
    assert "(100 tokens/s, 25 trained tokens/s)" in said
    assert "trained" not in format_summary(RunSummary(steps=2, train_s=2.0, tokens=200, trained_tokens=200))
