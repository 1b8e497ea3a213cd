"""The typed config loader: frozen dataclasses read from TOML, JSON, mappings and command-line text.

    @dataclass(frozen=True)
    class MyConfig(ConfigFile):
        lr: float = 1e-3
        def __post_init__(self) -> None:
            coerce_fields(self, "")

    cfg = MyConfig.from_file("run.toml").with_overrides({"lr": "3e-4"})
    cfg.to_toml(), cfg.to_dict()

A config class holds top-level fields and sections (fields whose type is a frozen dataclass);
a file holds the top-level keys and one table per section. Values take their natural TOML/JSON
form: enums as their string values, tuples as lists, a section as a table, a field of a type with
its own `parse` classmethod (Placement) as whatever that accepts. Fields whose name ends in
`_bytes` also take a size string ("512MiB", "16G", "1.5GB"; see byte_size.py); a string field made
with `choice_field` takes only its list of names, which --help shows as it shows an enum's. `with_overrides`
additionally reads every value from a string, as a command line gives it ("0.1", "none",
"0.9,0.95"). Every mistake raises ValueError or TypeError naming the key as a file writes it
("optimizer.lr"), the value and the fix; unknown keys suggest the closest allowed one. An int
beyond int64 (MAX_INT) is refused for every field alike: torch and the C code a value reaches hold
no more (a grad_accum_steps of 10**20 failed deep in the first backward), and no setting means one.
A JSON file that holds a key twice is refused, as TOML refuses it: the first value would be lost
without a word.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import functools
import inspect
import json
import math
import os
import re
import textwrap
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from offload_trainer.config import json_text
from offload_trainer.config.byte_size import BYTE_SIZE_HELP, MAX_BYTES, format_bytes, parse_bytes
from offload_trainer.config.path_setting import path_setting
from offload_trainer.config.placement import Placement

Self = TypeVar("Self", bound="ConfigFile")

MAX_INT = MAX_BYTES
"""The largest int any field takes: int64's, the widest integer torch holds (byte_size.MAX_BYTES)."""


# --- reading values by type ---------------------------------------------------------------------
#
# One converter serves the constructors (which accept the natural TOML/JSON form of each field),
# from_dict, and with_overrides (which also reads every type from a string). It is driven by the
# fields' type hints, so a new field needs no conversion code of its own.


@functools.cache
def _field_types(cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_CHOICES = "choices"
"""The metadata key of a string field whose values are a fixed list of names (choice_field)."""


def choice_field(default: str | None, choices: typing.Iterable[str]) -> typing.Any:
    """A string field (`str` or `str | None`) that takes only the names in `choices`: coerce_fields
    refuses any other with them all, and --help lists them, as for an enum field."""
    return dataclasses.field(default=default, metadata={_CHOICES: tuple(choices)})


@functools.cache
def _field_choices(cls: type) -> dict[str, tuple[str, ...]]:
    return {f.name: f.metadata[_CHOICES] for f in dataclasses.fields(cls) if _CHOICES in f.metadata}


_PATH = "path"
"""The metadata key of a field that names a file or directory (path_field)."""


def path_field(default: str | None) -> typing.Any:
    """A string field (`str` or `str | None`) that names a file or directory: coerce_fields reads it
    with path_setting (a Path taken, `~` expanded, NUL and unwritable characters refused), and
    ConfigFile.with_absolute_paths makes it absolute for a config written to be read elsewhere."""
    return dataclasses.field(default=default, metadata={_PATH: True})


@functools.cache
def _path_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get(_PATH))


def _choices_text(choices: tuple[str, ...], hint: object) -> str:
    names = ", ".join(repr(c) for c in choices)
    return f"one of {names}" + (" or None" if isinstance(hint, types.UnionType) else "")


def coerce_fields(obj: object, section: str) -> None:
    """Convert every field of the frozen dataclass `obj` to its declared type, in place; a
    choice_field's value must be one of its names, a path_field's is read by path_setting."""
    choices = _field_choices(type(obj))
    paths = _path_fields(type(obj))
    for name, hint in _field_types(type(obj)).items():
        given = getattr(obj, name)
        key = _join(section, name)
        value = path_setting(given, key) if name in paths else given  # type: ignore[arg-type]
        converted = _convert(value, hint, key)
        if converted is not given:
            object.__setattr__(obj, name, converted)
        if name in choices and converted is not None and converted not in choices[name]:
            raise ValueError(f"{key}={converted!r} is not a choice: it must be {_choices_text(choices[name], hint)}")


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _build(cls: type, data: object, section: str, root: type | None = None) -> object:
    """An instance of the dataclass `cls` from a mapping of its fields, checked key by key. `root`: the
    whole config's class, where an unknown key is looked for in the other sections (from_dict's)."""
    if isinstance(data, cls):
        return data
    where = f"section [{section}]" if section else "the config"
    if not isinstance(data, Mapping):
        raise TypeError(f"{where} must be a table (a mapping) of {cls.__name__} fields, got {data!r}")
    field_types = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in field_types:
            if not section and key in getattr(cls, "OTHER_CONFIGS_SECTIONS", {}):
                raise ValueError(f"unknown section [{key}]: {cls.OTHER_CONFIGS_SECTIONS[key]}")
            raise _unknown_key(key, section, list(field_types), elsewhere=_keys_named(root, key))
        hint = field_types[key]
        if key in _path_fields(cls):
            value = path_setting(value, _join(section, key))  # type: ignore[arg-type]  # a Path taken, as the class takes it
        if root is not None and not section and dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            kwargs[key] = _build(hint, value, key, root)  # type: ignore[arg-type]  # a section: keep the root
        else:
            kwargs[key] = _convert(value, hint, _join(section, key))
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if not section or str(e).startswith(f"{section}."):
            raise
        raise _in_section(e, section, cls) from e


def _in_section(error: TypeError | ValueError, section: str, cls: type) -> TypeError | ValueError:
    """`error` of a section class with its own message style (io_engine.IOConfig, which names its fields
    `IOConfig.queue_depth`) in the keys the user wrote: `io.queue_depth=0 must be at least 1`, not
    `io: IOConfig.queue_depth=0 ...`, a name found in no config file or flag."""
    message = str(error).replace(f"{cls.__name__}.", f"{section}.")
    return type(error)(message if message.startswith(f"{section}.") else f"{section}: {message}")


def _keys_named(root: type | None, name: object) -> list[str]:
    """The keys of the config class `root` whose field is called `name`: top-level ("seed") or of a
    section ("optimizer.lr"). Empty without a root."""
    if root is None:
        return []
    found = []
    for field, hint in _field_types(root).items():
        if field == name:
            found.append(field)
        elif dataclasses.is_dataclass(hint) and name in _field_types(hint):  # type: ignore[arg-type]
            found.append(f"{field}.{name}")
    return found


def _unknown_key(
    key: object, section: str, allowed: list[str], full_key: str | None = None, elsewhere: list[str] | None = None
) -> ValueError:
    where = f"in section [{section}]" if section else "at the top level of the config"
    shown = f"{key!r} (in {full_key!r})" if full_key is not None and full_key != key else repr(key)
    close = difflib.get_close_matches(str(key), allowed, n=1)
    suggestion = f"; did you mean {_join(section, close[0])!r}?" if close else "."
    if elsewhere:  # a key put in the wrong section: say where it belongs
        places = " or ".join(
            f"[{k.split('.')[0]}] ({k})" if "." in k else f"the top level ({k})" for k in elsewhere
        )
        suggestion = f"; it belongs at {places}."
    return ValueError(f"unknown key {shown} {where}{suggestion} Allowed keys: {', '.join(allowed)}")


_TRUE_WORDS = ("true", "yes", "on", "1")
_FALSE_WORDS = ("false", "no", "off", "0")
_PLURALS = {str: "strings", int: "ints", float: "numbers", bool: "bools"}


def _describe(hint: object) -> str:
    """What a value of type `hint` looks like, for error messages."""
    if isinstance(hint, types.UnionType):
        return f"{_describe(_optional_inner(hint))} or None"
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an int"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_PLURALS[args[0]]}"
        return f"a list of {len(args)} {_PLURALS[args[0]]}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in hint)
    description = getattr(hint, "TYPE_DESCRIPTION", None)
    if description is not None:
        return description
    if dataclasses.is_dataclass(hint):
        return f"a table of {hint.__name__} fields"
    raise AssertionError(f"no description for the type {hint!r}")


def _has_own_parser(hint: object) -> bool:
    """A non-enum type that reads its own values: it has a `parse` classmethod."""
    return isinstance(hint, type) and not issubclass(hint, enum.Enum) and callable(getattr(hint, "parse", None))


def _optional_inner(hint: types.UnionType) -> object:
    (inner,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return inner


def _convert(value: object, hint: object, key: str, *, from_text: bool = False) -> object:
    """`value` as the type `hint`, or TypeError/ValueError naming `key` and the value.

    Accepts the value's natural TOML/JSON form (an int for a float, a list for a tuple, a string for
    an enum or a placement, a mapping for a section, a size string for a `_bytes` field). With
    `from_text`, a string is also read as any other type, as a command line gives it.
    """
    text = value.strip() if from_text and isinstance(value, str) else None
    if isinstance(hint, types.UnionType):
        if value is None or (text is not None and text.lower() in ("none", "null")):
            return None
        return _convert(value, _optional_inner(hint), key, from_text=from_text)
    if value is None:
        raise TypeError(f"{key}=None is not allowed: it must be {_describe(hint)}")
    if hint is bool:
        if text is not None and text.lower() in _TRUE_WORDS + _FALSE_WORDS:
            return text.lower() in _TRUE_WORDS
        if not isinstance(value, bool):
            raise TypeError(f"{key}={value!r} must be true or false")
        return value
    if hint is int:
        if key.endswith("_bytes"):
            return parse_bytes(value, key)  # which refuses more than MAX_INT bytes itself
        if text is not None:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{key}={value!r} is not an int") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{key}={value!r} must be an int, not {type(value).__name__}")
        if not -MAX_INT - 1 <= value <= MAX_INT:
            raise ValueError(f"{key}={_short(value)} is beyond the range of any setting (an int64, at most 2**63 - 1)")
        return value
    if hint is float:
        if text is not None:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{key}={value!r} is not a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{key}={value!r} must be a number, not {type(value).__name__}")
        if not math.isfinite(value):
            raise ValueError(f"{key}={value!r} must be a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"{key}={value!r} must be a string, not {type(value).__name__}")
        return value
    if typing.get_origin(hint) is tuple:
        return _convert_tuple(value, hint, key, text)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _convert_enum(value, hint, key, text)
    if _has_own_parser(hint):  # e.g. Placement: a tier name, fractions, or text of either
        try:
            return hint.parse(value)  # type: ignore[attr-defined]
        except (TypeError, ValueError) as e:
            raise type(e)(_named_as_written(str(e), key)) from None
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)  # type: ignore[arg-type]
    raise AssertionError(f"{key}: no conversion to the type {hint!r}")


def _named_as_written(message: str, key: str) -> str:
    """A setting's own parser's `message` about the value of `key`, named as the user writes it. A parser of
    io_engine names the value in its class's style (`IOConfig.direct='maybe' is not valid ...`): that name
    becomes `key` (`io.direct='maybe' is not valid ...`); any other message gets `key: ` in front."""
    own = re.match(rf"\w+\.{re.escape(key.rsplit('.', 1)[-1])}(?==)", message)
    return key + message[own.end():] if own else f"{key}: {message}"


def _short(value: int) -> str:
    """An int as text, its middle digits elided when it is long (an error message stays one short line)."""
    try:
        digits = str(value)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        return f"an int of {value.bit_length()} bits"
    return digits if len(digits) <= 30 else f"{digits[:12]}...{digits[-6:]} ({len(digits.lstrip('-'))} digits)"


def _convert_tuple(value: object, hint: object, key: str, text: str | None) -> tuple[object, ...]:
    args = typing.get_args(hint)
    if text is not None:
        if text.startswith("["):
            try:
                value = json_text.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{key}={value!r} is not a JSON list ({e}): write e.g. {key}=a,b or {key}='[\"a\", \"b\"]'"
                ) from None
        else:
            value = [item.strip() for item in text.split(",")] if text else []
    if not isinstance(value, (list, tuple)):
        extra = f"; for one entry write [{value!r}]" if isinstance(value, str) else ""
        raise TypeError(f"{key}={value!r} must be {_describe(hint)}{extra}")
    if len(args) == 2 and args[1] is Ellipsis:
        element_types = [args[0]] * len(value)
    elif len(value) == len(args):
        element_types = list(args)
    else:
        raise ValueError(f"{key}={value!r} has length {len(value)}: it must be {_describe(hint)}")
    return tuple(
        _convert(item, t, f"{key}[{i}]", from_text=text is not None)
        for i, (item, t) in enumerate(zip(value, element_types))
    )


def _convert_enum(value: object, hint: type[enum.Enum], key: str, text: str | None) -> enum.Enum:
    parse = getattr(hint, "parse", None)
    if parse is not None:  # an enum with its own reader (io_engine.DirectMode also takes bools)
        word = text.lower() if text is not None else None
        if word in _TRUE_WORDS + _FALSE_WORDS and word not in {m.value for m in hint}:
            value = word in _TRUE_WORDS
        try:
            return parse(value)
        except ValueError as e:
            raise ValueError(_named_as_written(str(e), key)) from None
    if isinstance(value, hint):
        return value
    if isinstance(value, str):
        try:
            return hint(value.strip().lower())
        except ValueError:
            pass
    raise (ValueError if isinstance(value, str) else TypeError)(f"{key}={value!r} must be {_describe(hint)}")

# --- a config as a whole ------------------------------------------------------------------------


class ConfigFile:
    """Reading, overriding and writing for a frozen dataclass of top-level fields and sections."""

    OTHER_CONFIGS_SECTIONS: typing.ClassVar[Mapping[str, str]] = {}
    """Sections another config class holds (offload-train's run config, for the engine's), each with
    the sentence said when one is given here: a file written for that class is the likeliest cause."""

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Self:
        """A config from nested mappings, one per section, as to_dict() writes and files hold.

        Unknown keys raise ValueError naming the key, its section, the closest allowed key and all
        of them; a value of the wrong type raises TypeError naming "section.field", the value and
        the type expected. Keys left out keep their defaults.
        """
        return _build(cls, data, "", root=cls)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], defaults: Mapping[str, object] | None = None) -> Self:
        """A config read from a .toml or .json file (see from_dict). Errors start with the path.

        `defaults`: nested mappings like a file's; the keys the file leaves out take these values
        (then the dataclass defaults), and the file is validated with them in place.
        """
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in (".toml", ".json"):
            raise ValueError(f"config file {path} has the suffix {suffix!r}: use a .toml or a .json file")
        try:
            # utf-8-sig: a byte-order mark (Windows editors write one) is dropped, as the corpus reader does;
            # tomllib refused it as "Invalid statement (at line 1, column 1)", json as "Unexpected UTF-8 BOM".
            text = path.read_text(encoding="utf-8-sig")
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist") from None
        except UnicodeDecodeError as e:
            raise ValueError(
                f"config file {path} is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start}): "
                "save it as UTF-8"
            ) from e
        except OSError as e:
            raise ValueError(f"config file {path} cannot be read: {e}") from e
        if suffix == ".toml":
            try:
                data: object = tomllib.loads(text)
            except RecursionError:
                raise ValueError(f"config file {path} nests arrays or tables too deeply to be a config") from None
            except ValueError as e:  # TOMLDecodeError, and an int too long for int() (sys.get_int_max_str_digits)
                raise ValueError(f"config file {path} is not valid TOML: {e}") from e
        else:
            try:
                data = json_text.loads(text, object_pairs_hook=_refuse_duplicate_keys)
            except json.JSONDecodeError as e:  # malformed, nested too deeply, an int of too many digits
                raise ValueError(
                    f"config file {path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
                ) from e
            except ValueError as e:  # a key twice
                raise ValueError(f"config file {path} is not a valid config: {e}") from e
            if not isinstance(data, dict):
                raise ValueError(f"config file {path} must hold a JSON object of sections, not {type(data).__name__}")
        if defaults is not None:
            data = merge_sections(defaults, data)  # type: ignore[arg-type]
        try:
            return cls.from_dict(data)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise type(e)(f"config file {path}: {e}") from e

    def to_dict(self) -> dict[str, object]:
        """The config as nested plain dicts: enums as their values, tuples as lists, None kept.

        JSON-serialisable, and from_dict(to_dict()) == self.
        """
        return _to_plain(self)  # type: ignore[return-value]

    def to_json(self) -> str:
        """to_dict() as indented JSON."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def to_toml(self) -> str:
        """to_dict() as TOML: top-level keys, then a table per section. None values are left out,
        which from_dict reads back as the default (None for every optional field)."""
        lines: list[str] = []
        _emit_toml_table(self.to_dict(), [], lines)
        return "\n".join(lines) + "\n"

    def with_absolute_paths(self) -> Self:
        """A copy whose path fields (path_field: tiers.nvme_dir, train.out_dir, data.path, ...) that
        are relative are joined to the current directory, which they meant here: for a config file
        written to be read from anywhere (offload-plan --write-config, offload-tune-prefetch --out).
        A relative path there meant the directory offload-train was started in, another corpus or
        none at all. Joined as given (no `..` folded away, which a symlink makes a different place)."""
        changes: dict[str, object] = {}
        for name, hint in _field_types(type(self)).items():
            value = getattr(self, name)
            if dataclasses.is_dataclass(hint):
                fixed = {f: _absolute(getattr(value, f)) for f in _path_fields(type(value))}
                fixed = {f: v for f, v in fixed.items() if v != getattr(value, f)}
                if fixed:
                    changes[name] = dataclasses.replace(value, **fixed)
            elif name in _path_fields(type(self)) and _absolute(value) != value:
                changes[name] = _absolute(value)
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def with_overrides(self, overrides: Mapping[str, object]) -> Self:
        """A copy with some fields changed, by dotted key: {"optimizer.lr": "3e-4", "seed": 1}.

        String values are read as the field's type: "0.1" as a float, "true" as a bool, "none" as
        None for optional fields, "[0.9, 0.95]" or "0.9,0.95" as a tuple, "2GiB" for `_bytes`
        fields, "host:0.2,nvme:0.8" as a placement. A section key takes a mapping of its fields
        ({"optimizer": {"lr": 0.1}}). Unknown keys raise ValueError with the closest allowed key.
        """
        top_level = _field_types(type(self))
        sections = {name: hint for name, hint in top_level.items() if dataclasses.is_dataclass(hint)}
        top_changes: dict[str, object] = {}
        section_changes: dict[str, dict[str, object]] = {}
        for key, raw in _flatten_overrides(overrides, sections):
            parts = key.split(".")
            if parts[0] not in top_level:
                if parts[0] in self.OTHER_CONFIGS_SECTIONS:
                    raise ValueError(f"unknown section [{parts[0]}] (in {key!r}): {self.OTHER_CONFIGS_SECTIONS[parts[0]]}")
                raise _unknown_key(parts[0], "", list(top_level), full_key=key, elsewhere=_keys_named(type(self), key))
            if len(parts) == 1:
                top_changes[key] = _convert(raw, top_level[key], key, from_text=True)
                continue
            section = parts[0]
            if section not in sections or len(parts) > 2:
                raise ValueError(
                    f"config key {key!r} is too deep: {'.'.join(parts[:2] if section in sections else parts[:1])} "
                    "has no keys of its own; give keys as 'section.field' or a top-level 'field'"
                )
            field_types = _field_types(sections[section])
            if parts[1] not in field_types:
                raise _unknown_key(
                    parts[1], section, list(field_types), full_key=key, elsewhere=_keys_named(type(self), parts[1])
                )
            section_changes.setdefault(section, {})[parts[1]] = _convert(
                raw, field_types[parts[1]], key, from_text=True
            )
        for section, changes in section_changes.items():
            base = top_changes.get(section, getattr(self, section))
            try:
                top_changes[section] = dataclasses.replace(base, **changes)  # type: ignore[type-var]
            except (TypeError, ValueError) as e:
                if str(e).startswith(f"{section}."):
                    raise
                raise _in_section(e, section, type(base)) from e
        return dataclasses.replace(self, **top_changes)


def _absolute(path: object) -> object:
    """A relative path (str) joined to the current directory; anything else as it is."""
    if isinstance(path, str) and path and not os.path.isabs(path):
        return os.path.join(os.getcwd(), path)
    return path


def _refuse_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object as a dict; ValueError if it holds a key twice (json.loads would keep the last)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice in one object: keep one of them")
        out[key] = value
    return out


def merge_sections(base: Mapping[str, object], top: Mapping[str, object]) -> dict[str, object]:
    """`top` over `base`, section by section: a key of `top` replaces the same key of `base`."""
    out: dict[str, object] = dict(base)
    for key, value in top.items():
        under = out.get(key)
        if isinstance(value, Mapping) and isinstance(under, Mapping):
            out[key] = merge_sections(under, value)
        else:
            out[key] = value
    return out


def _flatten_overrides(overrides: Mapping[str, object], sections: Mapping[str, object]) -> list[tuple[str, object]]:
    """Overrides as (dotted key, value) pairs; a section key with a mapping value becomes one pair per field."""
    if not isinstance(overrides, Mapping):
        raise TypeError(
            f"overrides={overrides!r} must be a mapping of dotted keys to values, e.g. {{'optimizer.lr': 0.1}}"
        )
    pairs: list[tuple[str, object]] = []
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise TypeError(f"override key {key!r} must be a string such as 'optimizer.lr'")
        if key in sections and isinstance(value, Mapping):
            pairs.extend((f"{key}.{field}", v) for field, v in value.items())
        else:
            pairs.append((key, value))
    return pairs


# --- help ---------------------------------------------------------------------------------------
#
# A command's --help lists every field of its config class, generated from the dataclasses: the key,
# the type, the default (the command's own defaults where it has them) and the first sentence of the
# docstring written under the field.


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of the dataclass `cls` (and its dataclass bases), by name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue  # no source (a frozen build): the help lists the field without its doc
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    match = re.search(r"(?<=\.)\s(?=[A-Z\"'(])", text)
    return text[: match.start()] if match else text


def _type_name(hint: object, key: str) -> str:
    if key.endswith("_bytes"):
        return "byte size or None" if isinstance(hint, types.UnionType) else "byte size"
    return _describe(hint)


def _default_text(value: object, key: str) -> str:
    if key.endswith("_bytes") and isinstance(value, int):
        return format_bytes(value)
    plain = _to_plain(value)
    if plain is None:
        return "none"
    if isinstance(value, Placement) and sorted(plain.values())[-1] == 1.0:  # one tier: its name, as a file writes it
        return max(plain, key=plain.__getitem__)
    return json.dumps(plain) if not isinstance(plain, str) else plain


def config_help(config: object, width: int = 100) -> str:
    """Every field of the config instance `config` as `--section.field`, with its type, its value in
    `config` (the command's defaults) and its doc line; then the byte-size grammar."""
    lines = ["config fields (--section.field VALUE, or the same keys in a --config file):"]
    cls = type(config)
    types_ = _field_types(cls)
    docs = field_docs(cls)

    def entry(key: str, hint: object, value: object, doc: str, choices: tuple[str, ...] | None) -> None:
        kind = _type_name(hint, key) if choices is None else _choices_text(choices, hint)
        lines.append(f"  --{key}  {kind}  (default {_default_text(value, key)})")
        if doc:
            lines.extend(textwrap.wrap(_first_sentence(doc), width, initial_indent=" " * 6, subsequent_indent=" " * 6))

    plain = [name for name, hint in types_.items() if not dataclasses.is_dataclass(hint)]
    for name in plain:
        entry(name, types_[name], getattr(config, name), docs.get(name, ""), _field_choices(cls).get(name))
    for name, hint in types_.items():
        if name in plain:
            continue
        section = getattr(config, name)
        lines.append(f" [{name}]" + (f"  {_first_sentence(docs[name])}" if docs.get(name) else ""))
        section_docs = field_docs(type(section))
        for field, field_hint in _field_types(type(section)).items():
            entry(
                f"{name}.{field}", field_hint, getattr(section, field), section_docs.get(field, ""),
                _field_choices(type(section)).get(field),
            )
    lines.append("")
    lines.extend(textwrap.wrap(f"A byte size is {BYTE_SIZE_HELP}.", width))
    return "\n".join(lines)


# --- writing ------------------------------------------------------------------------------------


def _to_plain(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def _emit_toml_table(table: Mapping[str, object], path: list[str], lines: list[str]) -> None:
    """Append `table` as TOML: its header (when nested), its keys, then its sub-tables.

    The top level's mappings (the sections) become [tables]; mappings inside a section (the
    placements) become inline tables, one line each.
    """
    if path:
        if lines:
            lines.append("")
        lines.append("[" + ".".join(_toml_key(p) for p in path) + "]")
    for key, value in table.items():
        if value is not None and (path or not isinstance(value, Mapping)):
            try:
                lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
            except UnicodeEncodeError:
                raise ValueError(
                    f"{'.'.join([*path, key])}={value!r} holds bytes that are not UTF-8 (a path's undecodable bytes), "
                    "which a TOML file cannot hold: rename that path, or write the config as JSON"
                ) from None
    if not path:
        for key, value in table.items():
            if isinstance(value, Mapping):
                _emit_toml_table(value, [key], lines)


_TOML_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_key(key: str) -> str:
    return key if _TOML_BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    out = []
    for i, ch in enumerate(text):
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:  # TOML forbids raw control characters in strings
            out.append(f"\\u{ord(ch):04X}")
        elif 0xD800 <= ord(ch) <= 0xDFFF:  # a lone surrogate: an undecodable byte of a path (surrogateescape)
            raise UnicodeEncodeError("utf-8", text, i, i + 1, "a lone surrogate, which TOML cannot hold")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # Python's repr of a float ("1e-08", "65536.0", "inf") is a valid TOML float
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        items = (f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None)
        return "{ " + ", ".join(items) + " }"
    raise AssertionError(f"no TOML form for {value!r}")
