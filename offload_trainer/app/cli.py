"""offload-train: the command line of the trainer (also `python -m offload_trainer`).

    offload-train                                   # the default run: built-in model and corpus
    offload-train --config run.toml --optimizer.lr 3e-4 --train.steps 1000
    offload-train --resume latest                   # continue the run in train.out_dir
    offload-train --resume auto                     # continue it if it has a checkpoint, else start it

Every config field can be overridden as `--section.field value` (see README's config reference);
neither these nor offload-train's own flags are matched by prefix. With no config file the run
offloads parameters and optimizer states to NVMe under .offload-scratch/swap.

How it ends, always with at most one line on stderr:
- 0: done; the summary on stdout (with --json, one JSON object on the last line).
- 2: a mistake the user can fix (a setting, a path, a file that is not what it should be, a
  corrupted or foreign checkpoint, a non-finite loss under train.on_nonfinite = "stop"): one line
  naming the path or setting, what is wrong and the fix; no traceback, and train.out_dir as it was.
- 1: a rank stopped answering (several ranks): the line names it; resume from the last checkpoint.
- 130, 143, 129: Ctrl-C, SIGTERM, SIGHUP, at any moment from the start (app/launch.py) to the
  summary: the swap files and half-written files are removed first; the line says where the run
  was and what is on disk (nothing yet; a checkpoint to resume from; every step saved but the
  export not written; or the run complete).
Warnings (a buffered-IO fallback, say) are printed after a run that finished, never with an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import sys
import typing
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

from offload_trainer.app.run_checks import check_regular_file
from offload_trainer.app.run_config import DEFAULT_RUN, RunConfig
from offload_trainer.config import PlacementMode
from offload_trainer.app.signals import Terminated, ending_signals, interruption_status
from offload_trainer.app.std_streams import escape_unencodable_output, open_closed_std_fds, surviving_lost
from offload_trainer.app.user_errors import EXIT_USAGE, OneLineParser, PathRole, describe_user_error, one_line

PROG = "offload-train"
EXIT_RANK_FAILURE = 1
"""Exit status when a rank stopped answering (not the user's mistake: resume once every rank runs)."""


def _split_overrides(rest: Sequence[str]) -> Dict[str, str]:
    """`--section.field value` (or `--section.field=value`) pairs; keys are matched exactly: a flag
    that is no config key is refused here, named as it was typed, with the closest real one, and so is
    a key given twice (`--train.steps 5 ... --train.steps 50` ran 50 without a word, as the command's
    own flags given twice did before OneLineParser refused them)."""
    overrides: Dict[str, str] = {}
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"unexpected argument {arg!r}: overrides are written --section.field value")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(rest):
                raise ValueError(f"--{key} needs a value: write --{key} VALUE")
            value = rest[i + 1]
            i += 1
        key = key.replace("-", "_")
        typed = f"--{arg[2:].split('=', 1)[0]}"
        _refuse_unknown_flag(typed, key)
        if key in overrides:
            raise ValueError(f"{typed} is given twice ({overrides[key]!r}, then {value!r}): give it once")
        overrides[key] = value
        i += 1
    return overrides


def _refuse_unknown_flag(typed: str, key: str) -> None:
    """ValueError naming the flag `typed` (as the user wrote it) unless `key` is a config key: where a
    field of that name lives (`--lr`: optimizer.lr), else the closest flag. The config's own message
    would name a key "at the top level of the config", which the user never wrote."""
    keys = _config_keys()
    if key in keys:
        return
    name = key.rsplit(".", 1)[-1]
    homes = [k for k in keys if k.rsplit(".", 1)[-1] == name and k != key]
    if homes:
        places = " or ".join(f"[{k.split('.')[0]}] ({k})" if "." in k else f"the top level ({k})" for k in homes)
        fix = f"; write --{homes[0]}" if len(homes) == 1 else ": write the one you mean"
        raise ValueError(f"unknown flag {typed}: {name} belongs at {places}{fix}")
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if close:
        raise ValueError(f"unknown flag {typed}; did you mean --{close[0]}? (--help lists every flag)")
    raise ValueError(f"unknown flag {typed}: no config field is called {key!r} (--help lists every flag)")


def resolve_config(
    config_path: Optional[str], overrides: Dict[str, str], hf_setting: Optional[str] = None
) -> RunConfig:
    """DEFAULT_RUN, then the file (if any) on top, then the command line's overrides. `hf_setting`:
    the flag that names a Hugging Face model outside the config (offload-plan's --hf-config)."""
    if config_path is None:
        cfg = RunConfig.from_dict(DEFAULT_RUN).with_overrides(overrides)
    else:
        check_regular_file(config_path, "--config")  # a FIFO would block the read forever
        cfg = RunConfig.from_file(config_path, defaults=DEFAULT_RUN).with_overrides(overrides)
    refuse_preset_beside_hf(overrides, cfg, hf_setting)
    refuse_placed_beside_auto(overrides, cfg)
    if hf_setting is not None and "model.hf_path" in overrides:  # the flag's model replaced it without a word
        raise ValueError(
            f"--model.hf_path {overrides['model.hf_path']} and {hf_setting} both name the model, and "
            f"{hf_setting}'s would be planned: drop one of them"
        )
    return cfg


def refuse_preset_beside_hf(overrides: Dict[str, str], cfg: RunConfig, hf_setting: Optional[str]) -> None:
    """--model.preset with a Hugging Face model named too: the preset would be ignored without a word.
    Only the command line's preset is the user's for sure: a config file holds one either way, as
    every config.json a run writes does (to_dict writes each field), and `--config config.json` of a
    Hugging Face run must run it again."""
    if "model.preset" not in overrides:
        return
    if hf_setting is None and cfg.model.hf_path is None:
        return
    other = hf_setting if hf_setting is not None else f"model.hf_path={cfg.model.hf_path!r}"
    raise ValueError(
        f"--model.preset {overrides['model.preset']} and {other} both name the model to train, and the "
        "preset would be ignored: drop one of them"
    )


PLANNED_KEYS = ("tiers.params", "tiers.grads", "tiers.optimizer", "prefetch.lookahead_groups")
"""What the planner chooses under placement = "auto", replacing what was written (planner.py's apply)."""


def refuse_placed_beside_auto(overrides: Dict[str, str], cfg: RunConfig) -> None:
    """A placement flag (`--tiers.params nvme`) under placement = "auto": the planner replaced it without a
    word, the run homing the parameters where the flag said they must not go. Only the command line's are
    the user's for sure: a config file holds every tier either way (the defaults, or a planned run's
    config.json), and placement = "auto" from a file over such tiers is the planner's to replace."""
    if cfg.placement is not PlacementMode.AUTO:
        return
    given = [key for key in PLANNED_KEYS if key in overrides]
    if given:
        key = given[0]
        raise ValueError(
            f"--{key} {overrides[key]} is replaced by the planner under placement='auto' (it chooses "
            f"{', '.join(PLANNED_KEYS)}): drop it, or pass --placement manual to place the state yourself"
        )


class ConfigHelpParser(OneLineParser):
    """A command's parser whose --help ends with every config field: key, type, default and doc line,
    generated from the config dataclasses (config/loader.py's config_help), so it cannot go stale."""

    def format_help(self) -> str:
        from offload_trainer.config.loader import config_help

        return super().format_help() + "\n" + config_help(RunConfig.from_dict(DEFAULT_RUN)) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = ConfigHelpParser(
        prog=PROG,
        description="Fine-tune a causal LM with parameters, gradients and optimizer states offloaded.",
        epilog="Any config field: --section.field VALUE (e.g. --optimizer.lr 3e-4 --train.steps 500); the "
        "defaults below are offload-train's (NVMe offload under .offload-scratch/swap without a --config).",
    )
    parser.add_argument("--config", help="a TOML or JSON config file (README: configuration reference)")
    parser.add_argument(
        "--resume",
        help='"latest" (newest checkpoint in train.out_dir), "auto" (latest if train.out_dir has a checkpoint, '
        'else a fresh run, over what the same config left before its first checkpoint: one command for a first '
        'start and its retries), a checkpoint name in train.out_dir '
        "(ckpt-000004) or a checkpoint directory",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    parser.add_argument(
        "--no-progress", action="store_true",
        help="no progress bar: one line per step on stdout (also whenever stdout is not a terminal)",
    )
    return parser


def parse_args(argv: Sequence[str]) -> Tuple[argparse.Namespace, Dict[str, str]]:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    refuse_misspelt_flags(parser, rest)
    return args, _split_overrides(rest)


def refuse_misspelt_flags(parser: argparse.ArgumentParser, rest: Sequence[str]) -> None:
    """A `--word` left over by argparse that is no config key but close to one of the command's own
    flags (`--resum`, `--js`) is that flag misspelt: say so, rather than that the config lacks the key.
    A word that is a section's field (`--lr`, `--steps`, `--preset`) is that field without its section,
    not a misspelt flag: the config's loader names the section it belongs in (`optimizer.lr`)."""
    flags = [opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")]
    known = {f.name for f in dataclasses.fields(RunConfig)} | {k.rsplit(".", 1)[-1] for k in _config_keys()}
    for arg in rest:
        key = arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") else ""
        if not key or "." in key or key in known:
            continue
        close = difflib.get_close_matches(f"--{key.replace('_', '-')}", flags, n=1, cutoff=0.6)
        if close:
            raise ValueError(
                f"unknown flag {arg.split('=', 1)[0]}; did you mean {close[0]}? (flags are never matched by prefix)"
            )


@functools.lru_cache(maxsize=1)
def _config_keys() -> Tuple[str, ...]:
    """Every key of the run config as a flag names it: a top-level field (`seed`) or a section's
    (`optimizer.lr`), in the config's order. Made once: each flag given is checked against it."""
    keys: List[str] = []
    hints = typing.get_type_hints(RunConfig)
    for field in dataclasses.fields(RunConfig):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            keys.extend(f"{field.name}.{f.name}" for f in dataclasses.fields(hint))
        else:
            keys.append(field.name)
    return tuple(keys)


def _interruption(exc: BaseException) -> Optional[BaseException]:
    """The Ctrl-C or signal behind `exc`, if an error was raised while one unwound (cleanup that failed)."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, (KeyboardInterrupt, Terminated)):
            return exc
        exc = exc.__context__  # type: ignore[assignment]
        seen += 1
    return None


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    open_closed_std_fds()  # before any file is opened: none may get the number 1 or 2
    escape_unencodable_output()
    trainer = None
    ranks = None
    roles: List[PathRole] = []
    # Everything, the imports and the summary included, inside the handlers: a signal at any moment
    # ends with one line that says what is on disk (see app/launch.py for the imports of this file).
    with ending_signals(), warnings.catch_warnings(record=True) as caught:
        try:
            from offload_trainer.app.ranks import join_ranks
            from offload_trainer.app.run_checks import path_roles
            from offload_trainer.app.trainer import Trainer, format_summary, summary_json

            args, overrides = parse_args(argv)
            if args.config is not None:
                roles.append(PathRole(args.config, "--config"))
            cfg = resolve_config(args.config, overrides)
            roles = path_roles(cfg, args.config)
            ranks = join_ranks(cfg.train.dist_timeout_s)
            trainer = Trainer(cfg, args.resume, progress=not args.no_progress, ranks=ranks)
            summary = trainer.run()
            ranks.leave()
            for warning in {str(w.message): w for w in caught}.values():
                _print_err(f"{PROG}: warning: {one_line(warning.message)}")
            if ranks.rank == 0:
                with surviving_lost(sys.stdout, warn=False):  # the warnings are out already; exit 0 all the same
                    print(format_summary(summary))
                    if args.json:
                        print(json.dumps(summary_json(summary), allow_nan=False))
                    sys.stdout.flush()
            return 0
        except BaseException as exc:  # noqa: B902 - each kind is answered below; the rest re-raised
            who = f"{PROG}: rank {ranks.rank}: " if ranks is not None and ranks.several else f"{PROG}: "
            stopped = _interruption(exc)
            if stopped is not None:
                name, status = interruption_status(stopped)
                if trainer is None:
                    _print_err(f"{who}interrupted by {name} while starting; nothing was written: run the same "
                               "command again")
                else:
                    _print_err(f"{who}interrupted by {name} {trainer.moment()}; the swap files and partial files "
                               f"were removed; {trainer.how_to_continue()}")
                return status
            from offload_trainer.app.ranks import RankFailure

            if isinstance(exc, RankFailure):
                _print_err(f"{who}{one_line(exc)}")
                return EXIT_RANK_FAILURE
            dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", ())
            if ranks is None and trainer is None and isinstance(exc, dist_error):
                _print_err(f"{who}could not join the other ranks ({one_line(exc)}); check that every rank started")
                return EXIT_RANK_FAILURE
            if isinstance(exc, SystemExit):
                raise
            message = describe_user_error(exc, roles)
            if message is None:
                raise
            _print_err(f"{who}{message}")
            return EXIT_USAGE
        finally:
            if ranks is not None:
                ranks.leave()  # once: a run that ended left already


def _print_err(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass  # stderr is gone (a closed terminal after SIGHUP): the exit status still says it
