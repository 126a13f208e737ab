"""How a bundled engine joins kvpool: :class:`Settings` (``KVPOOL_*`` variables) and the
adapter's error."""

from __future__ import annotations

import os
from dataclasses import dataclass


class AdapterError(RuntimeError):
    """The engine, its layout or the settings are not something this adapter supports."""


@dataclass
class Settings:
    """How this engine joins kvpool; ``from_env`` reads ``KVPOOL_*`` variables."""

    name: str | None = None  # tenant name; default: the served model name
    run_dir: str | None = None
    device: int = 0
    min_bytes: int | None = None
    weight: float | None = None
    low: int = 1  # reserve watermarks, in chunks
    high: int = 2
    idle_timeout_s: float = 5.0
    populate: bool = True

    @classmethod
    def from_env(cls) -> Settings:
        from dataclasses import fields

        from kvpool.engine_adapters.env import tenant_fields

        return cls(**tenant_fields(os.environ, {f.name for f in fields(cls)}))
