"""JSON text read from a file or a flag a user gave: every way the parse fails is json.JSONDecodeError.

    record = json_text.loads(line)      # as json.loads; a bad text raises json.JSONDecodeError only

json.loads fails on text it was not written for in two ways besides JSONDecodeError: arrays or
objects nested deeper than Python's recursion limit raise RecursionError (a traceback out of every
command: a corpus line, a config.json, a safetensors header, a checkpoint's manifest), and an int of
more digits than int() converts (sys.get_int_max_str_digits, 4300) raises a ValueError whose message
names no file and tells the user to call sys.set_int_max_str_digits. Here both are JSONDecodeError
at the place in the text they come from, which every reader of a user's JSON already turns into a
line naming the file and the fix. A text that starts with a byte-order mark is refused with the fix
a user can act on (json's own message said "decode using utf-8-sig"). Use it for all JSON that did
not come from this process.
"""

from __future__ import annotations

import json
import sys
from typing import Any


_BOM = "\ufeff"
"""A byte-order mark: what a text decoded as UTF-8 starts with when its editor wrote one (Windows' do)."""


class _TooManyDigits(ValueError):
    """An int in the text that int() would refuse (sys.get_int_max_str_digits)."""

    def __init__(self, digits: str) -> None:
        super().__init__(digits)
        self.digits = digits


def loads(text: str, **kwargs: Any) -> Any:
    """json.loads(text, **kwargs), raising json.JSONDecodeError (a ValueError) for every text that is not
    JSON it can hold: malformed, nested too deeply, or holding an int of too many digits. An error
    raised by a hook of the caller's (object_pairs_hook) passes as it is."""
    if "parse_int" in kwargs:
        raise TypeError("json_text.loads reads ints itself (it bounds their digits): leave parse_int out")
    if text.startswith(_BOM):  # json's own message told the user to "decode using utf-8-sig"
        raise json.JSONDecodeError(
            "the text starts with a byte-order mark (BOM), which JSON does not allow: save the file as UTF-8 "
            "without a BOM", text, 0,
        )
    try:
        return json.loads(text, parse_int=_parse_int, **kwargs)
    except RecursionError:
        raise json.JSONDecodeError(
            "arrays or objects nested too deeply to read (past Python's recursion limit)",
            text, _deepest(text),
        ) from None
    except _TooManyDigits as exc:
        limit = sys.get_int_max_str_digits()
        raise json.JSONDecodeError(
            f"a number of {len(exc.digits.lstrip('-'))} digits where at most {limit} are read",
            text, max(text.find(exc.digits), 0),
        ) from None


def _parse_int(digits: str) -> int:
    limit = sys.get_int_max_str_digits()
    if limit and len(digits.lstrip("-")) > limit:
        raise _TooManyDigits(digits)
    return int(digits)


def _deepest(text: str) -> int:
    """The offset of the first bracket at the greatest nesting depth of `text` (strings skipped): where
    a parse that ran out of recursion was."""
    depth = deepest = at = 0
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest, at = depth, i
        elif ch in "]}":
            depth -= 1
    return at
