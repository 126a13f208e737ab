"""``KVPOOL_*`` environment variables every engine adapter reads, in one table."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar


def _size(text: str) -> int:
    from kvpool.sizes import parse_size

    return parse_size(text)


#: variable -> (settings field, parser)
TENANT_VARS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "KVPOOL_TENANT": ("name", str),
    "KVPOOL_RUN_DIR": ("run_dir", str),
    "KVPOOL_DEVICE": ("device", int),
    "KVPOOL_MIN": ("min_bytes", _size),
    "KVPOOL_MAX": ("max_bytes", _size),
    "KVPOOL_WEIGHT": ("weight", float),
    "KVPOOL_IDLE_TIMEOUT": ("idle_timeout_s", float),
}


def tenant_fields(env: Mapping[str, str], fields: set[str]) -> dict[str, Any]:
    """The settings among ``fields`` that ``env`` sets, parsed (a bad value raises)."""
    out: dict[str, Any] = {}
    for var, (field, parse) in TENANT_VARS.items():
        if field in fields and var in env:
            out[field] = parse(env[var])
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
    weight: float | None = None
    low: int = 1  # reserve watermarks, in chunks
    high: int = 2
    idle_timeout_s: float = 5.0

    @classmethod
    def from_env(cls: type[S]) -> S:
        return cls(**tenant_fields(os.environ, {f.name for f in fields(cls)}))
