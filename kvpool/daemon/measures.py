"""What the observer records: histograms (Prometheus ``le`` semantics), reclaim rounds,
and the :class:`Snapshot` of the daemon's state the metrics exporter reads. Plain data,
touched by the event loop's thread only (a snapshot is copied out whole)."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvpool import protocol as p

# bucket bounds (seconds)
FAST = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)
SLOW = (1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
HISTOGRAMS = {
    "grant_service": FAST,  # a grant served at once: time in the arbiter
    "grant_wait": SLOW,  # a grant or lease that waited for reclaim: request to answer
    "reclaim_round": SLOW,  # a reclaim round: first waiter to no waiter
    "tenant_drop": FAST,  # a departed tenant's memory back in the pool
}
BYE_REASONS = ("said bye", "daemon shutting down")


class Hist:
    """A cumulative-bucket histogram (Prometheus ``le`` semantics), loop thread only."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v

    def copy(self) -> "Hist":
        h = Hist(self.bounds)
        h.counts, h.sum = list(self.counts), self.sum
        return h


@dataclass
class Round:
    start: float
    free_at_start: int  # bytes free (warm, dirty, unallocated) when the round opened
    asked: Counter[str] = field(default_factory=Counter)  # tenant name -> bytes asked
    answered: Counter[str] = field(default_factory=Counter)  # tenant name -> bytes given back
    by_mode: Counter[str] = field(default_factory=Counter)  # reserve | shrink -> bytes given back
    slept: Counter[str] = field(default_factory=Counter)  # put to sleep -> bytes it held
    sleepers: set[int] = field(default_factory=set)  # their tenant ids
    evicted: int = 0  # bytes of cached weight sets dropped
    granted: int = 0  # bytes granted to the round's waiters
    waiters: int = 0
    served: int = 0
    failed: int = 0


@dataclass
class Snapshot:
    """The daemon's state at one moment between two requests (built on the loop)."""

    taken: float
    pool: p.PoolInfo
    tenants: list[p.TenantInfo]
    counters: dict[Any, int]
    hists: dict[str, Hist]
    requests: int
    errors: int
    refused: int
    waiters: int
    uptime_s: float
    events: int
    build_s: float = 0.0  # time the loop spent building it
