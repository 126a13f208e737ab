"""Weighted fair shares with floors and caps: the arbitration policy, as pure functions.

The knobs are cgroup-v2's memory controller's: ``min`` is protected (never reclaimed),
``max`` is a hard cap, ``weight`` splits contended memory. A tenant's *fair share* is
what weighted max-min fairness gives it when every tenant asks for ``demand`` bytes:

    share_i = clamp(level * weight_i, floor_i, cap_i)
    floor_i = min(min_i, cap_i),  cap_i = min(max_i, demand_i)

with ``level`` the largest value for which the shares fit the budget. Tenants that
want less than their weighted part leave the rest to the others (work conserving).

Reclaim takes memory only from tenants holding more than their share, largest excess
first, and never below ``max(min, share)``. No I/O here: the daemon feeds in its
accounting and acts on the plan, so the policy is unit-testable on its own.
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
    weight: float = 1.0

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
        return {n: _round(v, unit) for n, v in floors.items()}

    def total(level: float) -> float:
        return sum(min(c.cap, max(c.floor, level * c.weight)) for c in claims)

    lo, hi = 0.0, max((c.cap / c.weight for c in claims if c.weight > 0), default=0.0)
    if total(hi) <= budget:  # everybody fits: shares are the caps
        return {c.name: _round(c.cap, unit) for c in claims}
    for _ in range(100):  # bisection on the water level; 100 halvings reach float precision
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
    return {c.name: _round(min(c.cap, max(c.floor, lo * c.weight)), unit) for c in claims}


def _round(x: float, unit: int) -> int:
    return int(x) // unit * unit


def reclaim_plan(
    budget: int, claims: list[Claim], need: int, unit: int = 1
) -> list[tuple[str, int]]:
    """Who gives back how much so that ``need`` more bytes fit, fairly.

    Only tenants above their fair share give, largest excess first, none below
    ``max(min, share)``. The plan may total less than ``need`` when everyone is at or
    below their share: the requester is then itself at its fair share and must wait.
    """
    shares = fair_shares(budget, claims, unit)
    excess = sorted(
        ((c.held - max(c.min, shares[c.name]), c.name) for c in claims),
        reverse=True,
    )
    plan: list[tuple[str, int]] = []
    for amount, name in excess:
        if need <= 0 or amount <= 0:
            break
        take = min(amount, -(-need // unit) * unit)
        take = _round(take, unit) or min(amount, unit)
        plan.append((name, take))
        need -= take
    return plan


def may_grow(budget: int, claims: list[Claim], name: str, nbytes: int, unit: int = 1) -> bool:
    """Whether ``name`` may take ``nbytes`` more by reclaiming from others: only up to
    its fair share (free memory it may always take, up to its ``max``)."""
    shares = fair_shares(budget, claims, unit)
    me = next(c for c in claims if c.name == name)
    return me.held + nbytes <= max(shares[name], me.min)
