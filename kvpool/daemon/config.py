"""The daemon's configuration: one dataclass, filled from defaults, a TOML file and flags.

TOML layout (see ``systemd/kvpool.toml``)::

    backend = "auto"          # auto | host | cuda
    device = 0
    budget = "80%"            # bytes, a size ("24GiB") or a share of device memory
    page_size = "2MiB"
    run_dir = "/run/kvpool"
    socket_group = "kvpool"   # group owning the run directory (0750) and sockets (0660)
    admin_group = "kvpool-admin"  # members may change others' knobs and stop the daemon
    reclaim_timeout_s = 2.0   # deadline of a reclaim (a waiting grant gets NO_MEMORY after)
    recover_timeout_s = 5.0   # after a restart, wait this long for old tenants to report
    warm_min = "0"            # zeroed pages kept ready (size or page count "16p")
    warm_max = "256MiB"
    default_max = "100%"      # a tenant's hard limit unless configured (share of budget)

    [tenants.llama-8b]        # per-tenant policy by name
    min = "4GiB"
    max = "20GiB"
    weight = 2.0
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.sizes import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class TenantPolicy:
    """Arbitration knobs of a tenant (same meaning as cgroup-v2 memory.min/max/weight)."""

    min: int | str = 0
    max: int | str | None = None  # None: the daemon's default_max
    weight: float = 1.0
    uids: list[int] = field(default_factory=list)  # who may claim this name; empty: anyone
    group: str | None = None  # members of this group may claim this name too


@dataclass
class Config:
    """Everything the daemon needs. Sizes may be strings until :meth:`resolve`."""

    backend: str = "auto"
    device: int = 0
    budget: int | str = "80%"
    page_size: int | str | None = None  # None: the backend's default
    run_dir: str | None = None
    socket_mode: int = 0o660
    socket_group: str | None = None
    admin_group: str | None = None  # besides root and the daemon's own uid
    warm_min: int | str = 0
    warm_max: int | str = "256MiB"
    default_max: int | str = "100%"
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    # timers (seconds)
    tick_s: float = 0.02  # idle work granularity (warm pool refill/trim, zeroing)
    liveness_s: float = 0.25  # how often to check tenant pids (pidfds cover most cases)
    register_timeout_s: float = 10.0  # fd-channel sessions that never register are dropped
    send_timeout_s: float = 2.0  # a tenant whose fd socket stays full this long is dropped
    reclaim_timeout_s: float = 2.0  # deadline of reclaim asks and of requests waiting on them
    recover_timeout_s: float = 5.0  # after a restart: how long grants wait for old tenants
    log_level: str = "INFO"
    # caps (a session or tenant past one gets a clear refusal)
    max_sessions_per_uid: int = 64
    max_sessions: int = 1024
    max_groups_per_tenant: int = 64
    max_virtual_pages_per_tenant: int = 1 << 20

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, **overrides: Any) -> "Config":
        """Defaults, then the TOML file at ``path``, then non-None ``overrides``."""
        values: dict[str, Any] = {}
        if path:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        values.update({k: v for k, v in overrides.items() if v is not None})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
        tenants = values.pop("tenants", {}) or {}
        if not isinstance(tenants, dict):
            raise ValueError("[tenants] must be a table of tables")
        cfg = cls(**values)
        cfg.tenants = {}
        for name, policy in tenants.items():
            if isinstance(policy, TenantPolicy):
                cfg.tenants[name] = policy
                continue
            extra = set(policy) - {"min", "max", "weight", "uids", "group"}
            if extra:
                raise ValueError(f"[tenants.{name}]: unknown keys {', '.join(sorted(extra))}")
            cfg.tenants[name] = TenantPolicy(**policy)
        return cfg

    def resolve_pages(self, value: int | str, page_size: int, total: int) -> int:
        """A size (or ``Np`` page count) as a number of pages, rounded down."""
        if isinstance(value, str) and value.strip().endswith("p") and value.strip()[:-1].isdigit():
            return int(value.strip()[:-1])
        return parse_size(value, total) // page_size

    def policy(self, name: str) -> TenantPolicy:
        return self.tenants.get(name, TenantPolicy())

    @property
    def run_path(self) -> Path:
        from kvpool.paths import run_dir

        return run_dir(self.run_dir)
