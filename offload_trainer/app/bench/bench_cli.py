"""Command-line glue shared by the benchmarks and the tuner (bench_io, bench_offload, tune_prefetch).

What their command lines have in common, written once:
- bad input raises UsageError and is printed as one line naming the value and the fix, exit status 2;
  so are argparse's own errors (one line, not usage and error) and any other mistake a user can
  cause: an OSError of a path they named (a file where a directory belongs, a read-only or full
  disk), a config value out of range (app/user_errors.py);
- an IO failure of the disk itself (io_engine.TransferError) is printed as one line, exit status 1;
- Ctrl-C exits 130, SIGTERM 143 and SIGHUP 129, each after the files the run made are removed
  (app/signals.py turns the signals into Terminated, a BaseException, so that they unwind through
  the same cleanup as Ctrl-C);
- flags are never matched by prefix (build parsers with user_errors.OneLineParser);
- with --json, one JSON object is the last stdout line;
- a path that is not text in stdout's encoding is printed escaped (app/std_streams.py);
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
import os
import re
import signal
import sys
import warnings
from typing import Any, Callable, Dict, List, Mapping, NoReturn, Optional, Protocol, Sequence, TypeVar

from io_engine import BufferedFallbackWarning, TransferError

from offload_trainer.app.signals import Terminated, ending_signals
from offload_trainer.app.std_streams import escape_unencodable_output, stdout_gone
from offload_trainer.app.user_errors import EXIT_USAGE, PathRole, describe_user_error, one_line
from offload_trainer.config.byte_size import format_bytes, parse_bytes


class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit status 2."""


class CliSettings(Protocol):
    """What run_cli needs of a benchmark's validated settings."""

    emit_json: bool
    """Print the run's JSON object as the last stdout line."""


SettingsT = TypeVar("SettingsT", bound=CliSettings)


def fail(prog: str, message: str, status: int) -> NoReturn:
    """Print `message` as argparse prints its errors ('prog: error: ...'), on one line, and exit with `status`."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
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


def parse_directory(text: str, flag: str) -> str:
    """The absolute path of a directory flag (--dir, --nvme-dir; `~` expanded, made later if missing): a
    symlink named as the directory itself is followed (the swap store never follows one, io_engine/
    swap_dirs.py). UsageError naming `flag` if it is empty (abspath('') is the current directory, which
    the run would fill without a word) or names a file."""
    if not text.strip():
        raise UsageError(
            f"{flag} {text!r} is empty, which would put the files in the current directory; name a directory "
            "(it is made if missing)"
        )
    directory = os.path.abspath(os.path.expanduser(text))
    if os.path.islink(directory):
        directory = os.path.realpath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"{flag} {text!r} is a file, not a directory; pass a directory (it is made if missing)")
    return directory


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
    path_flags: Mapping[str, str] = {},
) -> int:
    """Parse `argv` (sys.argv[1:] if None), validate and run; return the exit status.

    `value_flags` are the flags that take a value (negative values are attached to them, see
    attach_negative_values); `cleaned_up` ends the line printed on Ctrl-C or a signal, for example
    "the test file was removed". Errors are printed with parser.prog as their prefix.
    `exit_status(out)` is the status of a run that finished (0 unless the script says otherwise).
    `path_flags` maps the attribute of a path flag to the flag ({"dir": "--dir"}): an OSError under
    that path names the flag to change.
    """
    # The fallback is reported in the table; the engine's warning would only repeat it.
    warnings.simplefilter("ignore", BufferedFallbackWarning)
    escape_unencodable_output()
    args: Optional[argparse.Namespace] = None
    with ending_signals():
        try:
            args = parser.parse_args(attach_negative_values(sys.argv[1:] if argv is None else argv, value_flags))
            settings = settings_from_args(args)
            out = run(settings)
        except UsageError as exc:
            fail(parser.prog, str(exc), EXIT_USAGE)
        except BrokenPipeError:  # `offload-bench-io | head`: the reader went away, the disk is fine
            return stdout_gone()
        except TransferError as exc:
            fail(parser.prog, str(exc), 1)
        except KeyboardInterrupt:
            print(f"{parser.prog}: interrupted; {cleaned_up}", file=sys.stderr)
            return 128 + signal.SIGINT
        except Terminated as stopped:
            word = "terminated" if stopped.signum == signal.SIGTERM else f"interrupted by {stopped.signal_name}"
            print(f"{parser.prog}: {word}; {cleaned_up}", file=sys.stderr)
            return stopped.exit_status
        except Exception as exc:  # noqa: BLE001 - a mistake of the user's is one line; the rest re-raised
            roles = [
                PathRole(str(getattr(args, attr)), flag)
                for attr, flag in path_flags.items()
                if args is not None and getattr(args, attr, None) is not None
            ]
            message = describe_user_error(exc, roles)
            if message is None:
                raise
            fail(parser.prog, message, EXIT_USAGE)
    if settings.emit_json:
        try:
            print(json.dumps(out), flush=True)
        except BrokenPipeError:
            return stdout_gone()
    return exit_status(out)
