"""The ledger: the one owner of page moves on one device.

Every handler that moves pages between the pool, the tenants' page tables, leases and
weight sets does it through one :class:`Ledger` verb, so the steps of a move (the
pool's ownership, the tenant's counts, the reclaimer told of what came back, the
client's usage report stored, the move recorded) are written once:

* :meth:`Ledger.grantable` / :meth:`Ledger.releasable`: the unit checks of a grant or
  release (a single tenant's and a gang rank's part alike), before anything moves;
* :meth:`Ledger.take` (reserve pages, owned by the tenant, in no table yet),
  :meth:`Ledger.untake` (a reservation given back unsent) and :meth:`Ledger.commit`
  (the reserved pages enter the table): a grant;
* :meth:`Ledger.release` (units back to the pool), :meth:`Ledger.empty` (every unit of
  a group) and :meth:`Ledger.end` (everything a session held: its session ended);
* :meth:`Ledger.move` (units from one tenant's table to another's: a handoff) and
  :meth:`Ledger.unhand` (a handed-over page its giver kept: out of the receiver's
  table, retired and charged to the giver);
* :meth:`Ledger.adopt` (pages a returning tenant maps after a restart);
* :meth:`Ledger.lease` / :meth:`Ledger.unlease`: the tenant's lease and the pool's;
* :meth:`Ledger.take_set`, :meth:`Ledger.hold_set`, :meth:`Ledger.let_go_set`,
  :meth:`Ledger.drop_set`: weight sets' pages and their holders' counts (recorded
  as ``weights`` events through :class:`~kvpool.daemon.events.Moves`).

Invariant (:meth:`Ledger.check`, part of ``kvpool check``): every tenant's ``granted``
is the pages of its tables, each of them owned by it in the pool and in one slot only;
its ``lease_pages`` add up to the pool's ``leased``; tables and weight sets together
hold exactly the pool's granted pages; a monitor or admin session holds nothing.

Obligations of a caller: every check first (a verb moves and does not refuse, except
:meth:`take`/:meth:`take_set`/:meth:`lease`, which raise ``PoolExhausted`` having moved
nothing); only from the loop's thread. Grant, release, lease and handoff events are
recorded by the observer from the replies (with their timings,
:mod:`kvpool.daemon.observe`); weight-set events here.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from kvpool import protocol as p
from kvpool.daemon.events import Moves
from kvpool.daemon.outcome import Fail
from kvpool.daemon.pool import Payer, Pool
from kvpool.daemon.regions import GroupRecord
from kvpool.daemon.tenants import NO_MEMORY_KINDS, TenantRecord
from kvpool.vmm import Page

MAX_PAGES_PER_GRANT = 1 << 16

#: ``released(t, pages)``: ``t`` gave ``pages`` back (the reclaimer counts them against
#: its outstanding ask: ``Reclaimer.released``).
Released = Callable[[TenantRecord, int], None]


class SetPages(Protocol):
    """What the ledger's check needs of the weight sets (``WeightSets``)."""

    @property
    def pages(self) -> int: ...

    def check(self, seen: set[int]) -> list[str]: ...


def _nobody(t: TenantRecord, pages: int) -> None:
    """No reclaimer to tell (a ledger of weight sets alone, in tests)."""


def check_units(g: GroupRecord, units: list[int]) -> None:
    """``units`` name distinct units inside ``g``."""
    if len(set(units)) != len(units):
        raise Fail(p.BAD_REQUEST, "a unit is named twice")
    for u in units:
        if u >= g.npages:
            raise Fail(p.BAD_REQUEST, f"unit {u} is outside the group ({g.npages} pages)")


class Ledger:
    """The page moves over ``pool``; ``released`` hears of pages a tenant gives back
    (its reclaimer: :data:`Released`); weight sets' moves are recorded in ``moves``."""

    def __init__(self, pool: Pool, moves: Moves | None = None,
                 released: Released = _nobody):
        self.pool = pool
        self.moves = moves if moves is not None else Moves()
        self.released = released

    # ---- checks before a move --------------------------------------------------------
    @staticmethod
    def grantable(g: GroupRecord, units: list[int], verb: str = "granted") -> int:
        """The pages a grant of ``units`` of ``g`` takes; refused (``BAD_REQUEST``) when
        a unit is outside, named twice or already ``verb`` (in the table), or the grant
        is larger than :data:`MAX_PAGES_PER_GRANT`."""
        check_units(g, units)
        held = [u for u in units if u in g.units]
        if held:
            raise Fail(p.BAD_REQUEST, f"unit {held[0]} of group {g.id} is already {verb}")
        n = len(units) * g.n_regions
        if n > MAX_PAGES_PER_GRANT:
            raise Fail(p.BAD_REQUEST, f"{n} pages in one grant exceed {MAX_PAGES_PER_GRANT}")
        return n

    @staticmethod
    def releasable(g: GroupRecord, units: list[int]) -> None:
        """Refused (``BAD_REQUEST``) unless ``units`` are distinct units ``g`` holds."""
        check_units(g, units)
        missing = [u for u in units if u not in g.units]
        if missing:
            raise Fail(p.BAD_REQUEST, f"unit {missing[0]} of group {g.id} is not granted")

    # ---- grants ---------------------------------------------------------------------
    def take(self, t: TenantRecord, n: int) -> list[int]:
        """Reserve ``n`` pages for ``t`` (owned by it, in no table yet: :meth:`commit`
        or :meth:`untake` them). Raises ``PoolExhausted``, having taken nothing."""
        return self.pool.take(n, t.id)

    def untake(self, t: TenantRecord, pfns: list[int]) -> None:
        """Pages :meth:`take` reserved for ``t`` go back unsent (nothing was exported)."""
        self.pool.give_back(pfns, t.id)

    def commit(self, t: TenantRecord, g: GroupRecord, r: p.Grant,
               pfns: list[int]) -> p.Granted:
        """The pages :meth:`take` reserved enter ``t``'s table at ``r.units`` of ``g``;
        the reply whose descriptors (``pfns``) the caller sends."""
        g.grant(r.units, pfns)
        t.granted += len(pfns)
        g.record_usage(r.in_use, r.reserve)
        return p.Granted(id=r.id, group=g.id, units=r.units, nfds=len(pfns))

    # ---- releases -------------------------------------------------------------------
    def release(self, t: TenantRecord, g: GroupRecord, units: list[int],
                in_use: int | None = None, reserve: list[int] | None = None) -> int:
        """``units`` of ``t``'s group ``g`` go back to the pool (to be zeroed), with the
        usage the client reports; the pages released."""
        pfns = g.release(units)
        self._back(t, pfns)
        g.record_usage(in_use, reserve)
        return len(pfns)

    def empty(self, t: TenantRecord, g: GroupRecord) -> int:
        """Every unit of ``t``'s group ``g`` goes back (the group stays); the pages."""
        pfns = g.release_all()
        self._back(t, pfns)
        return len(pfns)

    def _back(self, t: TenantRecord, pfns: list[int]) -> None:
        self.pool.give_back(pfns, t.id)
        t.granted -= len(pfns)
        self.released(t, len(pfns))

    def end(self, t: TenantRecord) -> int:
        """``t``'s session ended: every page of its tables and its lease go back; what
        it still references stays charged to its uid (and configured name). Its
        groups stay in ``t.groups`` (the caller unindexes them). The reclaimer is not
        told (the caller forgets ``t`` there). The table pages returned."""
        pages = 0
        for g in t.groups.values():
            pfns = g.release_all()
            self.pool.give_back(pfns, t.id)
            pages += len(pfns)
        t.granted = 0
        self.pool.ended(t.id, t.payer)
        self.unlease(t, t.lease_pages)
        return pages

    # ---- handoff --------------------------------------------------------------------
    def move(self, giver: TenantRecord, gg: GroupRecord, units: list[int],
             t: TenantRecord, g: GroupRecord, at: list[int]) -> list[int]:
        """``units`` of ``giver``'s group ``gg`` leave it and land at ``at`` in ``t``'s
        group ``g``: ownership and both tenants' counts move with them (the pool's total
        unchanged); the pfns, unit-major in ``units``' order."""
        pfns = gg.release(units)
        giver.granted -= len(pfns)
        self.released(giver, len(pfns))
        gg.record_usage(None, None)
        for pfn in pfns:
            self.pool.owner[pfn] = t.id
        g.grant(at, pfns)
        t.granted += len(pfns)
        return pfns

    def unhand(self, t: TenantRecord, g: GroupRecord, units: list[int], pfns: list[int],
               giver: int, payer: Payer) -> int:
        """Pages moved to ``t`` at ``units`` of ``g`` that their giver (tenant id
        ``giver``, 0 when gone; ``payer``) still references: they leave ``t``'s table
        unsent and are retired, charged to the giver. The pages it kept."""
        g.release(units)
        t.granted -= len(pfns)
        self.released(t, len(pfns))
        g.record_usage(None, None)
        return self.pool.retire_kept(pfns, giver, payer)

    # ---- adoption after a restart -----------------------------------------------------
    def adopt(self, t: TenantRecord, g: GroupRecord, unit: int, pages: list[Page]) -> None:
        """``pages`` (``g.n_regions`` of them, imported) back ``unit`` of ``t``'s group
        ``g``, owned by ``t`` in the pool."""
        g.units[unit] = [self.pool.adopt(page, t.id) for page in pages]
        t.granted += len(pages)

    # ---- leases ---------------------------------------------------------------------
    def lease(self, t: TenantRecord, n: int, adopted: bool = False) -> None:
        """``t`` leases ``n`` more pages (raises ``PoolExhausted``, having leased
        nothing); ``adopted``: a lease a returning tenant reports, counted as is."""
        if adopted:
            self.pool.leased += n
        else:
            self.pool.lease(n)
        t.lease_pages += n

    def unlease(self, t: TenantRecord, n: int) -> None:
        """``t`` leases ``n`` pages fewer."""
        self.pool.unlease(n)
        t.lease_pages -= n

    # ---- weight sets ----------------------------------------------------------------
    def take_set(self, t: TenantRecord, n: int, owner: int, key: str) -> list[int]:
        """``n`` sealable pages for a new weight set (pool owner ``owner``, negative),
        held by its creator ``t``. Raises ``PoolExhausted``, having taken nothing."""
        pfns = self.pool.take_sealable(n, owner)
        t.weight_pages += n
        self.moves.pages("weights", t, n, op="create", key=key)
        return pfns

    def hold_set(self, t: TenantRecord, pages: int, key: str) -> None:
        """``t`` attaches a set of ``pages`` (counted against its max)."""
        t.weight_pages += pages
        self.moves.pages("weights", t, pages, op="attach", key=key)

    def let_go_set(self, t: TenantRecord, pages: int, key: str) -> None:
        """``t`` lets go of a set of ``pages``."""
        t.weight_pages -= pages
        self.moves.pages("weights", t, pages, op="detach", key=key)

    def drop_set(self, pfns: list[int], owner: int, payer: Payer,
                 holders: Iterable[TenantRecord], op: str, key: str) -> None:
        """A set's pages (pool owner ``owner``) go back (dirty: retired, never handed
        on as is); what anyone kept of them is ``payer``'s; ``holders`` (a loading
        set's creator) hold it no more. Recorded as ``op`` (evict, discard)."""
        for h in holders:
            h.weight_pages -= len(pfns)
        self.pool.give_back(pfns, owner)
        self.pool.ended(owner, payer)
        self.moves.pages("weights", None, len(pfns), op=op, key=key)

    def record_set(self, t: TenantRecord | None, pages: int, op: str, key: str) -> None:
        """A weight set's change that moves no page (seal): recorded with the rest."""
        self.moves.pages("weights", t, pages, op=op, key=key)

    # ---- integrity -----------------------------------------------------------------
    def check(self, tenants: Iterable[TenantRecord], sets: SetPages) -> list[str]:
        """The invariant above over ``tenants`` (all of this device's) and the weight
        ``sets``; the problems found (empty: it holds)."""
        pool = self.pool
        problems: list[str] = []
        seen: dict[int, tuple[int, int, int]] = {}
        tenants = list(tenants)
        total = sum(self._check_tables(t, seen, problems) for t in tenants)
        leased = sum(t.lease_pages for t in tenants)
        if leased != pool.leased:
            problems.append(f"tenants lease {leased} pages, the pool counts {pool.leased}")
        in_sets: set[int] = set(seen)
        problems += sets.check(in_sets)
        if in_sets != set(pool.owner):
            orphans = set(pool.owner) - in_sets
            problems.append(f"pfns {sorted(orphans)[:8]} are granted but in no table")
        total += sets.pages
        if total != pool.granted:
            problems.append(f"tables and weight sets hold {total} pages, the pool counts "
                            f"{pool.granted}")
        return problems

    def _check_tables(self, t: TenantRecord, seen: dict[int, tuple[int, int, int]],
                      problems: list[str]) -> int:
        """Check ``t``'s page tables (recording each pfn's slot in ``seen``); its pages."""
        pool = self.pool
        pages = 0
        if t.kind in NO_MEMORY_KINDS and (t.groups or t.held):
            problems.append(f"{t.kind} session {t.id} holds memory ({t.held} pages, "
                            f"{len(t.groups)} groups)")
        for g in t.groups.values():
            if g.tenant != t.id:
                problems.append(f"group {g.id} in tenant {t.id} names tenant {g.tenant}")
            for u, pfns in g.units.items():
                if not 0 <= u < g.npages:
                    problems.append(f"group {g.id} maps unit {u} outside its {g.npages} pages")
                if len(pfns) != g.n_regions:
                    problems.append(f"group {g.id} unit {u} has {len(pfns)} pages, "
                                    f"expected {g.n_regions}")
                for pfn in pfns:
                    if pfn in seen:
                        problems.append(f"pfn {pfn} is in two slots: {seen[pfn]} and "
                                        f"{(t.id, g.id, u)}")
                    seen[pfn] = (t.id, g.id, u)
                    if pool.owner.get(pfn) != t.id:
                        problems.append(f"pfn {pfn} in tenant {t.id}'s table is owned by "
                                        f"{pool.owner.get(pfn)} in the pool")
                pages += len(pfns)
            if not g.reserve <= g.units.keys():
                problems.append(f"group {g.id} reports reserve units it does not hold")
        if pages != t.granted:
            problems.append(f"tenant {t.id} counts {t.granted} pages, its tables hold {pages}")
        return pages
