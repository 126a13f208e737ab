"""The arbiter's self-check (``kvpool check``): every invariant the daemon keeps, as a
list of problems (empty when all hold). Read-only; O(pages).

* every page is owned exactly once: in the warm pool, the dirty list, or one region
  slot of its owner (the pool's own check covers warm/dirty/owned and the budget);
* every retained or released page is charged to a live tenant or to a payer (an ended
  session's uid, a dropped weight set's creator's uid): none is charged to no one;
* the ledger's accounting (:meth:`kvpool.daemon.ledger.Ledger.check`, the one owner of
  page moves): per-tenant counts equal their tables, and their sum with the weight
  sets' the pool's ``granted``; tenants' leases add up to the pool's ``leased``;
  monitor and admin sessions hold nothing;
* every weight set's pages are owned by it in the pool, its holders are live tenants,
  and each tenant's weight pages are those of the sets it holds;
* the group index is exactly the tenants' groups, ids in ``1..MAX_GROUP_ID``, and no
  tenant is past its caps on groups and virtual pages.
"""

from __future__ import annotations

from kvpool import protocol as p
from kvpool.daemon.handoff import Handoff
from kvpool.daemon.ledger import Ledger
from kvpool.daemon.pool import Pool
from kvpool.daemon.regions import GroupIndex
from kvpool.daemon.gangs import Gangs
from kvpool.daemon.tenants import Tenants
from kvpool.daemon.weights import WeightSets


def check_groups(tenants: Tenants, groups: GroupIndex, most: int, vmost: int) -> list[str]:
    """The group index is exactly the tenants' groups; ids stay in range; no tenant
    is past its caps on groups (``most``) and virtual pages (``vmost``)."""
    problems = []
    owned = {g.id: g for t in tenants for g in t.groups.values()}
    if set(owned) != set(groups) or any(groups.get(i) is not g for i, g in owned.items()):
        extra = sorted(set(groups) ^ set(owned))[:8]
        problems.append(f"the group index and the tenants' groups differ (ids {extra})")
    bad = sorted(i for i in groups if not 1 <= i <= p.MAX_GROUP_ID)[:8]
    if bad:
        problems.append(f"group ids {bad} are outside 1..{p.MAX_GROUP_ID}")
    for t in tenants:
        virtual = sum(g.virtual_pages for g in t.groups.values())
        if len(t.groups) > most or virtual > vmost:
            problems.append(f"tenant {t.id} holds {len(t.groups)} groups spanning "
                            f"{virtual} virtual pages, past its caps ({most}, {vmost})")
    return problems


class Integrity:
    """The self-check over ``pool``, its ``ledger``, ``tenants``, the group index
    ``groups`` (with the per-tenant caps ``max_groups`` and ``max_virtual_pages``),
    ``handoff``'s book and the ``weights`` sets."""

    def __init__(self, pool: Pool, ledger: Ledger, tenants: Tenants, groups: GroupIndex,
                 handoff: Handoff, max_groups: int, max_virtual_pages: int,
                 weights: WeightSets, gangs: Gangs | None = None):
        self.gangs = gangs  # (their tables span devices: checked from every device)
        self.pool = pool
        self.ledger = ledger
        self.tenants = tenants
        self.groups = groups
        self.handoff = handoff
        self.max_groups = max_groups
        self.max_virtual_pages = max_virtual_pages
        self.weights = weights

    def check(self) -> list[str]:
        """Every invariant above; the problems found (empty: all hold)."""
        pool, tenants = self.pool, self.tenants
        problems = pool.check() + pool.check_charges(tenants.by_id)
        problems += self.ledger.check(tenants, self.weights)
        problems += check_groups(tenants, self.groups, self.max_groups,
                                 self.max_virtual_pages)
        problems += self.handoff.check()  # tickets in escrow (kvpool.daemon.handoff)
        if self.gangs is not None:  # no gang half-granted (kvpool.daemon.gangs)
            problems += self.gangs.check()
        return problems
