"""json_text.loads: every text json.loads cannot hold fails as json.JSONDecodeError, at its place."""

from __future__ import annotations

import json
import sys

import pytest

from offload_trainer.config import json_text

DEEP = "[" * 100_000 + "]" * 100_000


def test_it_reads_what_json_loads_reads() -> None:
    text = '{"a": [1, -2, 3.5, "x\\"]"], "b": {"c": null, "d": true}, "e": -' + "9" * 4300 + "}"
    assert json_text.loads(text) == json.loads(text)
    assert json_text.loads("[1]", object_pairs_hook=dict) == [1]


@pytest.mark.parametrize(
    "text, message, column",
    [
        # json.loads: RecursionError, a traceback out of every command that read a user's file
        (DEEP, "arrays or objects nested too deeply to read", 100_000),
        ('{"a": "[[[[", "b": ' + DEEP + "}", "nested too deeply", 20 + 100_000 - 1),
        ('{"text": ' * 50_000 + "1" + "}" * 50_000, "nested too deeply", 9 * 50_000 - 8),
        # json.loads: a ValueError naming no place, whose fix (sys.set_int_max_str_digits) is no user's
        ('{"seed": 1' + "0" * 5000 + "}", "a number of 5001 digits where at most 4300 are read", 10),
        ('[0, -1' + "0" * 5000 + "]", "a number of 5001 digits", 5),
        ("{oops", "Expecting property name", 2),
        # json.loads: "Unexpected UTF-8 BOM (decode using utf-8-sig)", a fix for a programmer
        ('\ufeff{"model_type": "llama"}', "starts with a byte-order mark (BOM), which JSON does not allow: save the "
                                           "file as UTF-8 without a BOM", 1),
    ],
)
def test_a_text_it_cannot_hold_is_a_decode_error_at_its_place(text: str, message: str, column: int) -> None:
    with pytest.raises(json.JSONDecodeError) as info:
        json_text.loads(text)
    assert message in info.value.msg and info.value.lineno == 1 and info.value.colno == column, (info.value, column)


def test_an_error_of_the_callers_hook_passes_as_it_is() -> None:
    def refuse(pairs: list) -> dict:
        raise ValueError("a key twice")

    with pytest.raises(ValueError, match="^a key twice$"):
        json_text.loads('{"a": 1}', object_pairs_hook=refuse)


def test_the_digit_limit_is_the_interpreters() -> None:
    limit = sys.get_int_max_str_digits()
    try:
        sys.set_int_max_str_digits(0)  # no limit
        assert json_text.loads("1" + "0" * 5000) == 10**5000
    finally:
        sys.set_int_max_str_digits(limit)
