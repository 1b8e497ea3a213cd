"""Where a state kind's bytes live: the tiers, a placement of fractions over them, and who decides it.

    Placement.parse("nvme")                          # everything on NVMe
    Placement.parse({"host": 0.2, "nvme": 0.8})      # fractions of the bytes, fastest tier first
    Placement.parse("host:0.2,nvme:0.8")             # the same, as a command line writes it
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass

from offload_trainer.config import json_text


class Tier(enum.Enum):
    """A place where a state's bytes can be homed, from fastest to largest."""

    DEVICE = "device"
    """Accelerator memory (the GPU), or plain CPU memory on a machine without one."""
    HOST = "host"
    """Host memory: page-aligned, and pinned under CUDA."""
    NVME = "nvme"
    """Files under TierConfig.nvme_dir, read and written through io_engine."""

    # Enum's own __hash__ is Python (hash of the name), and the engine's byte counters are dicts keyed
    # by Tier, added to for every copy and IO request: members are singletons compared by identity, so
    # the identity hash (C) is as good. (A set of tiers never had an order across processes: str
    # hashes are salted.)
    __hash__ = object.__hash__

    @classmethod
    def named(cls, tier: "Tier | str", what: str = "tier") -> "Tier":
        """`tier` itself, or the Tier whose name it is ("host", case-insensitive); ValueError naming
        `what` (the argument or setting it came from) and every tier's name otherwise."""
        if isinstance(tier, Tier):
            return tier
        if isinstance(tier, str):
            try:
                return cls(tier.strip().lower())
            except ValueError:
                pass
        names = ", ".join(repr(t.value) for t in cls)
        raise ValueError(f"{what}={tier!r} is not a tier: give one of {names}, or a Tier (offload_trainer.Tier.HOST)")



class PlacementMode(enum.Enum):
    """Who decides where state lives: the config's tiers section, or the planner."""

    MANUAL = "manual"
    """tiers.params / grads / optimizer and prefetch.lookahead_groups as written."""
    AUTO = "auto"
    """The planner (offload_trainer.planning) chooses them at initialize, within the budgets,
    from the machine's measured rates and the model's compute time for one micro-batch (the
    `micro_batch` given to initialize); what was written for them is replaced."""



_TIER_NAMES = ", ".join(repr(t.value) for t in Tier)


@dataclass(frozen=True)
class Placement:
    """Fractions of one state kind's bytes homed on each tier (sum to 1)."""

    TYPE_DESCRIPTION = f"a tier name ({_TIER_NAMES}) or a table of tier fractions"
    """How the config loader describes a placement in its messages (see config/loader.py)."""

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
                mapping = json_text.loads(text)
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
