"""Where the p99 TTFT tail of an elastic run went: waiting for reclaim vs queued behind
compute, from the daemon's event stream (``kvpool events``).

:class:`EventTap` collects the daemon's events during the replay (polled with the memory
samples, so the daemon's ring buffer never wraps unseen; a gap is counted). For each
request in the tail, the time its model's tenant had a grant or lease waiting for
reclaim (``[event time - waited_s, event time]`` of grant / lease / deny events with a
``waited_s``) is intersected with the request's wait for its first token
(``[arrival, arrival + ttft]``): that is *reclaim wait*; the rest of its TTFT is *compute
queue* (prefill and waiting behind other requests). The arrival is the replay's start
plus the request's scheduled offset (the driver sends at that time, give or take the
event loop's latency).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

from kvpool import protocol as p

if TYPE_CHECKING:
    from kvpool.client_lib.admin import Monitor
    from kvpool.demo.driver import Outcome


class EventTap:
    """Every event of the daemon since the tap was made (``poll`` from any one thread)."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.events: list[dict[str, Any]] = []
        self.lost = 0
        self.since = 0
        self.since = self._drain(collect=False)  # from now on

    def _drain(self, collect: bool = True) -> int:
        since = self.since
        while True:
            reply = self.monitor.call(p.Events(since=since), p.EventsReply)
            if collect:
                self.events.extend(p.to_builtins(e) for e in reply.events)
                self.lost += reply.lost
            since = reply.next
            if len(reply.events) < p.EVENTS_LIMIT:
                return since

    def poll(self) -> None:
        self.since = self._drain()


def waits_by_tenant(events: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per tenant, the intervals during which one of its requests waited for reclaim."""
    out: dict[str, list[tuple[float, float]]] = {}
    for ev in events:
        waited = ev.get("detail", {}).get("waited_s")
        if waited and ev["kind"] in ("grant", "lease", "deny"):
            out.setdefault(ev["tenant"], []).append((ev["time"] - waited, ev["time"]))
    return out


def overlap(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` inside ``[lo, hi]``."""
    total, reach = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total += b - a
            reach = b
    return total


def breakdown(outcomes: Sequence[Outcome], events: list[dict[str, Any]], start_wall: float, q: float = 99.0) -> dict[str, Any]:
    """The TTFT tail (the slowest ``100 - q`` percent of finished requests, at least
    one) split into reclaim wait and compute queue (means over the tail, seconds)."""
    ok = sorted(((o, o.ttft) for o in outcomes if o.error is None and o.ttft is not None),
                key=lambda pair: pair[1])
    if not ok:
        return {}
    tail = ok[-max(1, math.ceil(len(ok) * (100 - q) / 100 - 1e-9)):]
    waits = waits_by_tenant(events)
    reclaim = [overlap(waits.get(o.model, []), start_wall + o.arrival,
                       start_wall + o.arrival + t) for o, t in tail]
    ttft = [t for _, t in tail]
    n = len(tail)
    return {"percentile": q, "requests": n, "ttft_s": sum(ttft) / n,
            "reclaim_wait_s": sum(reclaim) / n,
            "compute_queue_s": sum(t - r for t, r in zip(ttft, reclaim)) / n,
            "reclaim_share": sum(reclaim) / sum(ttft) if sum(ttft) else 0.0,
            "events": len(events)}
