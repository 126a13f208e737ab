"""The daemon's Prometheus exporter (``--metrics-address HOST:PORT``, off by default).

One thread of its own serves ``/metrics``; the single-threaded event loop never waits
for a scraper. At each scrape the collector asks its :class:`SnapshotSource` (the loop's
observer) for a :class:`~kvpool.daemon.measures.Snapshot` (built between two requests,
the same view ``kvpool ps`` gets, always newer than the scrape) and turns it into metric
families: nothing is computed on the grant path but a few integer increments (see
:mod:`kvpool.daemon.observe`). If the loop does not answer within two seconds the
previous snapshot is served, and ``kvpool_snapshot_age_seconds`` says how old it is.

What scrapes cost the loop is bounded whatever their rate (issue 24): scrapes are
answered one at a time by that one thread (others wait in the listen backlog), and a
scrape that comes less than :data:`MIN_INTERVAL_S` after the previous snapshot waits
(sleeping, off the loop and the GIL) until that interval has passed — so the loop builds
at most one snapshot per interval and the exporter renders at most one text per
interval, whether one Prometheus or a flood asks. ``kvpool_snapshots_built`` counts the
snapshots. A client that connects and sends nothing is dropped after
:data:`CLIENT_TIMEOUT_S`; it delays other scrapes meanwhile, never a grant.

Tenant names are visible in the metrics, so the exporter listens on loopback only unless
``metrics_allow_remote`` is set.
"""

from __future__ import annotations

import ipaddress
import itertools
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, Sequence
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector,
                               generate_latest)
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from kvpool import protocol as p
    from kvpool.daemon.measures import Snapshot

HIST_HELP = {
    "grant_service": ("kvpool_grant_service_seconds",
                      "Time the daemon spent serving a grant that fitted at once."),
    "grant_wait": ("kvpool_grant_wait_seconds",
                   "Time a grant or lease waited for reclaim before it was served."),
    "reclaim_round": ("kvpool_reclaim_round_seconds",
                      "Duration of a reclaim round (first waiting request to none waiting)."),
    "tenant_drop": ("kvpool_tenant_memory_return_seconds",
                    "Time to return a departed tenant's memory to the pool."),
}
POOL_GAUGES = (("budget", "Bytes the daemon may hand out."),
               ("granted", "Bytes in tenants' page tables."),
               ("warm", "Bytes of zeroed pages ready to grant."),
               ("dirty", "Bytes released and not yet zeroed."),
               ("leased", "Bytes leased to tenants (outside kvpool's mappings)."),
               ("free", "Budget not granted, warm, dirty (nor leased)."),
               ("waiting", "Bytes asked by requests waiting for reclaim."),
               ("retained", "Bytes released but still referenced by their tenant."),
               ("weights", "Bytes of weight sets, each counted once (in granted too)."),
               ("weights_cached", "Bytes of weight sets nobody holds (reclaimed first)."))
TENANT_GAUGES = (("mapped", "Bytes granted to the tenant."),
                 ("in_use", "Bytes the tenant reports in use."),
                 ("reserve", "Bytes mapped but idle (the tenant's reserve)."),
                 ("lease", "Bytes leased."),
                 ("fair_share", "Its fair share of the budget now (by shares)."),
                 ("min", "Guaranteed memory (never reclaimed)."),
                 ("max", "Hard limit."),
                 ("asked", "Bytes the daemon is waiting for the tenant to give back."),
                 ("waiting", "Bytes of the tenant's requests waiting for reclaim."),
                 ("weights", "Bytes of the weight sets the tenant holds (each whole)."))
LOOPBACK_NAMES = ("localhost",)
MIN_INTERVAL_S = 0.1  # at most one snapshot (and one rendered text) per this
CLIENT_TIMEOUT_S = 2.0  # a scraper that sends nothing this long is dropped


class SnapshotSource(Protocol):
    """Where the exporter's thread gets the daemon's state (``observe.Observer``)."""

    def snapshot_from_loop(self, timeout_s: float | None = None) -> Snapshot | None:
        """From the exporter's thread: a snapshot built by the event loop (or the last
        one, when the loop does not get to it in time); None before the first. Must
        not touch the daemon's state from this thread."""

    @property
    def snapshots_built(self) -> int:
        """How many snapshots the loop built for this exporter so far."""


class AddressError(ValueError):
    """A metrics address the daemon refuses (bad syntax, or not loopback)."""


def parse_address(text: str, allow_remote: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> ``(host, port)``. Refuses a host
    that is not a loopback address unless ``allow_remote``."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host:
        raise AddressError(f"metrics address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9400")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port_n = int(port)
    except ValueError:
        raise AddressError(f"metrics address {text!r}: port {port!r} is not a number") from None
    if not 0 <= port_n <= 65535:
        raise AddressError(f"metrics address {text!r}: port {port_n} is out of range")
    if host in LOOPBACK_NAMES:
        return "127.0.0.1", port_n
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise AddressError(f"metrics address {text!r}: {host!r} is not an IP address") from None
    if not ip.is_loopback and not allow_remote:
        raise AddressError(f"metrics address {text!r} is not loopback: tenant names would be "
                           f"visible off this host (set metrics_allow_remote = true, or "
                           f"--metrics-allow-remote, to allow it)")
    return host, port_n


class DaemonCollector:
    """Metric families from loop-built snapshots (see the module docstring): one per
    device (``sources``, the first device's first), each family's samples labelled with
    its device and merged into one family; the snapshot gauges are the first's."""

    def __init__(self, sources: Sequence[SnapshotSource]):
        self.sources = list(sources)
        self.source = self.sources[0]

    def collect(self) -> Iterator[Metric]:
        snaps = [src.snapshot_from_loop() for src in self.sources]
        snap = snaps[0]
        if snap is None:
            return
        merged: dict[str, Metric] = {}
        for one in snaps:
            if one is None:
                continue
            for fam in itertools.chain(self._pool(one), self._tenants(one),
                                       self._counters(one), self._histograms(one)):
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        yield from merged.values()
        age = GaugeMetricFamily("kvpool_snapshot_age_seconds",
                                "Age of the daemon state these metrics show.")
        age.add_metric([], max(0.0, time.time() - snap.taken))
        yield age
        build = GaugeMetricFamily("kvpool_snapshot_build_seconds", "Time the event loop "
                                  "spent building that state (between two requests).")
        build.add_metric([], snap.build_s)
        yield build
        built = CounterMetricFamily("kvpool_snapshots_built", "Snapshots the event loop "
                                    "built for scrapes (at most one per "
                                    f"{MIN_INTERVAL_S:g} s, whatever the scrape rate).")
        built.add_metric([], self.source.snapshots_built)
        yield built

    @staticmethod
    def _pool(snap: Snapshot) -> Iterator[Metric]:
        pool, dev = snap.pool, [str(snap.pool.device)]
        for key, text in POOL_GAUGES:
            g = GaugeMetricFamily(f"kvpool_pool_{key}_bytes", text, labels=["device"])
            g.add_metric(dev, getattr(pool, key))
            yield g
        g = GaugeMetricFamily("kvpool_pool_page_size_bytes", "Page size.", labels=["device"])
        g.add_metric(dev, pool.page_size)
        yield g
        g = GaugeMetricFamily("kvpool_waiting_requests", "Grants and leases waiting for "
                              "reclaim.", labels=["device"])
        g.add_metric(dev, snap.waiters)
        yield g
        g = GaugeMetricFamily("kvpool_recovering", "1 while the daemon rebuilds its "
                              "accounting after a restart.", labels=["device"])
        g.add_metric(dev, int(pool.recovering))
        yield g
        g = GaugeMetricFamily("kvpool_tenants", "Tenants listed by ps.", labels=["device"])
        g.add_metric(dev, len(snap.tenants))
        yield g
        c = CounterMetricFamily("kvpool_pages_created", "Pages created since start.",
                                labels=["device"])
        c.add_metric(dev, pool.created)
        yield c

    @staticmethod
    def _tenants(snap: Snapshot) -> Iterator[Metric]:
        labels = ["tenant", "tenant_id", "kind", "device"]
        dev = str(snap.pool.device)
        rows = [([t.name, str(t.id), t.kind, dev], t) for t in snap.tenants]
        for key, text in TENANT_GAUGES:
            g = GaugeMetricFamily(f"kvpool_tenant_{key}_bytes", text, labels=labels)
            for lv, t in rows:
                g.add_metric(lv, getattr(t, key))
            yield g
        g = GaugeMetricFamily("kvpool_tenant_shares", "Its fair-share knob: shares of "
                              "contended memory (a proportional count).", labels=labels)
        for lv, t in rows:
            g.add_metric(lv, t.shares)
        yield g
        g = GaugeMetricFamily("kvpool_tenant_state", "1 for the tenant's state: ok, asked "
                              "(a reclaim outstanding), waiting, unresponsive.",
                              labels=[*labels, "state"])
        for lv, t in rows:
            g.add_metric([*lv, tenant_state(t)], 1)
        yield g
        g = GaugeMetricFamily("kvpool_tenant_asleep", "1 while the tenant says it is "
                              "asleep (holds no KV, no weight set), else 0.", labels=labels)
        for lv, t in rows:
            g.add_metric(lv, 1 if t.state == "asleep" else 0)
        yield g
        g = GaugeMetricFamily("kvpool_tenant_sleepable", "1 when the daemon may put the "
                              "tenant to sleep under memory pressure.", labels=labels)
        for lv, t in rows:
            g.add_metric(lv, 1 if t.sleepable else 0)
        yield g
        c = CounterMetricFamily("kvpool_tenant_reclaims_ignored", "Reclaim asks the tenant "
                                "let expire.", labels=labels)
        for lv, t in rows:
            c.add_metric(lv, t.ignored)
        yield c

    @staticmethod
    def _counters(snap: Snapshot) -> Iterator[Metric]:
        n = snap.counters
        dev = [str(snap.pool.device)]

        def simple(name: str, text: str, key: str) -> Metric:
            c = CounterMetricFamily(name, text, labels=["device"])
            c.add_metric(dev, n.get(key, 0))
            return c

        yield simple("kvpool_grants", "Grants served.", "grants")
        yield simple("kvpool_granted_pages", "Pages granted.", "grant_pages")
        yield simple("kvpool_releases", "Release and destroy-group requests served.", "releases")
        yield simple("kvpool_released_pages", "Pages given back by tenants.", "release_pages")
        yield simple("kvpool_leases", "Leases granted (or grown).", "leases")
        yield simple("kvpool_waits", "Grants and leases that had to wait for reclaim.", "waits")
        yield simple("kvpool_limit_changes", "Knob changes (kvpool limit).", "limit_changes")
        yield simple("kvpool_reclaim_rounds", "Reclaim rounds completed.", "rounds")
        c = CounterMetricFamily("kvpool_reclaim_rounds_by_stage", "Reclaim rounds that took "
                                "memory from a stage: warm_pool, reserves, shrink.",
                                labels=["device", "stage"])
        for stage in ("warm_pool", "reserves", "shrink"):
            c.add_metric([*dev, stage], n.get(("rounds_by_stage", stage), 0))
        yield c
        c = CounterMetricFamily("kvpool_reclaim_asks", "Reclaim asks sent, by mode.",
                                labels=["device", "mode"])
        for mode in ("reserve", "shrink"):
            c.add_metric([*dev, mode], n.get(("asks", mode), 0))
        yield c
        c = CounterMetricFamily("kvpool_reclaimed_bytes", "Bytes given back by asked "
                                "tenants, by tenant and mode.",
                                labels=["device", "tenant", "mode"])
        for key, v in sorted((k, v) for k, v in n.items() if k[0] == "reclaimed_bytes"):
            c.add_metric([*dev, key[1], key[2]], v)
        yield c
        c = CounterMetricFamily("kvpool_answers", "Error answers, by code (NO_MEMORY, "
                                "OVER_LIMIT, ...).", labels=["device", "code"])
        for code in sorted(_codes()):
            c.add_metric([*dev, code], n.get(("answers", code), 0))
        yield c
        c = CounterMetricFamily("kvpool_tenant_departures", "Tenants gone: bye (clean) or "
                                "death (exit, EOF, dropped).", labels=["device", "how"])
        for how in ("bye", "death"):
            c.add_metric([*dev, how], n.get(("drops", how), 0))
        yield c
        for name, text, value in (
                ("kvpool_requests", "Control requests received.", snap.requests),
                ("kvpool_errors", "Error answers of any kind.", snap.errors),
                ("kvpool_hostile_refused", "Messages refused as malformed or unauthorized.",
                 snap.refused),
                ("kvpool_events", "Decision events recorded.", snap.events)):
            c = CounterMetricFamily(name, text, labels=["device"])
            c.add_metric(dev, value)
            yield c

    @staticmethod
    def _histograms(snap: Snapshot) -> Iterator[Metric]:
        for key, (name, text) in HIST_HELP.items():
            h = snap.hists[key]
            buckets: list[tuple[str, float]] = []
            acc = 0
            for bound, count in zip([*map(_le, h.bounds), "+Inf"], h.counts):
                acc += count
                buckets.append((bound, acc))
            fam = HistogramMetricFamily(name, text, labels=["device"])
            fam.add_metric([str(snap.pool.device)], buckets, sum_value=h.sum)
            yield fam


def _le(bound: float) -> str:
    return repr(float(bound))


def _codes() -> frozenset[str]:
    from kvpool import protocol as p

    return p.CODES


def tenant_state(t: p.TenantInfo) -> str:
    if t.unresponsive:
        return "unresponsive"
    if t.waiting:
        return "waiting"
    if t.asked:
        return "asked"
    return "ok"


class Exporter:
    """``/metrics`` on ``host:port``, one scrape at a time from a thread of its own, at
    most one snapshot per ``interval_s`` (see the module docstring)."""

    def __init__(self, sources: Sequence[SnapshotSource], host: str, port: int,
                 interval_s: float = MIN_INTERVAL_S):
        """``sources``: every device's observer (the first device's first)."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(sources))
        ProcessCollector(namespace="kvpool_daemon", registry=self.registry)
        self.interval_s = interval_s
        self._next = 0.0  # monotonic time before which no snapshot is asked
        server_class = _V6Server if ":" in host else _V4Server
        self.httpd = make_server(host, port, self._app, server_class=server_class,
                                 handler_class=_QuietHandler)
        self.port = self.httpd.server_address[1]
        self.host = host
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                       name="kvpool-metrics")
        self.thread.start()

    def render(self) -> bytes:
        """The exposition text of a fresh snapshot, no sooner than ``interval_s`` after
        the previous one (the server's one thread only)."""
        wait = self._next - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        try:
            return generate_latest(self.registry)
        finally:
            self._next = time.monotonic() + self.interval_s

    def _app(self, environ: dict[str, Any],
             start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: /metrics only\n"]
        body = self.render()
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST),
                                  ("Content-Length", str(len(body)))])
        return [body]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _V4Server(WSGIServer):
    """One request at a time (no thread per scrape)."""

    request_queue_size = 64
    timeout = CLIENT_TIMEOUT_S

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, addr = super().get_request()
        conn.settimeout(CLIENT_TIMEOUT_S)  # a silent client cannot hold the thread
        return conn, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up or timed out: nothing to say


class _V6Server(_V4Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

