"""Page handoff, the daemon's side: ``offer``, ``claim`` and ``cancel`` requests over the
escrow book (:mod:`kvpool.daemon.escrow`), applied to the tenants' page tables and the
pool's ownership.

* ``offer``: units of the giver's group go in escrow (the giver keeps them: they stay in
  its table, charged to it, until a claim succeeds).
* ``claim``: all checks first (the ticket, who may claim it, the giver the claimant
  expects if it names one (``Claim.giver``), the layout, the receiver's room under its
  cap, its fair share while others wait, its target units), then in one step the pages
  leave the giver's table and enter the receiver's, the pool's owner of each pfn
  changes and the giver is told (:class:`~kvpool.protocol.replies.Settled`,
  unsolicited) to drop its mappings. A refused claim changes nothing: the giver keeps
  the pages and the ticket stays claimable by its receiver.
* **letting go** (where the backend can tell, host): the pages get new handles that
  share nothing with the descriptors the giver was sent (:meth:`Pool.rehandle`), and
  the receiver's answer waits (a deferred outcome, :meth:`Handoff.let_go` on the
  arbiter's tick) until nothing but the daemon references them — the same exact probe
  that finds retained pages. Then the descriptors go to the receiver (before the
  reply, as for a grant). A giver that still references them after
  ``handoff_letgo_s`` (it kept a descriptor or a mapping) loses them anyway: they
  leave the receiver's table unsent, are retired and charged to the giver as retained,
  and the claim is answered ``NOT_FOUND``. So a giver never shares pages with their
  receiver, and the receiver is never charged for the giver's references. Where the
  backend cannot tell (CUDA), the descriptors go at once (docs/THREAT-MODEL.md).
* tickets expire on the arbiter's tick (:meth:`Handoff.tick`); a giver's session that
  ends cancels its tickets (its pages return to the pool with everything else it held,
  :meth:`Handoff.dropped`).

Transferred pages are not zeroed (their bytes are the point) and never reach anyone but
the receiver: the descriptors go only to the receiver's fd channel, and the pool's owner
check (the server sends only pages the tenant owns) holds for them as for grants.

Invariants (:meth:`Handoff.check`): the book is sound; every pending ticket's giver is a
live tenant; the pages moved are counted once (giver's ``granted`` down, receiver's up,
the pool's total unchanged).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable

from kvpool import protocol as p
from kvpool.daemon import escrow
from kvpool.daemon.escrow import Escrow, Layout, Party, Refused
from kvpool.daemon.grants import being_granted, group_of, require_holder
from kvpool.daemon.ledger import Ledger, check_units
from kvpool.daemon.outcome import Fail, Outbox, Outcome, Sender
from kvpool.daemon.pool import Payer, Pool
from kvpool.daemon.reclaim import Reclaimer
from kvpool.daemon.regions import GroupIndex, GroupRecord
from kvpool.daemon.restart import Recovery
from kvpool.daemon.tenants import TenantRecord, Tenants

log = logging.getLogger("kvpool.daemon.handoff")


def party(t: TenantRecord) -> Party:
    """What the book knows of a session: decided by the daemon (SO_PEERCRED, register)."""
    return Party(tenant=t.id, name=t.name, uid=t.uid)


FIRST_POLL_S = 0.001  # a claim's first look at whether its giver let go; doubling up to
LAST_POLL_S = 0.004


@dataclass(eq=False)
class LettingGo:
    """A claim waiting for its giver to let go of the pages (``pfns``, now at ``units``
    of the receiver's group ``group``); ``confirmed`` of them are free of it already."""

    receiver: TenantRecord
    group: GroupRecord
    units: list[int]
    pfns: list[int]
    giver: int
    payer: Payer
    envelope: list[bytes]
    reply: p.Claimed
    deadline: float
    next_poll: float
    wait: float = FIRST_POLL_S
    confirmed: int = 0


class Handoff:
    """Offers and claims between ``tenants``' groups (``groups``), moving pages of
    ``pool`` through ``ledger``; a receiver's room is judged against ``reclaimer``'s waiters, nothing moves
    while ``recovery`` is active, and givers hear how their tickets end through
    ``outbox``. ``pairs``: (giver name, receiver name) the config allows across uids."""

    def __init__(self, pool: Pool, ledger: Ledger, tenants: Tenants, groups: GroupIndex,
                 reclaimer: Reclaimer, recovery: Recovery, outbox: Outbox,
                 pairs: Iterable[tuple[str, str]] = (), letgo_s: float = 2.0):
        self.pool = pool
        self.ledger = ledger
        self.tenants = tenants
        self.groups = groups
        self.reclaimer = reclaimer
        self.recovery = recovery
        self.outbox = outbox
        self.book = Escrow()
        self.pairs = frozenset(pairs)  # (giver name, receiver name) across uids
        self.letgo_s = letgo_s  # how long a claim waits for its giver to let go
        self.letting_go: list[LettingGo] = []

    def _layout(self, g: GroupRecord) -> Layout:
        return Layout(n_regions=g.n_regions, unit_bytes=self.pool.page_size)

    # ---- requests -------------------------------------------------------------------
    def offer(self, t: TenantRecord, sender: Sender, r: p.Offer) -> p.Reply:
        require_holder(t, "offer")
        g = group_of(t, r.group, self.groups)
        self.ledger.releasable(g, r.units)
        for other in self.tenants.named(r.to):  # a receiver already connected: say it now
            why = escrow.may_pair(party(t), party(other), self.pairs)
            if why:
                raise Fail(p.UNAUTHORIZED, why)
        pfns = [pfn for u in r.units for pfn in g.units[u]]
        try:
            ticket = self.book.offer(party(t), g.id, list(r.units), pfns, self._layout(g),
                                     r.to, r.ttl_ms / 1000, time.monotonic())
        except Refused as e:
            raise Fail(e.code, str(e)) from None
        log.info("tenant %d (%s) offers %d units (%d pages) of group %d to %s, ticket %s",
                 t.id, t.name, len(r.units), ticket.pages, g.id, r.to, escrow.short(ticket.id))
        return p.Offered(id=r.id, ticket=ticket.id, pages=ticket.pages, ttl_ms=r.ttl_ms)

    def claim(self, t: TenantRecord, sender: Sender, r: p.Claim) -> Outcome:
        require_holder(t, "claim")
        if self.recovery.active:
            raise Fail(p.BUSY, "the daemon is rebuilding its accounting after a restart")
        g = group_of(t, r.group, self.groups)
        check_units(g, r.units)
        held = [u for u in r.units if u in g.units]
        if held:
            raise Fail(p.BAD_REQUEST, f"unit {held[0]} of group {g.id} is mapped already")
        if being_granted(self.reclaimer, t, g, r.units):
            raise Fail(p.BAD_REQUEST, f"a unit of group {g.id} is being granted")
        now = time.monotonic()
        self.tick(now)  # expire what is due first: its giver hears of it, never silently
        room = t.cap_pages - t.held - self.pool.charged(t.id, t.payer) - t.waiting_pages
        try:
            ticket = self.book.check_claim(r.ticket, party(t), self._layout(g), len(r.units),
                                           room, now, self.pairs)
        except Refused as e:
            raise Fail(e.code, str(e)) from None
        if r.giver and ticket.giver.tenant != r.giver:
            raise Fail(p.UNAUTHORIZED, f"ticket {escrow.short(ticket.id)} was offered by "
                                       f"tenant {ticket.giver.name!r} (id "
                                       f"{ticket.giver.tenant}), not by tenant id {r.giver} "
                                       f"the claimant expected; not claimed")
        n = ticket.pages
        if t.ask is not None:
            raise Fail(p.NO_MEMORY, f"{t.name} is being asked to give memory back; "
                                    f"the giver keeps the pages")
        if self.reclaimer.waiters and not self.reclaimer.may_grow(t, n):
            raise Fail(p.OVER_LIMIT, f"{t.name}: {n} more pages would take it past its fair "
                                     f"share while others wait; the giver keeps the pages")
        giver = self.tenants.by_id.get(ticket.giver.tenant)
        gg = giver.groups.get(ticket.group) if giver is not None else None
        if giver is None or gg is None or [pfn for u in ticket.units for pfn in gg.units.get(u, ())] \
                != list(ticket.pfns):
            self.book.cancel(ticket.id, ticket.giver.tenant, now)
            self._tell(ticket, "cancelled", "the giver no longer holds those units")
            raise Fail(p.NOT_FOUND, f"ticket {escrow.short(ticket.id)} is void: the giver no "
                                    f"longer holds those units (cancelled)")
        pfns = self.ledger.move(giver, gg, list(ticket.units), t, g, list(r.units))
        self.book.claimed_by_receiver(ticket, party(t), now)
        self._tell(ticket, "claimed", f"claimed by {t.name}", receiver=t.name)
        log.info("tenant %d (%s) claimed ticket %s: %d pages from %s", t.id, t.name,
                 escrow.short(ticket.id), n, ticket.giver.name)
        reply = p.Claimed(id=r.id, group=g.id, units=list(r.units), nfds=n,
                             ticket=ticket.id, giver=ticket.giver.name,
                             giver_tenant=ticket.giver.tenant)
        if self.pool.rehandle(pfns):  # sent once the giver has let go (let_go)
            w = LettingGo(t, g, list(r.units), pfns, giver.id, giver.payer, sender.envelope,
                          reply, now + self.letgo_s, now + FIRST_POLL_S)
            if not self._confirm(w):
                self.letting_go.append(w)
                return Outcome(None, tenant=t, deferred=True)
        return Outcome(reply, pfns_to_send=pfns, tenant=t)

    def _confirm(self, w: LettingGo) -> bool:
        """Whether nothing but the daemon references ``w``'s pages any more (probing
        from the first not confirmed yet; None, cannot tell: taken as let go)."""
        while w.confirmed < len(w.pfns) and \
                not self.pool.referenced_elsewhere(w.pfns[w.confirmed]):
            w.confirmed += 1
        return w.confirmed == len(w.pfns)

    def let_go(self, now: float) -> list[Outcome]:
        """Claims whose giver has let go of every page: their descriptors and replies
        (each with its envelope); and those past ``letgo_s`` with a page still
        referenced: refused, the pages retired and charged to the giver."""
        out: list[Outcome] = []
        for w in list(self.letting_go):
            if now < w.next_poll:
                continue
            t = w.receiver
            if [pfn for u in w.units for pfn in w.group.units.get(u, ())] != w.pfns:
                self.letting_go.remove(w)  # the receiver gave the units back meanwhile
                o = Outcome(p.error(w.reply.id, p.BAD_REQUEST, f"units of group {w.group.id} "
                                    f"changed while the claim waited; not handed over"),
                            tenant=t)
            elif self._confirm(w):
                self.letting_go.remove(w)
                o = Outcome(w.reply, pfns_to_send=w.pfns, tenant=t)
            elif now >= w.deadline:
                self.letting_go.remove(w)
                o = Outcome(self._kept(w), tenant=t)
            else:
                w.wait = min(2 * w.wait, LAST_POLL_S)
                w.next_poll = now + w.wait
                continue
            o.envelope = w.envelope
            out.append(o)
        return out

    def _kept(self, w: LettingGo) -> p.Reply:
        """``w``'s giver kept references past the deadline: the pages leave the
        receiver's table unsent and are retired, charged to the giver."""
        t, n = w.receiver, len(w.pfns)
        live = w.giver in self.tenants.by_id
        kept = self.ledger.unhand(t, w.group, w.units, w.pfns, w.giver if live else 0,
                                  w.payer)
        log.warning("tenant %d still references %d of the %d pages it handed to tenant %d "
                    "(%s): not handed over, charged to it as retained", w.giver, kept, n,
                    t.id, t.name)
        return p.error(w.reply.id, p.NOT_FOUND,
                       f"ticket {escrow.short(w.reply.ticket)} is void: its giver "
                       f"{w.reply.giver!r} still references the pages {self.letgo_s:g} s "
                       f"after being told to let go (not claimed; they stay charged "
                       f"to it)")

    def cancel(self, t: TenantRecord, sender: Sender, r: p.Cancel) -> p.Reply:
        now = time.monotonic()
        self.tick(now)  # (an expired ticket is told as such, then refused)
        try:
            self.book.cancel(r.ticket, t.id, now)
        except Refused as e:
            raise Fail(e.code, str(e)) from None
        return p.Done(id=r.id)

    # ---- time, death, integrity ---------------------------------------------------------
    def tick(self, now: float) -> None:
        """Expire late tickets; their givers learn they keep the pages."""
        for ticket in self.book.expire(now):
            self._tell(ticket, "expired", "nobody claimed it in time")

    def next_deadline(self) -> float | None:
        d = self.book.next_deadline()
        polls = [w.next_poll for w in self.letting_go]
        if polls:
            d = min(polls) if d is None else min(d, *polls)
        return d

    def dropped(self, t: TenantRecord) -> None:
        """``t``'s session ends: its pending offers are cancelled (their pages go back to
        the pool with the rest of what it holds); claims it waits on go as if their
        givers had kept the pages (what a giver still references is charged to it,
        never to ``t``)."""
        for w in [w for w in self.letting_go if w.receiver is t]:
            self.letting_go.remove(w)
            if [pfn for u in w.units for pfn in w.group.units.get(u, ())] == w.pfns:
                self._kept(w)
        gone = self.book.forget_giver(t.id, time.monotonic())
        if gone:
            log.info("tenant %d (%s) ended with %d tickets pending: cancelled", t.id,
                     t.name, len(gone))

    def _tell(self, ticket: escrow.Ticket, state: p.SettledState, reason: str,
              receiver: str = "") -> None:
        giver = self.tenants.by_id.get(ticket.giver.tenant)
        if giver is not None:
            self.outbox.send(giver, p.Settled(
                ticket=ticket.id, state=state, group=ticket.group, units=list(ticket.units),
                receiver=receiver, reason=reason))

    def check(self) -> list[str]:
        problems = self.book.check_integrity()
        for ticket in self.book.pending.values():
            if ticket.giver.tenant not in self.tenants.by_id:
                problems.append(f"ticket {escrow.short(ticket.id)} of tenant "
                                f"{ticket.giver.tenant} is pending but its giver is gone")
        return problems
