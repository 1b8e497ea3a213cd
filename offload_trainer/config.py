"""OffloadConfig: everything a training run is told, as frozen dataclasses.

Sections: where each state kind lives and how much each tier may hold (`TierConfig`), how far
the scheduler fetches ahead (`PrefetchConfig`), how modules are grouped (`GroupingConfig`), the
optimizer and its learning-rate schedule (`OptimizerConfig`), compute precision
(`PrecisionConfig`) and the IO engine (`io_engine.IOConfig`). Every value is checked when the
config is made; a mistake raises ValueError or TypeError naming the key as a config file writes
it ("optimizer.lr"), the value and the fix.

    cfg = OffloadConfig.from_file("run.toml")            # or run.json
    cfg = cfg.with_overrides({"optimizer.lr": "3e-4", "tiers.optimizer": "nvme"})
    cfg.to_dict()                                        # saved with every checkpoint

A file holds the top-level keys and one table per section; every key may be left out:

    grad_accum_steps = 4

    [tiers]
    params = "host"
    optimizer = { host = 0.25, nvme = 0.75 }
    nvme_dir = "/mnt/nvme/swap"
    host_budget_bytes = "64GiB"

    [optimizer]
    lr = 3e-4
    schedule = "warmup_cosine"
    warmup_steps = 100
    total_steps = 10000

Values take their natural TOML/JSON form: enums as their string values, tuples as lists, a
placement as a tier name or a table of fractions. Fields whose name ends in `_bytes` also take a
size string ("512MiB", "2GiB", "1.5GB"; see `parse_bytes`). `with_overrides` additionally reads
every value from a string, as a command line gives it ("0.1", "none", "0.9,0.95").
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import json
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch

from io_engine.config import IOConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 has no tomllib: JSON configs still work there.
    tomllib = None  # type: ignore[assignment]

__all__ = [
    "ComputeDtype",
    "GroupingConfig",
    "LRSchedule",
    "OffloadConfig",
    "OptimizerConfig",
    "OptimizerKind",
    "Placement",
    "PrecisionConfig",
    "PrefetchConfig",
    "Tier",
    "TierConfig",
    "parse_bytes",
]


class Tier(enum.Enum):
    """A place where a state's bytes can be homed, from fastest to largest."""

    DEVICE = "device"
    """Accelerator memory (the GPU), or plain CPU memory on a machine without one."""
    HOST = "host"
    """Host memory: page-aligned, and pinned under CUDA."""
    NVME = "nvme"
    """Files under TierConfig.nvme_dir, read and written through io_engine."""


class ComputeDtype(enum.Enum):
    """The dtype forward and backward run in; gradients and optimizer states stay fp32."""

    FP32 = "fp32"
    """Full precision: the parameters are their own master copy, no loss scaling."""
    BF16 = "bf16"
    """bfloat16 compute with an fp32 master copy; fp32's exponent range, so no loss scaling."""
    FP16 = "fp16"
    """float16 compute with an fp32 master copy and dynamic loss scaling (see PrecisionConfig)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of this compute dtype."""
        return _TORCH_DTYPES[self]


_TORCH_DTYPES = {ComputeDtype.FP32: torch.float32, ComputeDtype.BF16: torch.bfloat16, ComputeDtype.FP16: torch.float16}


class OptimizerKind(enum.Enum):
    """Which update rule the streaming optimizer applies to the flat fp32 shards."""

    ADAMW = "adamw"
    """AdamW with decoupled weight decay, equal to torch.optim.AdamW."""
    SGD = "sgd"
    """SGD with momentum (OptimizerConfig.momentum; 0 for plain SGD), equal to torch.optim.SGD."""


class PlacementMode(enum.Enum):
    """Who decides where state lives: the config's tiers section, or the planner."""

    MANUAL = "manual"
    """tiers.params / grads / optimizer and prefetch.lookahead_groups as written."""
    AUTO = "auto"
    """The planner (offload_trainer.planner) chooses them at initialize, within the budgets,
    from the machine's measured rates and the model's compute time for a data.batch_size x
    data.seq_len micro-batch; what was written for them is replaced."""


class LRSchedule(enum.Enum):
    """How the learning rate changes with the optimizer step (see OptimizerConfig.lr_at)."""

    CONSTANT = "constant"
    """OptimizerConfig.lr at every step."""
    WARMUP_COSINE = "warmup_cosine"
    """Linear warmup over warmup_steps, then cosine decay to lr * min_lr_ratio at total_steps; flat after."""


# --- byte sizes ---------------------------------------------------------------------------------

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_BYTE_SIZE = re.compile(r"\s*([+-]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")
_BYTE_SIZE_HELP = (
    "an int or a size string such as '4096', '512MiB', '2GiB' or '1.5GB' "
    "(units B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB)"
)


def parse_bytes(value: int | float | str, field_name: str) -> int:
    """A byte count from an int or a size string: "4096", "512MiB", "2GiB", "1.5GB", "1_000_000".

    KB, MB, GB, TB and PB are powers of 1000; KiB, MiB, GiB, TiB and PiB powers of 1024; units are
    case-insensitive and may follow a space. A float is taken when it is a whole number (TOML's
    2e9). The result may be 0: callers check their own lower bound. Raises TypeError for any other
    type, and ValueError for a string that is not a size, a negative size or a fraction of a byte;
    both name `field_name` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{field_name}={value!r} must be {_BYTE_SIZE_HELP}")
    if isinstance(value, int):
        size = Fraction(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{field_name}={value!r} must be {_BYTE_SIZE_HELP}")
        size = Fraction(value)
    else:
        match = _BYTE_SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _BYTE_UNITS:
            raise ValueError(f"{field_name}={value!r} is not a byte size: use {_BYTE_SIZE_HELP}")
        size = Fraction(match.group(1).replace("_", "")) * _BYTE_UNITS[unit]
    if size < 0:
        raise ValueError(f"{field_name}={value!r} is negative: a byte size must be 0 or more")
    if size.denominator != 1:
        raise ValueError(
            f"{field_name}={value!r} is {float(size)} bytes, not a whole number: "
            f"round it to whole bytes, e.g. {math.floor(size)}"
        )
    return int(size)


# --- placements ---------------------------------------------------------------------------------

_TIER_NAMES = ", ".join(repr(t.value) for t in Tier)


@dataclass(frozen=True)
class Placement:
    """Fractions of one state kind's bytes homed on each tier (sum to 1)."""

    device: float = 0.0
    """Fraction of the bytes homed in device memory."""

    host: float = 1.0
    """Fraction of the bytes homed in host memory."""

    nvme: float = 0.0
    """Fraction of the bytes homed in files under TierConfig.nvme_dir."""

    def __post_init__(self) -> None:
        # Field names are the Tier values, so fraction() can look a tier up by name.
        for tier in Tier:
            value = getattr(self, tier.value)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Placement.{tier.value}={value!r} must be a number between 0 and 1")
            if not 0.0 <= value <= 1.0:  # also catches nan
                raise ValueError(f"Placement.{tier.value}={value!r} must be between 0 and 1")
            object.__setattr__(self, tier.value, float(value))
        total = self.device + self.host + self.nvme
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"Placement(device={self.device}, host={self.host}, nvme={self.nvme}) sums to {total:g}: "
                "the fractions of the tiers must sum to 1"
            )

    @classmethod
    def parse(cls, value: Placement | Tier | str | Mapping[str | Tier, float]) -> Placement:
        """A placement from a Placement, a Tier, a tier name ("nvme"), or tier fractions.

        Fractions are a mapping ({"host": 0.2, "nvme": 0.8}; tiers left out get 0) or the same as a
        string: "host:0.2,nvme:0.8", "host=0.2,nvme=0.8" or JSON.
        """
        if isinstance(value, Placement):
            return value
        if isinstance(value, Tier):
            return cls(**{t.value: float(t is value) for t in Tier})
        if isinstance(value, str):
            return cls._parse_text(value)
        if isinstance(value, Mapping):
            fractions: dict[str, object] = {}
            for key, fraction in value.items():
                tier = key if isinstance(key, Tier) else _tier_named(key, value)
                if tier.value in fractions:
                    raise ValueError(f"placement {value!r} gives tier {tier.value!r} twice")
                fractions[tier.value] = fraction
            return cls(**{t.value: fractions.get(t.value, 0.0) for t in Tier})
        raise TypeError(
            f"placement {value!r} must be a tier name ({_TIER_NAMES}), a Tier, or a mapping of tier "
            "fractions such as {'host': 0.2, 'nvme': 0.8}"
        )

    @classmethod
    def _parse_text(cls, value: str) -> Placement:
        text = value.strip()
        if text.startswith("{"):
            try:
                mapping = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"placement {value!r} is not valid JSON ({e}): write e.g. '{{\"host\": 0.2, \"nvme\": 0.8}}'"
                ) from None
            return cls.parse(mapping)
        if ":" in text or "=" in text:
            mapping = {}
            for item in text.split(","):
                name, _, fraction = item.replace("=", ":").partition(":")
                try:
                    mapping[name.strip()] = float(fraction)
                except ValueError:
                    raise ValueError(
                        f"placement {value!r}: {item.strip()!r} is not 'tier:fraction'; write e.g. 'host:0.2,nvme:0.8'"
                    ) from None
            return cls.parse(mapping)
        return cls.parse(_tier_named(text, value))

    def fraction(self, tier: Tier) -> float:
        """The fraction of the bytes homed on `tier`."""
        return getattr(self, tier.value)

    def tiers(self) -> list[Tier]:
        """The tiers with a nonzero fraction, in the order DEVICE, HOST, NVME."""
        return [t for t in Tier if self.fraction(t) > 0.0]


def _tier_named(name: object, whole: object) -> Tier:
    """The Tier called `name` (case-insensitive); errors quote `whole`, the value the user wrote."""
    if isinstance(name, str):
        try:
            return Tier(name.strip().lower())
        except ValueError:
            pass
    raise ValueError(
        f"placement {whole!r}: {name!r} is not a tier; use one of {_TIER_NAMES}, "
        "or fractions such as {'host': 0.2, 'nvme': 0.8}"
    )


# --- reading values by type ---------------------------------------------------------------------
#
# One converter serves the constructors (which accept the natural TOML/JSON form of each field),
# from_dict, and with_overrides (which also reads every type from a string). It is driven by the
# fields' type hints, so a new field needs no conversion code of its own.


@functools.cache
def _field_types(cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce_fields(obj: object, section: str) -> None:
    """Convert every field of the frozen dataclass `obj` to its declared type, in place."""
    for name, hint in _field_types(type(obj)).items():
        value = getattr(obj, name)
        converted = _convert(value, hint, _join(section, name))
        if converted is not value:
            object.__setattr__(obj, name, converted)


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _build(cls: type, data: object, section: str) -> object:
    """An instance of the dataclass `cls` from a mapping of its fields, checked key by key."""
    if isinstance(data, cls):
        return data
    where = f"section [{section}]" if section else "the config"
    if not isinstance(data, Mapping):
        raise TypeError(f"{where} must be a table (a mapping) of {cls.__name__} fields, got {data!r}")
    field_types = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in field_types:
            raise _unknown_key(key, section, list(field_types))
        kwargs[key] = _convert(value, field_types[key], _join(section, key))
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if not section or str(e).startswith(f"{section}."):
            raise
        # A section class with its own message style (io_engine.IOConfig): say which section it is.
        raise type(e)(f"{section}: {e}") from e


def _unknown_key(key: object, section: str, allowed: list[str], full_key: str | None = None) -> ValueError:
    where = f"in section [{section}]" if section else "at the top level of the config"
    shown = f"{key!r} (in {full_key!r})" if full_key is not None and full_key != key else repr(key)
    close = difflib.get_close_matches(str(key), allowed, n=1)
    suggestion = f"; did you mean {_join(section, close[0])!r}?" if close else "."
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
    if hint is Placement:
        return f"a tier name ({_TIER_NAMES}) or a table of tier fractions"
    if dataclasses.is_dataclass(hint):
        return f"a table of {hint.__name__} fields"
    raise AssertionError(f"no description for the type {hint!r}")


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
            return parse_bytes(value, key)
        if text is not None:
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"{key}={value!r} is not an int") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{key}={value!r} must be an int, not {type(value).__name__}")
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
    if hint is Placement:
        try:
            return Placement.parse(value)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise type(e)(f"{key}: {e}") from None
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)  # type: ignore[arg-type]
    raise AssertionError(f"{key}: no conversion to the type {hint!r}")


def _convert_tuple(value: object, hint: object, key: str, text: str | None) -> tuple[object, ...]:
    args = typing.get_args(hint)
    if text is not None:
        if text.startswith("["):
            try:
                value = json.loads(text)
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
            raise ValueError(f"{key}: {e}") from None
    if isinstance(value, hint):
        return value
    if isinstance(value, str):
        try:
            return hint(value.strip().lower())
        except ValueError:
            pass
    raise (ValueError if isinstance(value, str) else TypeError)(f"{key}={value!r} must be {_describe(hint)}")


# --- sections -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierConfig:
    """Where each state kind is homed, and how many bytes each tier may hold."""

    params: Placement = Placement()
    """Home of the parameter shards. Also takes a tier name ("nvme") or a mapping of fractions."""

    grads: Placement = Placement()
    """Home of the fp32 gradient shards, accumulated there across micro-batches."""

    optimizer: Placement = Placement()
    """Home of the optimizer states: the moments, and the fp32 master copy when compute is low precision."""

    device_budget_bytes: int | None = None
    """Most bytes resident in device memory at once; None = no limit. Takes size strings ("40GiB")."""

    host_budget_bytes: int | None = None
    """Most bytes resident in host memory at once; None = no limit. Takes size strings ("64GiB")."""

    nvme_dir: str | None = None
    """Directory for swap files; required when any placement puts bytes on NVME. Also takes a Path."""

    def __post_init__(self) -> None:
        if isinstance(self.nvme_dir, os.PathLike):
            object.__setattr__(self, "nvme_dir", os.fspath(self.nvme_dir))
        _coerce_fields(self, "tiers")
        for name in ("device_budget_bytes", "host_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"tiers.{name}={value} must be at least 1 byte, or None for no limit")
        if self.nvme_dir is not None and not self.nvme_dir.strip():
            raise ValueError(f"tiers.nvme_dir={self.nvme_dir!r} is empty: give a directory on the NVMe drive, or None")
        for kind in ("params", "grads", "optimizer"):
            placement: Placement = getattr(self, kind)
            if placement.nvme > 0.0 and self.nvme_dir is None:
                raise ValueError(
                    f"tiers.nvme_dir=None, but it is required when any placement puts bytes on nvme, and "
                    f"tiers.{kind} has nvme={placement.nvme:g}: set tiers.nvme_dir to a directory on the "
                    "NVMe drive (the swap files go there)"
                )

    def uses(self, tier: Tier) -> bool:
        """Whether any state kind homes bytes on `tier`."""
        return any(p.fraction(tier) > 0.0 for p in (self.params, self.grads, self.optimizer))


@dataclass(frozen=True)
class PrefetchConfig:
    """How far ahead of the group in use the scheduler fetches."""

    lookahead_groups: int = 2
    """How many groups ahead of the one in use the scheduler fetches; 0 = on demand only."""

    lookahead_bytes: int | None = None
    """Optional cap on the bytes fetched ahead, on top of the tier budgets; None = no cap. Takes size strings."""

    def __post_init__(self) -> None:
        _coerce_fields(self, "prefetch")
        if self.lookahead_groups < 0:
            raise ValueError(f"prefetch.lookahead_groups={self.lookahead_groups} must be 0 (on demand only) or more")
        if self.lookahead_bytes is not None and self.lookahead_bytes < 1:
            raise ValueError(
                f"prefetch.lookahead_bytes={self.lookahead_bytes} must be at least 1 byte, or None for no cap "
                "(to fetch nothing ahead, set prefetch.lookahead_groups=0)"
            )


@dataclass(frozen=True)
class GroupingConfig:
    """How the model's modules are partitioned into groups that move together."""

    module_classes: tuple[str, ...] = ()
    """Class names (type(module).__name__) whose instances each form one group; empty = auto: the
    blocks of the model's largest nn.ModuleList."""

    max_group_bytes: int | None = None
    """Pack consecutive blocks into one group up to this many parameter bytes; None = one block per
    group. Takes size strings."""

    def __post_init__(self) -> None:
        _coerce_fields(self, "grouping")
        for name in self.module_classes:
            if not name.isidentifier():
                raise ValueError(
                    f"grouping.module_classes={list(self.module_classes)} holds {name!r}, which is not a class "
                    "name: give bare names such as 'LlamaDecoderLayer' (matched against type(module).__name__)"
                )
        if self.max_group_bytes is not None and self.max_group_bytes < 1:
            raise ValueError(
                f"grouping.max_group_bytes={self.max_group_bytes} must be at least 1 byte, "
                "or None for one block per group"
            )


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer, its hyperparameters and its learning-rate schedule."""

    kind: OptimizerKind = OptimizerKind.ADAMW
    """The update rule: "adamw" or "sgd"."""

    lr: float = 1e-3
    """Peak learning rate (the rate itself under the constant schedule)."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's decay rates of the first and second moments."""

    eps: float = 1e-8
    """AdamW's term added to the denominator."""

    weight_decay: float = 0.01
    """Weight decay of every parameter not matched by no_decay_patterns."""

    momentum: float = 0.9
    """SGD momentum (SGD only); 0 = plain SGD."""

    no_decay_patterns: tuple[str, ...] = ("bias", "norm")
    """Parameters whose name contains one of these (case-insensitive) get weight decay 0."""

    grad_clip_norm: float | None = None
    """Clip the global L2 norm of the gradients to this; None = no clipping."""

    schedule: LRSchedule = LRSchedule.CONSTANT
    """The learning-rate schedule: "constant" or "warmup_cosine"."""

    warmup_steps: int = 0
    """Optimizer steps of linear warmup (warmup_cosine only)."""

    total_steps: int | None = None
    """Optimizer step at which the cosine decay reaches its end; required for warmup_cosine."""

    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of lr."""

    def __post_init__(self) -> None:
        _coerce_fields(self, "optimizer")
        if self.lr < 0.0:
            raise ValueError(f"optimizer.lr={self.lr} must be 0 or more")
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"optimizer.betas={self.betas} must be two numbers in [0, 1), e.g. (0.9, 0.999)")
        if self.eps < 0.0:
            raise ValueError(f"optimizer.eps={self.eps} must be 0 or more, e.g. 1e-8")
        if self.weight_decay < 0.0:
            raise ValueError(f"optimizer.weight_decay={self.weight_decay} must be 0 (no decay) or more")
        if self.momentum < 0.0:
            raise ValueError(f"optimizer.momentum={self.momentum} must be 0 (plain SGD) or more")
        for pattern in self.no_decay_patterns:
            if not pattern:
                raise ValueError(
                    f"optimizer.no_decay_patterns={list(self.no_decay_patterns)} holds an empty pattern, which "
                    "would match every parameter: remove it (use weight_decay=0 to turn decay off)"
                )
        if self.grad_clip_norm is not None and self.grad_clip_norm <= 0.0:
            raise ValueError(f"optimizer.grad_clip_norm={self.grad_clip_norm} must be above 0, or None for no clipping")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps={self.warmup_steps} must be 0 or more")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"optimizer.total_steps={self.total_steps} must be at least 1, or None")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optimizer.min_lr_ratio={self.min_lr_ratio} must be between 0 and 1")
        if self.schedule is LRSchedule.WARMUP_COSINE:
            if self.total_steps is None:
                raise ValueError(
                    "optimizer.total_steps=None, but schedule='warmup_cosine' needs it: set optimizer.total_steps "
                    "to the number of optimizer steps of the run"
                )
            if self.total_steps <= self.warmup_steps:
                raise ValueError(
                    f"optimizer.total_steps={self.total_steps} must be above warmup_steps={self.warmup_steps}, "
                    "leaving steps for the cosine decay"
                )
        elif self.warmup_steps:
            raise ValueError(
                f"optimizer.warmup_steps={self.warmup_steps} has no effect with schedule='{self.schedule.value}': "
                "set schedule='warmup_cosine' (with total_steps), or warmup_steps=0"
            )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step`, counting from 0 for the first step.

        Warmup: lr * (step + 1) / warmup_steps, reaching lr at step warmup_steps - 1. Then cosine from
        lr at step warmup_steps to lr * min_lr_ratio at step total_steps, and flat after.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step={step!r} must be an int (0 is the first optimizer step)")
        if step < 0:
            raise ValueError(f"step={step} must be 0 or more (0 is the first optimizer step)")
        if self.schedule is LRSchedule.CONSTANT:
            return self.lr
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        assert self.total_steps is not None  # checked in __post_init__
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        min_lr = self.lr * self.min_lr_ratio
        return min_lr + (self.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def weight_decay_for(self, param_name: str) -> float:
        """The weight decay of the parameter called `param_name`: 0 when a no-decay pattern matches."""
        name = param_name.lower()
        return 0.0 if any(p.lower() in name for p in self.no_decay_patterns) else self.weight_decay


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute dtype and fp16 loss scaling."""

    compute_dtype: ComputeDtype = ComputeDtype.FP32
    """The dtype forward and backward run in: "fp32", "bf16" or "fp16"."""

    initial_loss_scale: float = 2.0**16
    """Loss scale at the first step (fp16 only)."""

    loss_scale_window: int = 1000
    """Steps without overflow before the loss scale doubles (fp16 only)."""

    min_loss_scale: float = 1.0
    """The loss scale never halves below this (fp16 only)."""

    def __post_init__(self) -> None:
        _coerce_fields(self, "precision")
        if self.initial_loss_scale <= 0.0:
            raise ValueError(f"precision.initial_loss_scale={self.initial_loss_scale} must be above 0, e.g. 65536")
        if self.loss_scale_window < 1:
            raise ValueError(f"precision.loss_scale_window={self.loss_scale_window} must be at least 1, e.g. 1000")
        if self.min_loss_scale <= 0.0:
            raise ValueError(f"precision.min_loss_scale={self.min_loss_scale} must be above 0, e.g. 1.0")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(
                f"precision.min_loss_scale={self.min_loss_scale} is above initial_loss_scale="
                f"{self.initial_loss_scale}: lower it, or raise initial_loss_scale"
            )

    @property
    def uses_loss_scaling(self) -> bool:
        """Whether the loss is scaled (fp16 compute only)."""
        return self.compute_dtype is ComputeDtype.FP16


# --- the whole config ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The model offload-train builds (the engine itself takes any nn.Module)."""

    preset: str = "small"
    """A built-in decoder preset: tiny, small, 125m, 350m, 1b, 7b, 13b or 70b."""

    hf_path: str | None = None
    """A local Hugging Face causal LM directory (config.json, *.safetensors, tokenizer files) to
    fine-tune instead of the built-in decoder; needs the `hf` extra (transformers)."""

    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them."""

    def __post_init__(self) -> None:
        _coerce_fields(self, "model")
        if isinstance(self.hf_path, os.PathLike):
            object.__setattr__(self, "hf_path", os.fspath(self.hf_path))
        from .models.decoder import PRESETS  # here: the models package imports nothing from config

        if self.preset not in PRESETS:
            raise ValueError(f"model.preset={self.preset!r} is not a built-in preset: choose one of {', '.join(PRESETS)}")


@dataclass(frozen=True)
class DataConfig:
    """What offload-train reads, and how it batches it."""

    path: str | None = None
    """A directory (read recursively) or file of .txt, .md, .py or .jsonl ("text" field) documents;
    None = the Python standard library's own sources, present on every machine."""

    seq_len: int = 256
    """Tokens per training sequence (byte-level tokens)."""

    batch_size: int = 8
    """Sequences per micro-batch."""

    eval_fraction: float = 0.05
    """Fraction of the sequences held out for the eval loss (the corpus's tail)."""

    max_tokens: int | None = 4_000_000
    """Read at most this many tokens of the corpus; None = all of it."""

    def __post_init__(self) -> None:
        _coerce_fields(self, "data")
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))
        for name in ("seq_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name}={getattr(self, name)} must be at least 1")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1)")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ValueError(f"data.max_tokens={self.max_tokens} must be at least 2, or None for the whole corpus")


@dataclass(frozen=True)
class TrainConfig:
    """The training run of offload-train: its length, outputs and checkpoints."""

    steps: int = 200
    """Optimizer steps to train for (a resumed run continues up to this many in all)."""

    out_dir: str = "runs/offload-train"
    """Where the run writes its config, metrics (metrics.jsonl) and checkpoints (ckpt-NNNNNN)."""

    checkpoint_every: int = 100
    """Save a checkpoint every this many optimizer steps, and always at the end; 0 = only at the end."""

    eval_batches: int = 16
    """Batches of held-out data the eval loss is averaged over."""

    num_threads: int | None = None
    """CPU threads for torch (torch.set_num_threads); None = torch's default."""

    trace_step: int | None = None
    """Write a Chrome/Perfetto trace of this optimizer step (1 = the first) to out_dir/trace.json;
    None = no trace. Open it at ui.perfetto.dev to see IO, compute and optimizer overlap."""

    export_dtype: str | None = "fp32"
    """At the end, write out_dir/model.safetensors (consolidated weights) in "fp32", "bf16" or
    "fp16"; None = no export."""

    def __post_init__(self) -> None:
        _coerce_fields(self, "train")
        if self.trace_step is not None and self.trace_step < 1:
            raise ValueError(f"train.trace_step={self.trace_step} must be 1 or more (1 = the first step), or none")
        if self.export_dtype is not None and self.export_dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"train.export_dtype={self.export_dtype!r} must be 'fp32', 'bf16', 'fp16' or none")
        if isinstance(self.out_dir, os.PathLike):
            object.__setattr__(self, "out_dir", os.fspath(self.out_dir))
        if self.steps < 1:
            raise ValueError(f"train.steps={self.steps} must be at least 1")
        if self.checkpoint_every < 0:
            raise ValueError(f"train.checkpoint_every={self.checkpoint_every} must be 0 (only at the end) or more")
        if self.eval_batches < 1:
            raise ValueError(f"train.eval_batches={self.eval_batches} must be at least 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"train.num_threads={self.num_threads} must be at least 1, or None for torch's default")


@dataclass(frozen=True)
class OffloadConfig:
    """The whole configuration of an offloaded training run; saved with every checkpoint.

    Sections may be given as mappings, which are read as a file's tables are:
    OffloadConfig(tiers={"params": "nvme", "nvme_dir": "/mnt/nvme"}).
    """

    tiers: TierConfig = TierConfig()
    """Homes of parameters, gradients and optimizer states, and the byte budget of each tier."""

    prefetch: PrefetchConfig = PrefetchConfig()
    """How far ahead the scheduler fetches groups."""

    grouping: GroupingConfig = GroupingConfig()
    """How modules are partitioned into groups that move together."""

    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer, its hyperparameters and its learning-rate schedule."""

    precision: PrecisionConfig = PrecisionConfig()
    """Compute dtype and fp16 loss scaling."""

    io: IOConfig = IOConfig()
    """The IO engine that moves NVMe bytes: threads, requests in flight, block size, O_DIRECT."""

    model: ModelConfig = ModelConfig()
    """The built-in model offload-train builds (unused by the engine API)."""

    data: DataConfig = DataConfig()
    """The corpus offload-train reads and its batching (unused by the engine API)."""

    train: TrainConfig = TrainConfig()
    """Length, outputs and checkpoints of an offload-train run (unused by the engine API)."""

    placement: PlacementMode = PlacementMode.MANUAL
    """"auto": the planner chooses each state kind's tiers and the lookahead at initialize
    (see PlacementMode.AUTO); "manual": the tiers and prefetch sections as written."""

    grad_accum_steps: int = 1
    """Micro-batches whose gradients are accumulated (in fp32) before each optimizer step."""

    seed: int = 0
    """Seed of every random number generator the trainer uses: the same seed gives the same loss."""

    def __post_init__(self) -> None:
        _coerce_fields(self, "")
        if self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps={self.grad_accum_steps} must be at least 1 (1 = no accumulation)")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed={self.seed} must be between 0 and 2**64 - 1")

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> OffloadConfig:
        """A config from nested mappings, one per section, as to_dict() writes and files hold.

        Unknown keys raise ValueError naming the key, its section, the closest allowed key and all
        of them; a value of the wrong type raises TypeError naming "section.field", the value and
        the type expected. Keys left out keep their defaults.
        """
        return _build(cls, data, "")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], defaults: Mapping[str, object] | None = None) -> OffloadConfig:
        """A config read from a .toml or .json file (see from_dict). Errors start with the path.

        `defaults`: nested mappings like a file's; the keys the file leaves out take these values
        (then the dataclass defaults), and the file is validated with them in place.
        """
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in (".toml", ".json"):
            raise ValueError(f"config file {path} has the suffix {suffix!r}: use a .toml or a .json file")
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"config file {path} cannot be read: {e}") from e
        if suffix == ".toml":
            if tomllib is None:
                raise ValueError(f"config file {path}: reading TOML needs Python 3.11 or later; use a .json file")
            try:
                data: object = tomllib.loads(text)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"config file {path} is not valid TOML: {e}") from e
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"config file {path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
                ) from e
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

    def with_overrides(self, overrides: Mapping[str, object]) -> OffloadConfig:
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
                raise _unknown_key(parts[0], "", list(top_level), full_key=key)
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
                raise _unknown_key(parts[1], section, list(field_types), full_key=key)
            section_changes.setdefault(section, {})[parts[1]] = _convert(
                raw, field_types[parts[1]], key, from_text=True
            )
        for section, changes in section_changes.items():
            base = top_changes.get(section, getattr(self, section))
            top_changes[section] = dataclasses.replace(base, **changes)  # type: ignore[type-var]
        return dataclasses.replace(self, **top_changes)


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
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
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
    for ch in text:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:  # TOML forbids raw control characters in strings
            out.append(f"\\u{ord(ch):04X}")
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
