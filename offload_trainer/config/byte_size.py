"""Byte sizes as people write them, and as the project prints them: one grammar, one formatter.

    parse_bytes("16G", "tiers.host_budget_bytes")    # 17179869184: a bare K/M/G/T/P is binary (as dd and fio)
    parse_bytes("16GiB", "...")                      # 17179869184: KiB, MiB, GiB, TiB, PiB are binary
    parse_bytes("16GB", "...")                       # 16000000000: KB, MB, GB, TB, PB are decimal
    format_bytes(3 * 2**29)                          # '1.50 GiB'

Every size field of the config, every size flag of offload-plan and the benchmarks, and every byte
count they print goes through this file.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
PiB = 1 << 50

MAX_BYTES = 2**63 - 1
"""The largest byte size taken: int64's, what torch and the C code a size reaches hold."""

_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_BYTE_SIZE = re.compile(
    r"\s*([+-]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*(?:([kmgtp]?)(i?)(b?))\s*",
    re.IGNORECASE,
)
BYTE_SIZE_HELP = (
    "an int or a size such as '4096', '512MiB', '16G' or '1.5GB' (K, M, G, T, P and KiB ... PiB are powers "
    "of 1024; KB, MB, GB, TB, PB powers of 1000; case-insensitive)"
)


def _unit(prefix: str, binary: str, b: str) -> int | None:
    """The multiplier of a unit, or None for a malformed one ('iB', 'Ki' is fine, 'B' alone is bytes)."""
    prefix = prefix.lower()
    if not prefix:
        return 1 if not binary else None
    decimal = bool(b) and not binary
    return (1000 if decimal else 1024) ** _POWERS[prefix]


def parse_bytes(value: int | float | str, field_name: str) -> int:
    """A byte count from an int or a size string ("4096", "512MiB", "16G", "1.5GB", "1_000_000").

    A float is taken when it is a whole number (TOML's 2e9). The result may be 0: callers check their
    own lower bound. Raises TypeError for any other type, and ValueError for a string that is not a
    size, a negative size, a fraction of a byte or more than MAX_BYTES; both name `field_name` and
    the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{field_name}={value!r} must be {BYTE_SIZE_HELP}")
    if isinstance(value, int):
        size = Fraction(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{field_name}={value!r} must be {BYTE_SIZE_HELP}")
        size = Fraction(value)
    else:
        match = _BYTE_SIZE.fullmatch(value)
        multiplier = _unit(*match.group(2, 3, 4)) if match else None
        if match is None or multiplier is None:
            raise ValueError(f"{field_name}={value!r} is not a byte size: use {BYTE_SIZE_HELP}")
        size = Fraction(match.group(1).replace("_", "")) * multiplier
    if size < 0:
        raise ValueError(f"{field_name}={value!r} is negative: a byte size must be 0 or more")
    if size > MAX_BYTES:
        raise ValueError(f"{field_name}={value!r} is more than any byte size takes (8 EiB, 2**63 - 1 bytes)")
    if size.denominator != 1:
        raise ValueError(
            f"{field_name}={value!r} is {float(size)} bytes, not a whole number: "
            f"round it to whole bytes, e.g. {math.floor(size)}"
        )
    return int(size)


def format_bytes(num_bytes: float, *, whole_without_decimals: bool = True) -> str:
    """`num_bytes` in the largest binary unit it reaches: '4 GiB', '1.50 MiB', '512 B'.

    With whole_without_decimals=False a whole count keeps its two decimals too ('4.00 GiB').
    """
    sign = "-" if num_bytes < 0 else ""
    size = abs(num_bytes)
    for unit, scale in (("PiB", PiB), ("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if size >= scale:
            if whole_without_decimals and size % scale == 0:
                return f"{sign}{int(size // scale)} {unit}"
            return f"{sign}{size / scale:.2f} {unit}"
    return f"{sign}{int(size)} B"


def exact_bytes(num_bytes: int) -> str:
    """'3221225472 bytes (3 GiB)': the exact count a config takes, and a readable one."""
    return f"{num_bytes} bytes ({format_bytes(num_bytes)})"
