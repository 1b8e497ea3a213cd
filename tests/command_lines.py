"""A test's command line: a base one with the flags a test adds, each flag once.

    argv = argv_with(["--train.steps", "2", "--no-progress"], "--train.steps", "5", "--json")
    # ["--train.steps", "5", "--no-progress", "--json"]

Every command refuses a flag given twice (offload-train's `--section.field` overrides, its own
flags, the scripts'), so a test's flag that is in the base already replaces the base's value in
place instead of being appended after it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


def _flag(arg: str) -> Optional[str]:
    """The flag `arg` names, as the commands match it (`-` and `_` alike), or None for a value."""
    if not arg.startswith("--") or len(arg) == 2:
        return None
    return arg[2:].split("=", 1)[0].replace("-", "_")


def _items(argv: Sequence[str]) -> List[Tuple[Optional[str], List[str]]]:
    """(flag or None, its tokens): `--x v`, `--x=v` and a bare `--switch` are each one item."""
    items: List[Tuple[Optional[str], List[str]]] = []
    i = 0
    while i < len(argv):
        flag = _flag(argv[i])
        if flag is not None and "=" not in argv[i] and i + 1 < len(argv) and _flag(argv[i + 1]) is None:
            items.append((flag, [argv[i], argv[i + 1]]))
            i += 2
        else:
            items.append((flag, [argv[i]]))
            i += 1
    return items


def _has_value(tokens: Sequence[str]) -> bool:
    return len(tokens) == 2 or "=" in tokens[0]


def argv_with(base: Sequence[str], *extra: str) -> List[str]:
    """`base` with `extra`'s flags: one already in `base` takes its new value there, the others follow
    (a flag given without its value stays last, where the command finds its value missing)."""
    items = _items(base)
    where = {flag: k for k, (flag, _) in enumerate(items) if flag is not None}
    tail: List[str] = []
    for flag, tokens in _items(extra):
        # A bare flag (a switch, or a value left out on purpose) replaces only a bare one.
        if flag is not None and flag in where and (_has_value(tokens) or not _has_value(items[where[flag]][1])):
            items[where[flag]] = (flag, tokens)
        else:
            tail.extend(tokens)
    return [token for _, tokens in items for token in tokens] + tail
