"""``KVPOOL_*`` environment variables every engine adapter reads, in one table."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


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
