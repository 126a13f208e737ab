"""Reclaim policies: how contended memory is split between tenants, one registry.

A policy answers three questions over the tenants' :class:`~kvpool.daemon.fairshare.Claim`
records (all sizes in bytes; ``unit`` is the page size, every answer a multiple of it):

* ``fair_shares(budget, claims, unit)`` — what each tenant is entitled to hold when everyone
  asks for its ``demand``;
* ``plan(budget, claims, need, unit)`` — who gives back how much so that ``need`` more
  bytes fit (the daemon sends those tenants ``shrink`` asks);
* ``may_grow(budget, claims, name, nbytes, unit)`` — whether ``name`` may take ``nbytes``
  more by reclaiming from others (free memory it may always take, up to its ``max``).

Obligations of an implementation (the arbiter relies on them; ``tests/daemon/
test_policy.py`` checks each registered policy against them):

1. pure and deterministic: no I/O, no clock, the same answer for the same claims;
2. ``floor <= share <= cap`` for every claim (``min`` is protected, ``max`` and demand
   cap), unless the floors alone exceed the budget;
3. a plan takes only from tenants above ``max(min, share)``, never more than that excess
   rounded up to ``unit``, largest excess first; it may total less than ``need``;
4. ``may_grow`` is true exactly when the grown holding stays within ``max(share, min)``.

``ShareBased`` derives 3 and 4 from ``fair_shares``: a new policy usually writes only
``fair_shares``. Register it in :data:`POLICIES` (a :class:`kvpool.registry.Registry`);
``reclaim_policy = "<name>"`` in kvpool.toml selects it (docs/ARCHITECTURE.md, "Adding a
reclaim policy").
"""

from __future__ import annotations

import abc
from typing import Protocol

from kvpool.daemon.fairshare import Claim, fair_shares, round_down
from kvpool.registry import Registry


class ReclaimPolicy(Protocol):
    """What the :class:`~kvpool.daemon.reclaim.Reclaimer` asks of a policy (above)."""

    name: str

    def fair_shares(self, budget: int, claims: list[Claim], unit: int) -> dict[str, int]: ...

    def plan(self, budget: int, claims: list[Claim], need: int,
             unit: int) -> list[tuple[str, int]]: ...

    def may_grow(self, budget: int, claims: list[Claim], name: str, nbytes: int,
                 unit: int) -> bool: ...


class ShareBased(abc.ABC):
    """A policy defined by its shares: the plan and the growth rule follow from them."""

    name: str

    @abc.abstractmethod
    def fair_shares(self, budget: int, claims: list[Claim], unit: int) -> dict[str, int]:
        """Each claim's share (obligation 2), a multiple of ``unit``."""

    def plan(self, budget: int, claims: list[Claim], need: int,
             unit: int) -> list[tuple[str, int]]:
        fair = self.fair_shares(budget, claims, unit)
        excess = sorted(((c.held - max(c.min, fair[c.name]), c.name) for c in claims),
                        reverse=True)
        out: list[tuple[str, int]] = []
        for amount, name in excess:
            if need <= 0 or amount <= 0:
                break
            take = min(amount, -(-need // unit) * unit)
            take = round_down(take, unit) or min(amount, unit)
            out.append((name, take))
            need -= take
        return out

    def may_grow(self, budget: int, claims: list[Claim], name: str, nbytes: int,
                 unit: int) -> bool:
        fair = self.fair_shares(budget, claims, unit)
        me = next(c for c in claims if c.name == name)
        return me.held + nbytes <= max(fair[name], me.min)


class FairShare(ShareBased):
    """Weighted max-min fairness with floors and caps (cgroup-v2's memory knobs;
    :func:`kvpool.daemon.fairshare.fair_shares`): the default."""

    name = "fair_share"

    def fair_shares(self, budget: int, claims: list[Claim], unit: int) -> dict[str, int]:
        return fair_shares(budget, claims, unit)


class Priority(ShareBased):
    """Strict priority by ``shares``: every tenant keeps its floor; what is left of the
    budget goes to the most shares first, up to its cap, then the next (ties split it
    fairly by shares among themselves). For "production before batch": a batch tenant
    (few shares) gives everything above its ``min`` to a busy production one."""

    name = "priority"

    def fair_shares(self, budget: int, claims: list[Claim], unit: int) -> dict[str, int]:
        out = {c.name: round_down(c.floor, unit) for c in claims}
        left = budget - sum(out.values())
        for shares in sorted({c.shares for c in claims}, reverse=True):
            tier = [c for c in claims if c.shares == shares]
            want = sum(c.cap - out[c.name] for c in tier)
            if left <= 0 or want <= 0:
                continue
            if want <= left:  # the whole tier fits: each gets its cap
                for c in tier:
                    out[c.name] = round_down(c.cap, unit)
                left -= want
                continue
            # the tier splits what is left fairly (floors kept) and lower tiers get none
            split = fair_shares(left + sum(out[c.name] for c in tier), tier, unit)
            out.update(split)
            left = 0
        return out


class FirstCome(ShareBased):
    """No arbitration between tenants: each one's share is what it holds (within its
    floor and cap), so nobody is asked to shrink for another and a tenant grows from
    free memory only; a grant that free memory does not cover is refused at once (unless
    putting an idle sleepable tenant to sleep covers it). What a peer without an
    arbiter does (kvcached's elastic KV, first come first served from the device's free
    memory): the fleet's baseline policies ``idle-sleep`` and ``reconcile`` run their
    daemon with it (docs/ARCHITECTURE.md, "Fleet policies"). A ``max`` lowered by an
    admin is still enforced (the reclaimer's hard-limit ask, not a share)."""

    name = "first_come"

    def fair_shares(self, budget: int, claims: list[Claim], unit: int) -> dict[str, int]:
        out = {c.name: round_down(c.floor, unit) for c in claims}
        left = budget - sum(out.values())
        for c in claims:  # (in the claims' order: the tenants' own)
            keep = round_down(min(c.held, c.cap), unit) - out[c.name]
            if keep > 0 and left > 0:
                take = min(keep, round_down(left, unit))
                out[c.name] += take
                left -= take
        return out


#: every reclaim policy by its configuration name
POLICIES: Registry[ReclaimPolicy] = Registry("reclaim policy")
for _policy in (FairShare(), Priority(), FirstCome()):
    POLICIES.register(_policy.name, _policy)
