"""How a bundled engine joins kvpool: :class:`Settings` (``KVPOOL_*`` variables) and the
adapter's error."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TypeVar

from kvpool.engine_adapters.env import TenantSettings

WEIGHTS_MODES = ("pool", "local")
# how long a starting engine waits for the memory it cannot serve without (its weight set,
# its KV cache's first chunk) while the daemon answers NO_MEMORY
MEMORY_WAIT_S = 600.0
B = TypeVar("B", bound="Settings")


class AdapterError(RuntimeError):
    """The engine, its layout or the settings are not something this adapter supports."""


@dataclass
class Settings(TenantSettings):
    """How this engine joins kvpool; ``from_env`` reads ``KVPOOL_*`` variables."""

    populate: bool = True  # fault granted pages in at map time (off the step path)
    # each request's KV in its own allocation units, so it can be handed to another
    # engine (prefill/decode pairs); turns the prefix cache off
    request_aligned: bool = False
    # where the server this engine runs in listens (loopback http; kvpool.protocol.endpoint),
    # registered with the tenant so a successor can find it by name (.locate.announce)
    endpoint: str | None = None
    # "pool": the model's parameters live in a weight set shared with every engine of the
    # same checkpoint (.weights); "local": in the engine's own memory. KVPOOL_WEIGHTS
    weights: str = "pool"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS_MODES:
            raise ValueError(f"weights must be pool or local, not {self.weights!r}")

    @classmethod
    def from_env(cls: type[B]) -> B:
        s = super().from_env()
        mode = os.environ.get("KVPOOL_WEIGHTS")
        return s if mode is None else dataclasses.replace(s, weights=mode.strip().lower())
