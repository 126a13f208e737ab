"""Weighted fair shares with floors and caps: the arbitration policy, as pure functions.

The knobs are cgroup-v2's memory controller's: ``min`` is protected (never reclaimed),
``max`` is a hard cap, ``shares`` (cgroup ``cpu.shares``-like: a proportional count)
splits contended memory. A tenant's *fair share* is what weighted max-min fairness gives
it when every tenant asks for ``demand`` bytes:

    share_i = clamp(level * shares_i, floor_i, cap_i)
    floor_i = min(min_i, cap_i),  cap_i = min(max_i, demand_i)

with ``level`` the largest value for which the shares fit the budget. Tenants that
want less than their part by shares leave the rest to the others (work conserving).

This is the ``fair_share`` reclaim policy's split (:mod:`kvpool.daemon.policy` derives
who gives back and who may grow from it). No I/O here: the daemon feeds in its
accounting, so the split is unit-testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    """One tenant as the policy sees it (all sizes in bytes)."""

    name: str
    held: int  # granted now: mapped pages, reserve and lease
    demand: int  # what it would hold if memory were free (held + waiting requests)
    min: int = 0
    max: int = 1 << 62
    shares: float = 1.0

    @property
    def cap(self) -> int:
        return max(0, min(self.max, self.demand))

    @property
    def floor(self) -> int:
        return min(self.min, self.cap)


def fair_shares(budget: int, claims: list[Claim], unit: int = 1) -> dict[str, int]:
    """Each tenant's fair share of ``budget``, rounded down to multiples of ``unit``.

    Invariants: ``floor <= share <= cap`` for every tenant (floors win over the budget
    only when the floors alone exceed it, a misconfiguration the caller reports), and
    the shares sum to at most ``max(budget, sum of floors)``.
    """
    if not claims:
        return {}
    floors = {c.name: c.floor for c in claims}
    if sum(floors.values()) >= budget:
        return {n: round_down(v, unit) for n, v in floors.items()}

    def total(level: float) -> float:
        return sum(min(c.cap, max(c.floor, level * c.shares)) for c in claims)

    lo, hi = 0.0, max((c.cap / c.shares for c in claims if c.shares > 0), default=0.0)
    if total(hi) <= budget:  # everybody fits: shares are the caps
        return {c.name: round_down(c.cap, unit) for c in claims}
    for _ in range(100):  # bisection on the water level; 100 halvings reach float precision
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
    return {c.name: round_down(min(c.cap, max(c.floor, lo * c.shares)), unit) for c in claims}


def round_down(x: float, unit: int) -> int:
    """``x`` rounded down to a multiple of ``unit``."""
    return int(x) // unit * unit
