"""kvpool's gauges on a vLLM server's own ``/metrics``, beside vLLM's (whose names and
meanings stay vLLM's).

vLLM serves ``/metrics`` from its API-server process; kvpool's tenant (its allocator,
its session with the daemon) lives in the engine-core process. The API server has no
session of that tenant, so it asks the daemon itself, read-only: a ``monitor`` session
(:class:`~kvpool.client_lib.Monitor`, the one ``kvpool ps`` uses; it holds no memory)
reads ``stats`` (the pool and every tenant in one reply) and picks the tenant by its
name (the served model name, or ``KVPOOL_TENANT``). The answer is read off the scrape
path by a :class:`~kvpool.engine_adapters.room_watch.RoomWatch` (a scrape never waits on
the daemon; it gets the last answer, at most one scrape interval old).

Exported, with vLLM's ``model_name`` label, every value finite and non-negative:

=============================  =====================================================
``kvpool:asleep``              1 while the tenant is asleep (kvpool's sleep: no KV)
``kvpool:granted_bytes``       what the tenant holds (its page tables and lease)
``kvpool:min_bytes``           its guaranteed minimum
``kvpool:max_bytes``           its limit (0: none)
``kvpool:pool_free_bytes``     what any grant could get from the pool now
=============================  =====================================================

Not exported for a vLLM tenant: ``kvpool:headroom_bytes`` and the block gauges of
``kvpool serve`` — the daemon answers ``Room`` (headroom) only to the tenant's own
session, and the block counts are the engine core's; computing headroom here from
``stats`` would be a second copy of the daemon's grant rule. Nothing is exported while
the daemon is unreachable or the tenant is not registered (yet, or any more).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric

from kvpool import protocol as p
from kvpool.engine_adapters.room_watch import RoomWatch

if TYPE_CHECKING:
    from kvpool.client_lib import Monitor

MONITOR_TIMEOUT_S = 5.0
HELP = {
    "kvpool:asleep": "1 while the model sleeps (it holds no KV).",
    "kvpool:granted_bytes": "Bytes this server's tenant holds (its grant).",
    "kvpool:min_bytes": "The tenant's guaranteed minimum, bytes.",
    "kvpool:max_bytes": "The tenant's limit, bytes.",
    "kvpool:pool_free_bytes": "Bytes of the daemon's pool free now.",
}


@dataclass(frozen=True)
class TenantView:
    """What the daemon's ``stats`` said of one tenant and the pool (bytes)."""

    asleep: bool
    granted: int
    min: int
    max: int
    pool_free: int


def view_of(name: str, stats: p.StatsReply) -> TenantView | None:
    """``name``'s view in a ``StatsReply`` (None when no registered engine tenant has
    that name)."""
    t = next((t for t in stats.tenants
              if t.name == name and t.kind == "engine" and t.registered), None)
    if t is None:
        return None
    pool = stats.pool
    free = pool.budget - pool.granted - pool.leased - pool.retained
    return TenantView(asleep=t.state == "asleep", granted=t.mapped + t.lease, min=t.min,
                      max=t.max, pool_free=max(0, free))


class DaemonView:
    """Asks the daemon for ``name()``'s view through one lazily opened monitor session
    (reopened after a failure). ``name`` is read at each ask: the API server learns the
    served name when vLLM builds its config."""

    def __init__(self, run_dir: str | None, name: Callable[[], str | None]) -> None:
        self.run_dir = run_dir
        self.name = name
        self._mon: Monitor | None = None
        self._lock = threading.Lock()

    def ask(self) -> TenantView | None:
        name = self.name()
        if not name:
            return None
        from kvpool.client_lib import Monitor

        with self._lock:
            try:
                if self._mon is None:
                    self._mon = Monitor(self.run_dir, timeout_s=MONITOR_TIMEOUT_S)
                return view_of(name, self._mon.stats())
            except BaseException:
                self.close_locked()
                raise

    def close_locked(self) -> None:
        if self._mon is not None:
            try:
                self._mon.close()
            finally:
                self._mon = None


def finite(v: float) -> float:
    return v if math.isfinite(v) and v >= 0 else 0.0


class KvpoolGauges:
    """The prometheus collector (registered on the registry vLLM's ``/metrics`` serves);
    :meth:`collect` never waits on the daemon beyond the watch's first answer."""

    def __init__(self, watch: RoomWatch[TenantView | None], model: Callable[[], str | None]
                 ) -> None:
        self.watch = watch
        self.model = model

    def describe(self) -> list[Metric]:
        """Nothing up front (the registry then does not scrape at registration)."""
        return []

    def collect(self) -> Iterator[Metric]:
        model = self.model()
        if not model:
            return
        view = self.watch.latest()
        if view is None:
            return

        def gauge(name: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, HELP[name], labels=["model_name"])
            g.add_metric([model], finite(v))
            return g

        yield gauge("kvpool:asleep", 1.0 if view.asleep else 0.0)
        yield gauge("kvpool:granted_bytes", float(view.granted))
        yield gauge("kvpool:min_bytes", float(view.min))
        yield gauge("kvpool:max_bytes", float(view.max))
        yield gauge("kvpool:pool_free_bytes", float(view.pool_free))


def collector(run_dir: str | None, name: Callable[[], str | None]) -> KvpoolGauges:
    """The API server's collector of ``name()``'s gauges from the daemon at ``run_dir``."""
    return KvpoolGauges(RoomWatch(DaemonView(run_dir, name).ask), name)
