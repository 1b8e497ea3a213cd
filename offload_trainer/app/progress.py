"""What a person watching a run sees: a progress bar on a terminal, one text line per step otherwise,
and a line before and after each long pause (loading weights or a checkpoint at the start,
evaluating, saving, exporting).

    progress = RunProgress(total_steps=200, done_steps=0, bar=True)
    progress.step(row)                      # after each optimizer step: bar update or a text line
    with progress.phase("saving ckpt-000100"):
        ...                                 # "saving ckpt-000100..." then "saved ckpt-000100 in 2.1 s"
    progress.close()
    with phase(say_on_stdout, "loading the weights"):   # before there is a RunProgress (start-up)
        ...

Text lines go to stdout (a batch job's log), never stderr, which carries only errors and notes.
Per-step lines are written when there is no bar (--no-progress, or stderr is not a terminal a bar can be
drawn on: see draws_bars) or when stdout is not one either (redirected to a file, a pty of no size): a log
then always holds every step, without `\\r`. A stdout whose reader went away stops the lines, never the
run (std_streams.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from typing import Any, Callable, Dict, Iterator, Optional

from offload_trainer.app.std_streams import surviving_lost


def format_duration(seconds: float) -> str:
    """'45s', '12m05s', '3h07m': whole seconds under an hour, whole minutes from there."""
    whole = max(0, int(round(seconds)))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    minutes = whole // 60
    return f"{minutes // 60}h{minutes % 60:02d}m"


def format_step(row: Dict[str, Any], total_steps: int, eta_s: Optional[float] = None) -> str:
    """One step's line: 'step 12/200  loss 2.3456  lr 1.00e-03  1,234 tokens/s  0.41 s  eta 1m18s' (`eta_s`:
    the time the steps left are expected to take, None or 0 for none); '1,234 tokens/s (456 trained)' where
    the step trained on fewer tokens than the model ran through (chat prompts)."""
    loss = row.get("loss")
    parts = [
        f"step {row['step']}/{total_steps}",
        f"loss {loss:.4f}" if isinstance(loss, float) else "loss -",
    ]
    if row.get("lr") is not None:
        parts.append(f"lr {row['lr']:.2e}")
    parts.append(f"{row['tokens_per_s']:,.0f} tokens/s")
    if _trained_differ(row):  # chat data: its prompts run through the model, untrained
        parts[-1] += f" ({row['trained_tokens_per_s']:,.0f} trained)"
    parts.append(f"{row['step_s']:.2f} s")
    if row.get("eval_loss") is not None:
        parts.append(f"eval loss {row['eval_loss']:.4f}")
    if row.get("nonfinite"):
        parts.append("non-finite: skipped")
    elif row.get("skipped"):  # fp16's loss scaler: the scale halved and nothing updated, not a non-finite step
        parts.append(f"overflow: skipped, loss scale halved to {row['loss_scale']:g}")
    if eta_s:
        # Rounded up: a step still to come never shows as "eta 0s".
        parts.append(f"eta {format_duration(math.ceil(eta_s))}")
    return "  ".join(parts)


def _trained_differ(row: Dict[str, Any]) -> bool:
    """Whether the step trained on fewer tokens than it ran through the model (chat prompts are not targets)."""
    trained = row.get("trained_tokens")
    return trained is not None and trained != row.get("tokens")


def say_on_stdout(line: str) -> None:
    """A line on stdout, above the bar when there is one; a reader gone away ends the lines, not the run."""
    from tqdm import tqdm

    with surviving_lost(sys.stdout):
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()


@contextlib.contextmanager
def phase(say: Callable[[str], None], doing: str, done: Optional[str] = None) -> Iterator[None]:
    """'doing...' before the block, 'done in N s' after it (done defaults to doing), through `say`."""
    say(f"{doing}...")
    start = time.perf_counter()
    yield
    say(f"{done or doing} in {time.perf_counter() - start:.1f} s")


def draws_bars(stream: Any) -> bool:
    """Whether a progress bar can be drawn on `stream`: a terminal whose size is known, and not TERM=dumb.

    A terminal of zero columns or rows (a pseudo-terminal no one sized: `script` run without a terminal
    of its own, some container and CI runners' `-t`) got no bar from tqdm (zero characters wide, or
    every row "hidden"), and no step lines either, as stdout was a terminal too: a run showed nothing
    from its start to its summary. A dumb terminal
    (Emacs' shell and compilation buffers) cannot move the cursor, so the eval bar's cursor-up escapes
    were printed as text. Both get the step lines instead."""
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty() and min(os.get_terminal_size(stream.fileno())) > 0
    except (AttributeError, OSError, ValueError):  # no fileno (a wrapper), or a closed stream
        return False


class RunProgress:
    """The bar or the step lines of one run (rank 0's; other ranks make one with enabled=False)."""

    def __init__(
        self, total_steps: int, done_steps: int, bar: bool, enabled: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        from tqdm import tqdm

        self.total_steps = total_steps
        self.done_steps = done_steps
        """The steps done before this process's first (a resumed checkpoint's): not in the ETA's rate."""
        self.enabled = enabled
        self._clock = clock
        self._started = clock()
        show_bar = enabled and bar and draws_bars(sys.stderr)
        self.lines = enabled and (not show_bar or not draws_bars(sys.stdout))
        """Whether each step gets a text line on stdout."""
        self._bar = tqdm(
            total=total_steps, initial=done_steps, disable=not show_bar, unit="step", dynamic_ncols=True,
        )
        self._eval_loss: Optional[float] = None
        """The last eval loss measured, kept in the bar until the next eval (the step lines say it at its step)."""

    def say(self, line: str) -> None:
        """A line on stdout, above the bar when there is one."""
        if self.enabled:
            say_on_stdout(line)

    def step(self, row: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.lines:
            self.say(format_step(row, self.total_steps, self.eta_s(row["step"])))
        loss = row.get("loss")
        if row.get("eval_loss") is not None:
            self._eval_loss = row["eval_loss"]
        shown = {"loss": f"{loss:.3f}" if isinstance(loss, float) else "-"}
        if self._eval_loss is not None:
            shown["eval_loss"] = f"{self._eval_loss:.3f}"
        shown["tok_s"] = f"{row['tokens_per_s']:,.0f}"
        if _trained_differ(row):
            shown["trained_tok_s"] = f"{row['trained_tokens_per_s']:,.0f}"
        shown["nvme_gbps"] = f"{row['nvme_gbps']:.2f}"
        self._bar.set_postfix(shown)
        self._bar.update(1)

    def eta_s(self, step: int) -> Optional[float]:
        """The seconds the steps after `step` are expected to take, at this process's pace so far (its evals
        and saves included, as the bar's ETA); None before a step of this process is done."""
        done = step - self.done_steps
        if done <= 0:
            return None
        return (self._clock() - self._started) / done * max(0, self.total_steps - step)

    def phase(self, doing: str, done: Optional[str] = None) -> Any:
        """'doing...' before the block, 'done in N s' after it (done defaults to doing)."""
        return phase(self.say, doing, done)

    def batches(self, what: str, total: int) -> Any:
        """A bar over `total` batches of `what` on a terminal (nothing otherwise): .update(), .close()."""
        from tqdm import tqdm

        return tqdm(total=total, desc=what, leave=False, disable=self._bar.disable, unit="batch")

    def close(self) -> None:
        self._bar.close()
