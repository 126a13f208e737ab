"""Groups, grants, releases and leases: the memory-moving requests of a tenant.

A grant backs ``units`` of one of the tenant's groups with pages from the pool (the
descriptors precede the reply: :attr:`Outcome.pfns_to_send`); a release gives units
back; a lease counts bytes the tenant uses through its own allocator. Nothing is ever
granted past the budget or a tenant's cap (``OVER_LIMIT``), nor during recovery
(``BUSY``). What does not fit now either waits for reclaim (a *deferred* outcome, served
by :meth:`Grants.serve` from ``Arbiter.tick``) or is refused ``NO_MEMORY`` (speculative
grants, tenants being asked to give back, tenants at their fair share).
"""

from __future__ import annotations

import time

from kvpool import protocol as p
from kvpool.daemon.counters import Counters
from kvpool.daemon.ledger import Ledger
from kvpool.daemon.outcome import Fail, Outcome, Sender
from kvpool.daemon.pool import Pool, PoolExhausted
from kvpool.daemon.reclaim import Reclaimer, Waiter
from kvpool.daemon.regions import GroupIndex, GroupRecord
from kvpool.daemon.restart import Recovery
from kvpool.daemon.tenants import NO_MEMORY_KINDS, TenantRecord

def require_holder(t: TenantRecord, op: str) -> None:
    """Only memory-holding kinds hold memory: a monitor or admin session never does
    (so nothing it could hold escapes ``ps``, reclaim or the budget's accounting)."""
    if t.kind in NO_MEMORY_KINDS:
        raise Fail(p.UNAUTHORIZED, f"a {t.kind} session holds no memory ({op} refused)")


def group_of(t: TenantRecord, gid: int, groups: GroupIndex) -> GroupRecord:
    """``t``'s group ``gid`` (``UNAUTHORIZED`` when another tenant's, else ``NOT_FOUND``)."""
    g = t.groups.get(gid)
    if g is None:
        if gid in groups:
            raise Fail(p.UNAUTHORIZED, f"group {gid} belongs to another tenant")
        raise Fail(p.NOT_FOUND, f"no group {gid} in this session")
    return g


def being_granted(reclaimer: Reclaimer, t: TenantRecord, g: GroupRecord,
                  units: list[int]) -> bool:
    """Whether a waiting grant of ``t`` names one of ``units`` of ``g``."""
    return any(set(w.req.units) & set(units) for w in reclaimer.waiters
               if w.tenant is t and isinstance(w.req, p.Grant) and w.req.group == g.id)


class Grants:
    """The memory-moving requests over ``pool``, every page moved through ``ledger``:
    groups (indexed in ``groups``, at most ``max_groups`` per tenant spanning
    ``max_virtual_pages``), grants and leases that wait in ``reclaimer`` when they do
    not fit, refused while ``recovery`` is active; error answers made here are counted
    in ``counters``."""

    def __init__(self, pool: Pool, ledger: Ledger, groups: GroupIndex, reclaimer: Reclaimer,
                 recovery: Recovery, counters: Counters, max_groups: int,
                 max_virtual_pages: int):
        self.pool = pool
        self.ledger = ledger
        self.page_size = pool.page_size
        self.groups = groups
        self.reclaimer = reclaimer
        self.recovery = recovery
        self.counters = counters
        self.max_groups = max_groups
        self.max_virtual_pages = max_virtual_pages

    # ---- groups -------------------------------------------------------------------
    def group_of(self, t: TenantRecord, gid: int) -> GroupRecord:
        return group_of(t, gid, self.groups)

    def create_group(self, t: TenantRecord, sender: Sender, r: p.CreateGroup) -> p.Reply:
        require_holder(t, "create_group")
        ps = self.page_size
        if r.capacity % ps:
            raise Fail(p.BAD_REQUEST, f"capacity {r.capacity} is not a multiple of the page "
                                      f"size {ps}")
        npages = r.capacity // ps
        if npages > p.MAX_PAGES_PER_REGION:
            raise Fail(p.BAD_REQUEST, f"capacity of {npages} pages exceeds {p.MAX_PAGES_PER_REGION}")
        if r.bases and len(r.bases) != r.n_regions:
            raise Fail(p.BAD_REQUEST, f"{len(r.bases)} bases for {r.n_regions} regions")
        if r.chunk_units > npages:
            raise Fail(p.BAD_REQUEST, f"chunks of {r.chunk_units} units do not fit "
                                      f"{npages} pages per region")
        most = min(p.MAX_GROUPS, self.max_groups)
        if len(t.groups) >= most:
            raise Fail(p.OVER_LIMIT, f"a tenant may hold at most {most} groups "
                                     f"(max_groups_per_tenant)")
        virtual = sum(g.virtual_pages for g in t.groups.values())
        cap = self.max_virtual_pages
        if virtual + npages * r.n_regions > cap:
            raise Fail(p.OVER_LIMIT, f"{r.n_regions} x {npages} virtual pages on top of the "
                                     f"{virtual} this tenant's groups span exceed "
                                     f"{cap} (max_virtual_pages_per_tenant)")
        g = GroupRecord(id=self.groups.new_id(), tenant=t.id, n_regions=r.n_regions,
                        npages=npages, bases=list(r.bases), label=r.label,
                        chunk_units=r.chunk_units)
        t.groups[g.id] = g
        self.groups[g.id] = g
        return p.GroupCreated(id=r.id, group=g.id, npages=npages)

    def destroy_group(self, t: TenantRecord, sender: Sender, r: p.DestroyGroup) -> p.Reply:
        g = self.group_of(t, r.group)
        self.ledger.empty(t, g)
        del t.groups[g.id]
        self.groups.pop(g.id, None)
        return p.Done(id=r.id)

    # ---- grants -------------------------------------------------------------------
    def grant(self, t: TenantRecord, sender: Sender, r: p.Grant) -> Outcome:
        require_holder(t, "grant")
        g = self.group_of(t, r.group)
        n = self.ledger.grantable(g, r.units)
        if being_granted(self.reclaimer, t, g, r.units):
            raise Fail(p.BAD_REQUEST, f"a unit of group {g.id} is already being granted")
        self.admit(t, n)
        if not r.speculative:  # cached weight sets nobody holds go first
            self.reclaimer.make_room(n)
        if not self.fits(t, n, r.speculative):
            return self._defer(t, sender, r, n)
        return self._grant_now(t, g, r)

    def admit(self, t: TenantRecord, n: int) -> None:
        """Refuse what can never be granted now: past the limit, or during recovery."""
        if self.recovery.active:
            raise Fail(p.BUSY, "the daemon is rebuilding its accounting after a restart")
        kept = self.pool.charged(t.id, t.payer)  # released pages still referenced
        used = t.held + t.weight_pages + t.waiting_pages + n
        if used + kept > t.cap_pages \
                and self.pool.settle_ended(t.payer):  # unprobed pages may not be retained
            kept = self.pool.charged(t.id, t.payer)
        if used + kept > t.cap_pages:
            why = " (capped at its min: it ignored a reclaim)" if t.unresponsive else ""
            why += f" ({t.weight_pages} pages of weight sets count)" if t.weight_pages else ""
            why += (f" ({kept} released pages it still references, or ended sessions of "
                    f"uid {t.uid} do, count)") if kept else ""
            raise Fail(p.OVER_LIMIT, f"{t.name}: {t.held} + {n} pages would exceed its limit "
                                     f"of {t.cap_pages} pages{why}")

    def fits(self, t: TenantRecord, n: int, speculative: bool) -> bool:
        """Whether ``n`` pages for ``t`` are served now rather than queued. They are when
        free memory covers them beyond what waiters are owed; and also when free memory
        covers them and ``t`` stays within its fair share: a request that fits is never
        queued behind one that does not (the waiter's pages then come from reclaim,
        which asks for what is missing at the next step). Speculative grants never take
        pages a waiter could use."""
        reclaimer = self.reclaimer
        avail = self.pool.available
        if n <= avail - reclaimer.waiting_pages:
            return True
        if speculative or n > avail or not reclaimer.waiters or t.ask is not None:
            return False
        return reclaimer.may_grow(t, n)  # its fair share (for a lease too)

    def _defer(self, t: TenantRecord, sender: Sender, r: p.Grant | p.Lease,
               n: int) -> Outcome:
        """Not enough free memory: wait for reclaim, when ``t`` is entitled to it (the
        answer goes to ``sender``'s envelope later)."""
        speculative = isinstance(r, p.Grant) and r.speculative
        now = time.monotonic()
        if speculative or t.ask is not None or \
                not (self.reclaimer.may_grow(t, n, lease=isinstance(r, p.Lease))
                     or self.reclaimer.sleep_would_cover(t, n, now)):
            why = ("speculative grants use free memory only" if speculative else
                   f"{t.name} is being asked to give memory back" if t.ask is not None else
                   self.reclaimer.lease_room(t) if isinstance(r, p.Lease) else
                   f"{t.name} is at its fair share")
            raise Fail(p.NO_MEMORY, f"{n} pages asked, {self.pool.available} available; {why}")
        self.reclaimer.wait(t, sender.envelope, r, n, now)
        return Outcome(None, tenant=t, deferred=True)

    def _grant_now(self, t: TenantRecord, g: GroupRecord, r: p.Grant) -> Outcome:
        n = len(r.units) * g.n_regions
        try:
            pfns = self.ledger.take(t, n)
        except PoolExhausted as e:
            self.counters.errors += 1
            return Outcome(p.error(r.id, p.NO_MEMORY, str(e)), tenant=t)
        return Outcome(self.ledger.commit(t, g, r, pfns), pfns_to_send=pfns, tenant=t)

    def serve(self, w: Waiter) -> Outcome:
        """A waiter whose pages are free now (``Arbiter.tick``)."""
        t, r = w.tenant, w.req
        if isinstance(r, p.Lease):
            return Outcome(self._lease_now(t, r, w.pages), tenant=t)
        assert isinstance(r, p.Grant)
        return self._grant_now(t, t.groups[r.group], r)

    # ---- releases and reports ---------------------------------------------------------
    def release(self, t: TenantRecord, sender: Sender, r: p.Release) -> p.Reply:
        g = self.group_of(t, r.group)
        self.ledger.releasable(g, r.units)
        self.ledger.release(t, g, r.units, r.in_use, r.reserve)
        return p.Done(id=r.id)

    def report(self, t: TenantRecord, sender: Sender, r: p.Report) -> p.Reply:
        self.group_of(t, r.group).record_usage(r.in_use, r.reserve)
        return p.Done(id=r.id)

    def reclaimed(self, t: TenantRecord, sender: Sender, r: p.Reclaimed) -> p.Reply:
        self.reclaimer.answered(t, r.seq, time.monotonic())
        return p.Done(id=r.id)

    # ---- room -------------------------------------------------------------------------
    def headroom(self, t: TenantRecord) -> int:
        """Pages a grant of ``t`` would get at once (:meth:`fits`'s first case, with
        :meth:`admit`'s cap): none during recovery, for a memory-less session, or past
        either bound. Read-only (unlike ``admit``, settles nothing)."""
        if self.recovery.active or t.kind in NO_MEMORY_KINDS:
            return 0
        kept = self.pool.charged(t.id, t.payer)
        under_cap = t.cap_pages - (t.held + t.weight_pages + t.waiting_pages + kept)
        free = self.pool.available - self.reclaimer.waiting_pages
        return max(0, min(under_cap, free))

    def room(self, t: TenantRecord, state: p.ShownState, r: p.Room) -> p.RoomReply:
        """``Room``: :meth:`headroom` and what a server's metrics show beside it, in
        bytes (clamped to the wire's bounds: never negative)."""
        ps, pool = self.page_size, self.pool

        def b(pages: int) -> int:
            return min(max(0, pages) * ps, p.MAX_BYTES)

        return p.RoomReply(id=r.id, headroom=b(self.headroom(t)), granted=b(t.held),
                           weights=b(t.weight_pages), min=b(t.min_pages),
                           max=b(t.max_pages), pool_free=b(pool.available),
                           pool_budget=b(pool.budget_pages), state=state)

    # ---- leases ---------------------------------------------------------------------
    def lease(self, t: TenantRecord, sender: Sender, r: p.Lease) -> p.Reply | Outcome:
        require_holder(t, "lease")
        ps = self.page_size
        pages = -(-r.bytes // ps)
        if pages <= t.lease_pages:
            self.ledger.unlease(t, t.lease_pages - pages)
            return p.Leased(id=r.id, bytes=pages * ps)
        n = pages - t.lease_pages
        if any(w.tenant is t for w in self.reclaimer.waiters):
            raise Fail(p.BUSY, "a request of this tenant is already waiting")
        self.admit(t, n)
        self.reclaimer.make_room(n)
        if not self.fits(t, n, False):
            return self._defer(t, sender, r, n)
        return self._lease_now(t, r, n)

    def _lease_now(self, t: TenantRecord, r: p.Lease, n: int) -> p.Reply:
        pool, ps = self.pool, self.page_size
        try:
            self.ledger.lease(t, n)
        except PoolExhausted as e:
            self.counters.errors += 1
            return p.error(r.id, p.NO_MEMORY, str(e))
        if pool.backend.caps.device_memory_bounded:  # its real free memory decides too
            free, _ = pool.backend.mem_info()
            if free < n * ps:
                self.ledger.unlease(t, n)
                self.counters.errors += 1
                return p.error(r.id, p.NO_MEMORY, f"the device has {free} bytes free, "
                                                  f"{n * ps} leased")
        return p.Leased(id=r.id, bytes=t.lease_pages * ps)
