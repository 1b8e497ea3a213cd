"""Command-line glue shared by the benchmarks and the tuner (bench_io, bench_offload, tune_prefetch).

What their command lines have in common, written once:
- bad input raises UsageError and is printed as one line naming the value and the fix, exit status 2;
- an IO failure (io_engine.TransferError) is printed as one line, exit status 1;
- Ctrl-C exits 130 and SIGTERM 143, each after the files the run made are removed (SIGTERM is
  turned into Terminated, a BaseException, so that it unwinds through the same cleanup as Ctrl-C);
- with --json, one JSON object is the last stdout line;
- byte counts are printed in binary units ("4 GiB", "1.50 MiB").

A benchmark's main() is one call:

    def main(argv: Optional[Sequence[str]] = None) -> int:
        return run_cli(argv, build_parser(), VALUE_FLAGS, settings_from_args, run,
                       cleaned_up="the test file was removed")

The files in scripts/ are thin entry points that call these modules' main().
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import warnings
from typing import Any, Callable, Dict, List, NoReturn, Optional, Protocol, Sequence, TypeVar

from io_engine import BufferedFallbackWarning, TransferError

from offload_trainer.config.byte_size import format_bytes, parse_bytes



class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit status 2."""


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C (a BaseException), so the files the run made are removed."""


class CliSettings(Protocol):
    """What run_cli needs of a benchmark's validated settings."""

    emit_json: bool
    """Print the run's JSON object as the last stdout line."""


SettingsT = TypeVar("SettingsT", bound=CliSettings)


def fail(prog: str, message: str, status: int) -> NoReturn:
    """Print `message` as argparse prints its errors ('prog: error: ...') and exit with `status`."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(status)


def parse_size(text: str, flag: str, minimum: int = 1) -> int:
    """Bytes of a size flag in the project's one grammar (config/byte_size.py: '4GiB', '1M', '1GB');
    UsageError naming `flag` and the value otherwise, or if below `minimum`."""
    try:
        value = parse_bytes(text, flag)
    except (TypeError, ValueError) as exc:
        reason = str(exc).removeprefix(f"{flag}={text!r} ")
        raise UsageError(f"{flag} {text!r} is not a size this tool reads (it {reason})") from None
    if value < minimum:
        raise UsageError(f"{flag} {text!r} must be at least {format_bytes(minimum)}; for example {flag} 2GiB")
    return value


def parse_int(text: str, flag: str, minimum: int) -> int:
    """`text` as a whole number of at least `minimum`; UsageError naming `flag` otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a whole number; for example {flag} {max(minimum, 2)}") from None
    if value < minimum:
        raise UsageError(f"{flag} {value} must be at least {minimum}")
    return value


def _raise_terminated(signum: int, frame: Any) -> NoReturn:
    raise Terminated()


def attach_negative_values(argv: Sequence[str], value_flags: Sequence[str]) -> List[str]:
    """['--size', '-1GiB'] -> ['--size=-1GiB'] for each flag in `value_flags`.

    argparse would take '-1GiB' for an option and say only 'expected one argument'; joined, the
    value reaches the benchmark's own check, which names it.
    """
    out: List[str] = []
    for arg in argv:
        if out and out[-1] in value_flags and re.match(r"^-\.?\d", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def run_cli(
    argv: Optional[Sequence[str]],
    parser: argparse.ArgumentParser,
    value_flags: Sequence[str],
    settings_from_args: Callable[[argparse.Namespace], SettingsT],
    run: Callable[[SettingsT], Dict[str, Any]],
    cleaned_up: str,
    exit_status: Callable[[Dict[str, Any]], int] = lambda out: 0,
) -> int:
    """Parse `argv` (sys.argv[1:] if None), validate and run; return the exit status.

    `value_flags` are the flags that take a value (negative values are attached to them, see
    attach_negative_values); `cleaned_up` ends the line printed on Ctrl-C or SIGTERM, for example
    "the test file was removed". Errors are printed with parser.prog as their prefix.
    `exit_status(out)` is the status of a run that finished (0 unless the script says otherwise).
    """
    args = parser.parse_args(attach_negative_values(sys.argv[1:] if argv is None else argv, value_flags))
    signal.signal(signal.SIGTERM, _raise_terminated)
    # The fallback is reported in the table; the engine's warning would only repeat it.
    warnings.simplefilter("ignore", BufferedFallbackWarning)
    try:
        settings = settings_from_args(args)
        out = run(settings)
    except UsageError as exc:
        fail(parser.prog, str(exc), 2)
    except TransferError as exc:
        fail(parser.prog, str(exc), 1)
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted; {cleaned_up}", file=sys.stderr)
        return 128 + signal.SIGINT
    except Terminated:
        print(f"{parser.prog}: terminated; {cleaned_up}", file=sys.stderr)
        return 128 + signal.SIGTERM
    if settings.emit_json:
        print(json.dumps(out), flush=True)
    return exit_status(out)
