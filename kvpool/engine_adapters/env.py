"""``KVPOOL_*`` environment variables every engine adapter reads, in one table."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar


def _kv_unit(text: str) -> str:
    from kvpool.engine_adapters.kv_unit import kv_unit_mode

    return kv_unit_mode(text)


def _size(text: str) -> int:
    from kvpool.sizes import parse_size

    return parse_size(text)


def flag(text: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case)."""
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1 or 0")


def seconds_or_off(text: str) -> float | None:
    """Positive seconds; ``0``, ``off`` or empty: None (off)."""
    t = text.strip().lower()
    if t in ("", "0", "off", "none"):
        return None
    try:
        v = float(t)
    except ValueError:
        raise ValueError("expected seconds (a positive number) or 0/off") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError("expected seconds (a positive number) or 0/off")
    return v


class SettingsError(ValueError):
    """A ``KVPOOL_*`` variable has a value its setting cannot take; one line naming it."""


#: variable -> (settings field, parser)
TENANT_VARS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "KVPOOL_TENANT": ("name", str),
    "KVPOOL_RUN_DIR": ("run_dir", str),
    "KVPOOL_DEVICE": ("device", int),
    "KVPOOL_MIN": ("min_bytes", _size),
    "KVPOOL_MAX": ("max_bytes", _size),
    "KVPOOL_SHARES": ("shares", float),  # (KVPOOL_WEIGHT: its old name, kvpool.renames)
    "KVPOOL_IDLE_TIMEOUT": ("idle_timeout_s", float),
    "KVPOOL_SLEEPABLE": ("sleepable", flag),
    "KVPOOL_SLEEP_AFTER": ("sleep_after_s", seconds_or_off),
    "KVPOOL_GROUP": ("group", str),  # a label: the fleet it belongs to (kvpool ps)
    "KVPOOL_KV_UNIT": ("kv_unit", _kv_unit),  # small | exact (engine_adapters/kv_unit.py)
}


def tenant_fields(env: Mapping[str, str], fields: set[str]) -> dict[str, Any]:
    """The settings among ``fields`` that ``env`` sets, parsed; a bad value raises
    :class:`SettingsError` (one line: the variable, its value, what it takes)."""
    from kvpool.renames import renamed_env

    try:
        env = renamed_env(env, "KVPOOL_WEIGHT", "KVPOOL_SHARES")
    except ValueError as e:
        raise SettingsError(str(e)) from None
    out: dict[str, Any] = {}
    for var, (field, parse) in TENANT_VARS.items():
        if field in fields and var in env:
            try:
                out[field] = parse(env[var])
            except (ValueError, TypeError) as e:
                raise SettingsError(f"{var}={env[var][:60]!r}: {e}") from None
    return out


S = TypeVar("S", bound="TenantSettings")


@dataclass
class TenantSettings:
    """What every adapter's engine tells the daemon and its allocator; adapters subclass
    it with their own fields. ``from_env`` fills the fields ``TENANT_VARS`` names."""

    name: str | None = None  # tenant name; default: the served model name
    run_dir: str | None = None
    device: int = 0
    min_bytes: int | None = None
    max_bytes: int | None = None  # its max (weights and KV); None: the daemon's default
    shares: float | None = None
    low: int = 1  # reserve watermarks, in chunks
    high: int = 2
    idle_timeout_s: float = 5.0
    # the daemon may put this tenant to sleep when a grant needs its memory (Register's
    # ``sleepable``; the daemon's config for the tenant wins)
    sleepable: bool = False
    sleep_after_s: float | None = None  # sleep after this long without a request
    group: str | None = None  # shown by kvpool ps (a fleet's name)
    # "small": KV blocks padded (at most 1/8) so one allocation unit is a few pages;
    # "exact": the engine's own block, lcm(page, block) per unit (.kv_unit)
    kv_unit: str = "small"

    @classmethod
    def from_env(cls: type[S]) -> S:
        return cls(**tenant_fields(os.environ, {f.name for f in fields(cls)}))
