"""How a bundled engine joins kvpool: :class:`Settings` (``KVPOOL_*`` variables) and the
adapter's error."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.engine_adapters.env import TenantSettings


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
