"""The escrow book: tickets for pages that change hands between tenants (pure: no I/O,
no sockets, no pool; the daemon's :mod:`kvpool.daemon.handoff` applies its decisions).

A giver puts units of one of its groups in escrow for a named receiver and gets a
:class:`Ticket` with an unguessable id (128 bits from :func:`secrets.token_bytes`). The
receiver claims the ticket into a group of the same layout; the daemon then moves the
pages' ownership (no byte is copied, the pages are not zeroed) and only afterwards tells
the giver to drop its mappings. Until a ticket is settled the giver keeps its pages.

States::

    pending --claim--> claimed          (the pages now belong to the receiver)
    pending --ttl----> expired          (the giver keeps its pages)
    pending --cancel-> cancelled        (the giver asked, or died, or lost the units)

Invariants (checked by :meth:`Escrow.check_integrity`):

* a ticket is settled at most once: a settled ticket never returns to ``pending``, and
  every later claim of it is refused with its state in the message (single use);
* a unit of a group is in at most one pending ticket, and a pending ticket names
  distinct units, at least one, at most :data:`MAX_TICKET_UNITS`;
* the pending index by giver is exactly the pending tickets; a giver has at most
  :data:`MAX_PENDING_PER_GIVER` pending tickets and the book at most
  :data:`MAX_PENDING`;
* settled tickets are remembered (for a clear "already claimed"/"expired" answer) up to
  :data:`MAX_SETTLED`, oldest forgotten first: an id the book forgot is "unknown", never
  claimable again (ids are never reissued: 2^128 space).

Who may send to whom is decided from what the daemon knows about both sessions (their
uids from ``SO_PEERCRED`` and the names they registered), never from the request: the
same uid, or a pairing the daemon's config lists (:func:`may_pair`). Accounting: the
receiver's room (its ``max`` less what it holds and is owed; the daemon computes it) must
cover the ticket's pages, else the claim is refused and nothing changes.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final, Iterable, Literal, get_args

# a ticket's state: pending, then how it ended (the last three: kvpool.protocol's
# SettledState, which the book does not import)
TicketState = Literal["pending", "claimed", "expired", "cancelled"]
PENDING: Final = "pending"
CLAIMED: Final = "claimed"
EXPIRED: Final = "expired"
CANCELLED: Final = "cancelled"
STATES: tuple[TicketState, ...] = get_args(TicketState)
TICKET_BYTES = 16  # 128 bits: an id nobody guesses
MAX_PENDING_PER_GIVER = 1024
MAX_PENDING = 1 << 16
MAX_SETTLED = 1 << 14
MAX_TICKET_UNITS = 1 << 16
MIN_TTL_S = 0.001
MAX_TTL_S = 3600.0


class Refused(Exception):
    """A book operation that changes nothing; ``code`` is a protocol error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# error codes (the same strings as kvpool.protocol's; the book imports nothing of the wire)
BAD_REQUEST, UNAUTHORIZED, NOT_FOUND, OVER_LIMIT = ("BAD_REQUEST", "UNAUTHORIZED",
                                                    "NOT_FOUND", "OVER_LIMIT")


@dataclass(frozen=True)
class Party:
    """What the daemon knows about a session: its tenant id, registered name and uid."""

    tenant: int
    name: str
    uid: int


@dataclass(frozen=True)
class Layout:
    """A group's shape as a handoff sees it: regions per unit and bytes per region page."""

    n_regions: int
    unit_bytes: int  # bytes of one unit in one region (the page size)


@dataclass(eq=False)
class Ticket:
    """Units ``units`` of group ``group`` of ``giver``, for ``receiver`` (a tenant name).
    ``pfns`` are the pages those units held at the offer (unit-major), so a claim can see
    whether the giver still holds exactly them."""

    id: str
    giver: Party
    group: int
    units: tuple[int, ...]
    pfns: tuple[int, ...]
    layout: Layout
    receiver: str
    expires: float  # monotonic seconds
    state: TicketState = PENDING
    claimed_by: int = 0  # the receiving tenant id, once claimed
    settled_at: float = 0.0

    @property
    def pages(self) -> int:
        return len(self.units) * self.layout.n_regions


def may_pair(giver: Party, receiver: Party, pairs: Iterable[tuple[str, str]] = ()) -> str | None:
    """Why ``giver`` may not hand pages to ``receiver``; None when it may: both run as the
    same uid, or the config pairs the giver's name with the receiver's."""
    if giver.uid == receiver.uid:
        return None
    if (giver.name, receiver.name) in set(pairs):
        return None
    return (f"tenant {giver.name!r} (uid {giver.uid}) may not hand pages to "
            f"{receiver.name!r} (uid {receiver.uid}): not the same uid and no "
            f"handoff pairing in the daemon's config")


@dataclass
class Escrow:
    """Every ticket the daemon knows: pending ones (claimable) and recently settled ones."""

    pending: dict[str, Ticket] = field(default_factory=dict)
    settled: "OrderedDict[str, Ticket]" = field(default_factory=OrderedDict)
    by_giver: dict[int, set[str]] = field(default_factory=dict)
    held: dict[tuple[int, int], str] = field(default_factory=dict)  # (group, unit) -> ticket
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATES[1:], 0))

    # ---- offer ------------------------------------------------------------------------
    def offer(self, giver: Party, group: int, units: list[int], pfns: list[int],
              layout: Layout, receiver: str, ttl_s: float, now: float) -> Ticket:
        """Put ``units`` (held by ``giver`` with pages ``pfns``) in escrow for the tenant
        called ``receiver`` until ``now + ttl_s``. Refuses (changing nothing) units named
        twice, units already in a pending ticket, a bad ttl, and too many tickets."""
        if not units or len(units) > MAX_TICKET_UNITS:
            raise Refused(BAD_REQUEST, f"a ticket holds 1..{MAX_TICKET_UNITS} units, "
                                       f"{len(units)} given")
        if len(set(units)) != len(units):
            raise Refused(BAD_REQUEST, "a unit is named twice")
        if len(pfns) != len(units) * layout.n_regions:
            raise Refused(BAD_REQUEST, f"{len(pfns)} pages for {len(units)} units of "
                                      f"{layout.n_regions} regions")
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise Refused(BAD_REQUEST, f"ttl {ttl_s:g} s is outside {MIN_TTL_S:g}.."
                                       f"{MAX_TTL_S:g} s")
        busy = [u for u in units if (group, u) in self.held]
        if busy:
            raise Refused(BAD_REQUEST, f"unit {busy[0]} of group {group} is in escrow "
                                       f"already (ticket pending)")
        mine = self.by_giver.get(giver.tenant, set())
        if len(mine) >= MAX_PENDING_PER_GIVER:
            raise Refused(OVER_LIMIT, f"{len(mine)} tickets of this tenant are pending "
                                      f"already (at most {MAX_PENDING_PER_GIVER})")
        if len(self.pending) >= MAX_PENDING:
            raise Refused(OVER_LIMIT, f"{len(self.pending)} tickets are pending already "
                                      f"(at most {MAX_PENDING})")
        tid = secrets.token_bytes(TICKET_BYTES).hex()
        t = Ticket(id=tid, giver=giver, group=group, units=tuple(units), pfns=tuple(pfns),
                   layout=layout, receiver=receiver, expires=now + ttl_s)
        self.pending[tid] = t
        self.by_giver.setdefault(giver.tenant, set()).add(tid)
        for u in units:
            self.held[(group, u)] = tid
        return t

    # ---- claim ------------------------------------------------------------------------
    def check_claim(self, tid: str, receiver: Party, layout: Layout, n_at: int, room: int,
                    now: float, pairs: Iterable[tuple[str, str]] = ()) -> Ticket:
        """The pending ticket ``tid`` if ``receiver`` may claim it now into a group of
        ``layout`` at ``n_at`` units with ``room`` pages of headroom; otherwise
        :class:`Refused` and nothing changes (a refused claim never consumes a ticket:
        a third tenant cannot spoil it for the real receiver)."""
        t = self.lookup(tid, now)
        if receiver.name != t.receiver:
            raise Refused(UNAUTHORIZED, f"ticket {short(tid)} is for tenant {t.receiver!r}, "
                                        f"not {receiver.name!r}")
        why = may_pair(t.giver, receiver, pairs)
        if why:
            raise Refused(UNAUTHORIZED, why)
        if layout != t.layout:
            raise Refused(BAD_REQUEST, f"ticket {short(tid)} holds units of {t.layout.n_regions} "
                                       f"regions x {t.layout.unit_bytes} bytes; the group has "
                                       f"{layout.n_regions} x {layout.unit_bytes}")
        if n_at != len(t.units):
            raise Refused(BAD_REQUEST, f"ticket {short(tid)} holds {len(t.units)} units, "
                                       f"{n_at} target units given")
        if t.pages > room:
            raise Refused(OVER_LIMIT, f"{receiver.name}: {t.pages} pages would exceed its "
                                      f"limit ({max(0, room)} pages of room); the giver keeps them")
        return t

    def lookup(self, tid: str, now: float) -> Ticket:
        """The pending ticket ``tid`` (expiring it first if its time is up)."""
        t = self.pending.get(tid)
        if t is not None and now >= t.expires:
            self._settle(t, EXPIRED, now)
            t = None
        if t is None:
            old = self.settled.get(tid)
            if old is not None:
                raise Refused(NOT_FOUND, f"ticket {short(tid)} was {old.state} already "
                                         f"(a ticket is single use)")
            raise Refused(NOT_FOUND, f"no ticket {short(tid)} (unknown or forgotten)")
        return t

    def claimed_by_receiver(self, t: Ticket, receiver: Party, now: float) -> None:
        """Record that the daemon moved ``t``'s pages to ``receiver``."""
        t.claimed_by = receiver.tenant
        self._settle(t, CLAIMED, now)

    # ---- cancel, expire, death ----------------------------------------------------------
    def cancel(self, tid: str, giver: int, now: float) -> Ticket:
        """The giver takes its offer back (only the giver may)."""
        t = self.lookup(tid, now)
        if t.giver.tenant != giver:
            raise Refused(UNAUTHORIZED, f"ticket {short(tid)} is not this tenant's offer")
        self._settle(t, CANCELLED, now)
        return t

    def expire(self, now: float) -> list[Ticket]:
        """Settle every pending ticket whose time is up; returns them."""
        late = [t for t in self.pending.values() if now >= t.expires]
        for t in late:
            self._settle(t, EXPIRED, now)
        return late

    def next_deadline(self) -> float | None:
        return min((t.expires for t in self.pending.values()), default=None)

    def forget_giver(self, giver: int, now: float) -> list[Ticket]:
        """The giver's session ended: its pending tickets are cancelled (its pages go back
        to the pool with the rest of what it held)."""
        out = [self.pending[tid] for tid in sorted(self.by_giver.get(giver, ()))]
        for t in out:
            self._settle(t, CANCELLED, now)
        return out

    def of_giver(self, giver: int) -> list[Ticket]:
        return [self.pending[tid] for tid in self.by_giver.get(giver, ())]

    def _settle(self, t: Ticket, state: TicketState, now: float) -> None:
        assert t.state == PENDING and state != PENDING, (t.state, state)
        del self.pending[t.id]
        mine = self.by_giver[t.giver.tenant]
        mine.discard(t.id)
        if not mine:
            del self.by_giver[t.giver.tenant]
        for u in t.units:
            del self.held[(t.group, u)]
        t.state, t.settled_at = state, now
        self.counts[state] += 1
        self.settled[t.id] = t
        while len(self.settled) > MAX_SETTLED:
            self.settled.popitem(last=False)

    # ---- integrity ----------------------------------------------------------------------
    def check_integrity(self) -> list[str]:
        """The invariants of the module docstring, as a list of problems (empty: sound)."""
        problems: list[str] = []
        held: dict[tuple[int, int], str] = {}
        by_giver: dict[int, set[str]] = {}
        for tid, t in self.pending.items():
            if t.id != tid or t.state != PENDING:
                problems.append(f"pending ticket {short(tid)} is {t.state} (id {short(t.id)})")
            if not 1 <= len(t.units) <= MAX_TICKET_UNITS or len(set(t.units)) != len(t.units):
                problems.append(f"ticket {short(tid)} names {len(t.units)} units, "
                                f"{len(set(t.units))} distinct")
            if len(t.pfns) != t.pages:
                problems.append(f"ticket {short(tid)} records {len(t.pfns)} pages for {t.pages}")
            for u in t.units:
                if (t.group, u) in held:
                    problems.append(f"unit {u} of group {t.group} is in tickets "
                                    f"{short(held[(t.group, u)])} and {short(tid)}")
                held[(t.group, u)] = tid
            by_giver.setdefault(t.giver.tenant, set()).add(tid)
            if tid in self.settled:
                problems.append(f"ticket {short(tid)} is both pending and settled")
        if held != self.held:
            problems.append("the unit index differs from the pending tickets' units")
        if by_giver != self.by_giver:
            problems.append("the giver index differs from the pending tickets")
        if any(len(v) > MAX_PENDING_PER_GIVER for v in by_giver.values()) \
                or len(self.pending) > MAX_PENDING:
            problems.append("more tickets are pending than the caps allow")
        for tid, t in self.settled.items():
            if t.state not in (CLAIMED, EXPIRED, CANCELLED):
                problems.append(f"settled ticket {short(tid)} is {t.state}")
        if len(self.settled) > MAX_SETTLED:
            problems.append(f"{len(self.settled)} settled tickets kept (at most {MAX_SETTLED})")
        return problems


def short(tid: str) -> str:
    """A ticket id as shown in messages and logs: its first 8 hex digits (the whole id is
    a capability: it is never logged)."""
    return tid[:8] + "…" if len(tid) > 8 else tid
