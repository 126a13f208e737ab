"""The fleet's Prometheus metrics (``GET /metrics`` of :mod:`kvpool.fleet.router`), in a
registry of their own (one per fleet, so two fleets in one process never share counts).

Names (docs/ARCHITECTURE.md, "Fleet"; the Grafana row reads them):

* ``kvpool_fleet_requests_total{model,replica,code}``: answers, by HTTP status (a stream
  counts its status when its headers go out). Requests naming no model of the fleet count
  under ``model="-"``: a request's own text never becomes a label value (labels stay
  bounded whatever clients send);
* ``kvpool_fleet_queue_depth{model}``: requests waiting for a ready server;
* ``kvpool_fleet_inflight{model,replica}``: requests sent to a replica, not finished;
* ``kvpool_fleet_wakes_total{model}``: wakes of its servers, whoever caused them;
  ``kvpool_fleet_wake_seconds{model}``: the wakes the router asked for (``POST
  /wake_up`` before a request), measured;
* ``kvpool_fleet_sleeps_total{model,cause}``: cause ``idle`` (its ``sleep_after``),
  ``pressure`` (the daemon needed the memory), ``operator`` (``kvpool sleep``, ``POST
  /sleep``);
* ``kvpool_fleet_upstream_errors_total{model,kind}``: kind ``connect`` (no answer),
  ``broken`` (the server went away mid-answer), ``wake`` (a wake failed), ``start`` (a
  server did not start);
* ``kvpool_fleet_restarts_total{model}``: servers that died (or hung, and were killed)
  and were started again;
* ``kvpool_fleet_port_retries_total{model}``: server processes started again on another
  port because another process took theirs before they bound it (not restarts);
* ``kvpool_fleet_replica_up{model,replica,state}``: 1 for the replica's current state;
* ``kvpool_fleet_routed_total{model,replica,reason}``: which replica a request went to
  and why (``only``: one could take it; ``load``: the picker chose by load).

A cluster router's names (``vllm:num_requests_waiting`` ..., one series per model) are
collected into the same registry by :class:`~kvpool.fleet.router_protocol.FleetProtocol`.
"""

from __future__ import annotations

from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvpool.fleet.member import MemberState

CONTENT_TYPE = CONTENT_TYPE_LATEST
STATES: tuple[MemberState, ...] = get_args(MemberState)
CAUSES = ("idle", "pressure", "operator")
WAKE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
UNKNOWN = "-"  # the model label of a request that names none of the fleet's


class FleetMetrics:
    """Every fleet metric; the router and the supervisor update them (one event loop)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvpool_fleet_requests", "Requests answered, by status",
                                ["model", "replica", "code"], registry=r)
        self.queue_depth = Gauge("kvpool_fleet_queue_depth",
                                 "Requests waiting for a ready server", ["model"], registry=r)
        self.inflight = Gauge("kvpool_fleet_inflight", "Requests a replica is serving",
                              ["model", "replica"], registry=r)
        self.wakes = Counter("kvpool_fleet_wakes", "Wakes of the model's servers", ["model"],
                             registry=r)
        self.wake_seconds = Histogram("kvpool_fleet_wake_seconds",
                                      "Wakes the router asked for, seconds", ["model"],
                                      buckets=WAKE_BUCKETS, registry=r)
        self.sleeps = Counter("kvpool_fleet_sleeps", "Sleeps of the model's servers, by cause",
                              ["model", "cause"], registry=r)
        self.upstream_errors = Counter("kvpool_fleet_upstream_errors",
                                       "Requests a server failed, by kind", ["model", "kind"],
                                       registry=r)
        self.restarts = Counter("kvpool_fleet_restarts", "Servers restarted after dying",
                                ["model"], registry=r)
        self.port_retries = Counter("kvpool_fleet_port_retries", "Server processes started "
                                    "again on another port (theirs was taken)", ["model"],
                                    registry=r)
        self.replica_up = Gauge("kvpool_fleet_replica_up", "1 for the replica's state",
                                ["model", "replica", "state"], registry=r)
        self.routed = Counter("kvpool_fleet_routed", "Requests routed, by replica and reason",
                              ["model", "replica", "reason"], registry=r)

    def add_model(self, model: str, replicas: int) -> None:
        """Show the model's series from the start (zeros, every replica ``stopped``)."""
        self.queue_depth.labels(model).set(0)
        self.wakes.labels(model)
        self.wake_seconds.labels(model)
        self.restarts.labels(model)
        self.port_retries.labels(model)
        for cause in CAUSES:
            self.sleeps.labels(model, cause)
        for i in range(replicas):
            self.inflight.labels(model, str(i)).set(0)
            self.set_state(model, i, "stopped")

    def set_state(self, model: str, replica: int, state: MemberState) -> None:
        for s in STATES:
            self.replica_up.labels(model, str(replica), s).set(1 if s == state else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
