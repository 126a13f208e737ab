"""The values of a fleet file (``FLEET.toml``): :class:`FleetConfig`, its
:class:`DaemonSection` and :class:`ModelEntry` s, frozen. :func:`kvpool.fleet.config.load`
reads and checks a file into them; the fleet's parts (server kinds, router, supervisor)
only read them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class DaemonSection:
    """``[daemon]``: the daemon ``--with-daemon`` starts (ignored without it)."""

    budget: str | None = None  # None: the daemon's default
    page_size: str | None = None
    backend: str = "host"


@dataclass(frozen=True)
class ModelEntry:
    """One ``[[models]]`` entry: a served model and the tenant knobs of its replicas."""

    name: str
    checkpoint: Path  # absolute (relative paths are the fleet file's)
    engine: str = "bundled"
    replicas: int = 1
    eager: bool = False
    min: int | None = None  # bytes (None: the daemon's config or default)
    max: int | None = None
    shares: float | None = None  # its part of contended memory (None: the daemon's)
    sleepable: bool = True
    sleep_after: float | None = None  # seconds idle before it sleeps itself
    weights: str = "pool"  # bundled only: "pool" or "local"
    kv_cache_size: int = 256 << 20
    max_num_seqs: int = 32
    routing: str = "least_loaded"
    args: tuple[str, ...] = ()

    def tenant(self, index: int) -> str:
        """The tenant name of replica ``index`` (``name``, then ``name-1`` ...)."""
        return self.name if index == 0 else f"{self.name}-{index}"


@dataclass(frozen=True)
class FleetConfig:
    path: Path
    name: str  # the tenant group of every member
    host: str = "127.0.0.1"
    port: int = 8080
    queue: int = 64  # per model: requests waiting for a ready server
    start_timeout_s: float = 180.0
    hung_after_s: float = 30.0  # a ready member silent this long: hung, no requests
    hung_restart_s: float = 120.0  # ... silent this long: killed and started again
    daemon: DaemonSection = DaemonSection()
    models: tuple[ModelEntry, ...] = ()
    # how the models share the device: a name of kvpool.fleet.policies.FLEET_POLICIES,
    # and that policy's knobs (every one, checked; the defaults where the file gives none)
    policy: str = "kvpool"
    policy_knobs: Mapping[str, float] = field(default_factory=dict)

    def entry(self, name: str) -> ModelEntry | None:
        return next((m for m in self.models if m.name == name), None)
