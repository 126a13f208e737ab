"""Page handoff, the client's side: give units of a region group to another tenant, or
take units another tenant gave, without copying a byte (the wire:
``Offer``/``Claim``/``Cancel`` in :mod:`kvpool.protocol.requests`).

    # giver (e.g. a prefill engine): a request's KV is whole units of one group
    ticket = handoff.offer(group, units=[4, 5, 6], to="decode", ttl_s=10)
    send_to_decode(ticket.id, len(ticket.units))     # out of band (the router)
    ticket.wait()           # "claimed": the units are unmapped here; else kept

    # receiver (e.g. a decode engine), a group of the same layout
    handoff.claim(group, ticket_id, at_units=[0, 1, 2])   # mapped; the giver's bytes

Rules the caller keeps:

* between ``offer`` and the ticket's settlement the giver must not write those units
  (the receiver may be reading them) nor release them (a claim then fails and the
  ticket is cancelled); it may still read them;
* a claimed ticket's units are unmapped here by this module when the daemon's
  :class:`~kvpool.protocol.replies.Settled` arrives (the keeper thread delivers it):
  the memory now belongs to, and is charged to, the receiver; nothing is released;
* a receiver that knows whose offer it expects (a successor that located its
  predecessor by name) names that tenant's id: ``claim(..., giver=ID)`` or, for the
  next claim whoever makes it, :meth:`Handoffs.expect_giver`; the daemon then refuses
  any other tenant's ticket (``UNAUTHORIZED``, nothing moves);
* units handed over must be units nothing else of this process manages: when an
  :class:`~kvpool.client_lib.allocator.ElasticBlockAllocator` sits on the group, the
  engine side forgets them in its own books (request-aligned units).

For the engine side (issue 15 points 2-4): a request's KV must be whole units of one
group, so request-aligned allocation gives each request its own chunks (an allocator
chunk is ``pages_per_chunk`` consecutive units: chunk ``c`` is units
``c * pages_per_chunk ..``). The giver offers those units in block-table order and drops
the chunks from its allocator's books once ``ticket.wait()`` says ``claimed`` (the pages
are unmapped already; no ``Release``); the receiver picks as many unmapped units
(whole chunks it takes out of its allocator's unmapped set), claims at them, marks their
blocks held for the request and rewrites the block table to the new block ids. The
ticket id and the unit count travel with the request (tokens, sampling state).

After a daemon restart the tenant's pending offers are cancelled (the new daemon knows no
ticket; the giver re-adopted its pages). A claim the old daemon granted whose ``Settled``
never reached the giver leaves both sides mapping the pages: the second to adopt them
is refused (a page granted already) — a known limit.

Invariant: a group's ``mapped`` set and ``handles`` lose a unit only when the daemon says
it was claimed (or the group releases it), and gain one only when a claim's descriptors
are mapped in every region.

Every :class:`~kvpool.client_lib.tenant.Tenant` owns one :class:`Handoffs` (its
``handoffs``); this module sees tenants and region groups only through the small
interfaces below (:class:`HandoffSession`, :class:`HandoffGroup`, :class:`HandoffHolder`),
so it imports neither.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import AbstractSet, Final, Literal, Mapping, Protocol, Sequence, TypeVar

from kvpool import protocol as p
from kvpool.client_lib.errors import KvpoolError

PENDING: Final = "pending"
TicketState = Literal["pending", p.SettledState]  # an offer's: pending, then how it ended
R = TypeVar("R", bound=p.Reply)


class HandoffHolder(Protocol):
    """A tenant, as far as the module functions need it: its one :class:`Handoffs`."""

    @property
    def handoffs(self) -> Handoffs: ...


class HandoffGroup(Protocol):
    """A region group (:class:`~kvpool.client_lib.regions.RegionGroup`) as handoff uses it.

    Obligations: ``mapped`` is the set of units mapped in every region; ``map_granted``
    maps the page descriptors of a claim at those units (all or nothing, taking the
    descriptors over); ``forget`` unmaps units whose pages went to another tenant without
    telling the daemon; ``tenant`` is the session the group belongs to."""

    @property
    def id(self) -> int: ...
    @property
    def mapped(self) -> AbstractSet[int]: ...
    @property
    def tenant(self) -> HandoffHolder: ...

    def map_granted(self, units: list[int], fds: list[int], populate: bool = False) -> None: ...
    def forget(self, units: Sequence[int]) -> list[int]: ...


class HandoffSession(Protocol):
    """What :class:`Handoffs` needs from its tenant.

    Obligations: ``call`` sends one request on the live session (raising ``KvpoolError``
    for an error reply); ``name`` is the tenant's registered name; ``groups`` its live
    region groups by id (a closed group is no longer listed)."""

    @property
    def name(self) -> str: ...
    @property
    def groups(self) -> Mapping[int, HandoffGroup]: ...

    def call(self, req: p.Request, expect: type[R]) -> tuple[R, list[int]]: ...
NOTICE_WAIT_S = 1.0  # a cancel that finds its ticket over waits this for the Settled


@dataclass
class Ticket:
    """An offer this process made: ``id`` is the capability to pass to the receiver."""

    id: str
    group: int
    units: tuple[int, ...]
    to: str
    pages: int
    ttl_s: float
    state: TicketState = PENDING  # then one of p.SETTLED_STATES
    reason: str = ""
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def settled(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> TicketState:
        """Block until the daemon settles the ticket (or ``timeout_s``, default the ttl
        plus 5 s); returns the state (``pending`` on timeout)."""
        self._done.wait(self.ttl_s + 5.0 if timeout_s is None else timeout_s)
        return self.state

    def settle(self, state: p.SettledState, reason: str) -> None:
        """(:class:`Handoffs`) The ticket is over: record how and wake its waiters."""
        self.state, self.reason = state, reason
        self._done.set()


class Handoffs:
    """One tenant's offers in flight, and what to do when the daemon settles them."""

    def __init__(self, tenant: HandoffSession):
        self.tenant = tenant
        self.tickets: dict[str, Ticket] = {}
        self._lock = threading.Lock()
        self._early: dict[str, p.Settled] = {}  # a Settled read before its Offered returned
        self._next_giver = 0  # the tenant id the next claim must come from (0: any)
        self._givers: dict[str, str] = {}  # ticket claimed -> its giver's name (the daemon's)

    def offer(self, group: HandoffGroup, units: Sequence[int], to: str,
              ttl_s: float = 10.0) -> Ticket:
        """Put mapped ``units`` of ``group`` in escrow for tenant ``to`` (order kept: the
        receiver's ``at_units[i]`` gets ``units[i]``)."""
        units = list(units)
        missing = [u for u in units if u not in group.mapped]
        if missing:
            raise ValueError(f"unit {missing[0]} of group {group.id} is not mapped")
        ttl_ms = max(1, min(p.MAX_TTL_MS, round(ttl_s * 1000)))
        reply, _ = self.tenant.call(
            p.Offer(group=group.id, units=units, to=to, ttl_ms=ttl_ms), p.Offered)
        t = Ticket(id=reply.ticket, group=group.id, units=tuple(units), to=to,
                   pages=reply.pages, ttl_s=ttl_ms / 1000)
        with self._lock:
            self.tickets[t.id] = t
            early = self._early.pop(t.id, None)
        if early is not None:
            self.settled(early)
        return t

    def cancel(self, ticket: Ticket | str) -> bool:
        """Take a pending offer back: True when cancelled (the pages stay here); False
        when the ticket is over already (its state says how: claimed, expired). Either
        way the ticket is settled when this returns, even if its Settled was lost."""
        tid = ticket.id if isinstance(ticket, Ticket) else ticket
        try:
            self.tenant.call(p.Cancel(ticket=tid), p.Done)
        except KvpoolError as e:
            if e.code != p.NOT_FOUND:
                raise
            t = self.tickets.get(tid)
            if t is not None and t.wait(NOTICE_WAIT_S) == PENDING:
                self._settle_from_map(t)  # its Settled is lost or late: ask the daemon
            return False
        self._finish(tid, "cancelled", "cancelled by the giver")
        return True

    def _settle_from_map(self, t: Ticket) -> None:
        """``t`` is over at the daemon, but its Settled has not come: the daemon's map of
        ``t``'s group says how — every unit still granted here: it expired (the pages stay
        ours); not: it was claimed, and the units are unmapped here as a Settled would
        (never read or written again: they are the receiver's)."""
        reply, _ = self.tenant.call(
            p.MapReq(tenant=self.tenant.name, after=t.group - 1, limit=1), p.MapReply)
        held = {u for g in reply.groups if g.id == t.group
                for r in g.runs for u in range(r.start, r.start + r.length)}
        state: p.SettledState = "expired" if all(u in held for u in t.units) else "claimed"
        self.settled(p.Settled(ticket=t.id, state=state, group=t.group, units=list(t.units),
                               reason="its notice was lost: the daemon's map says so"))

    def expect_giver(self, tenant_id: int) -> None:
        """The next :meth:`claim` of this tenant (whoever makes it) must be of an offer by
        tenant ``tenant_id`` (a daemon tenant id, e.g. ``Located.tenant``): the daemon
        refuses it otherwise, nothing moving. Consumed by that claim, refused or not."""
        with self._lock:
            self._next_giver = tenant_id

    def claim(self, group: HandoffGroup, ticket: Ticket | str, at_units: Sequence[int],
              populate: bool = False, giver: int = 0) -> list[int]:
        """Map the ticket's pages at ``at_units`` (unmapped) of ``group``; returns them.
        The pages hold the giver's bytes (not zeroed). All or nothing. ``giver`` (or, if
        0, the one :meth:`expect_giver` set): the tenant id whose offer this must be —
        else ``KvpoolError`` (``UNAUTHORIZED``) and nothing is claimed."""
        tid = ticket.id if isinstance(ticket, Ticket) else ticket
        at = list(at_units)
        with self._lock:
            giver, self._next_giver = giver or self._next_giver, 0
        reply, fds = self.tenant.call(
            p.Claim(ticket=tid, group=group.id, units=at, giver=giver), p.Claimed)
        group.map_granted(at, fds, populate)
        with self._lock:
            self._givers[tid] = reply.giver
            while len(self._givers) > 1024:
                self._givers.pop(next(iter(self._givers)))
        return at

    def giver_of(self, ticket: str) -> str | None:
        """The name of the tenant whose offer ``ticket`` was, as the daemon said when this
        tenant claimed it (one of the last 1024 claims); None if not claimed here."""
        with self._lock:
            return self._givers.get(ticket)

    # ---- the daemon's word ----------------------------------------------------------------
    def settled(self, m: p.Settled) -> None:
        """A ticket of ours is over (keeper thread): on ``claimed`` drop the mappings of
        its units (the pages are the receiver's now; nothing goes back to the daemon)."""
        with self._lock:
            t = self.tickets.get(m.ticket)
            if t is None:
                self._early[m.ticket] = m
                while len(self._early) > 1024:
                    self._early.pop(next(iter(self._early)))
                return
        if m.state == "claimed":
            group = self.tenant.groups.get(m.group)
            if group is not None:
                forget(group, list(m.units))
        self._finish(m.ticket, m.state, m.reason)

    def _finish(self, tid: str, state: p.SettledState, reason: str) -> None:
        with self._lock:
            t = self.tickets.pop(tid, None)
        if t is not None:
            t.settle(state, reason)

    def void(self, reason: str) -> None:
        """Every pending offer is over (the daemon restarted: the new one knows no ticket
        and adopted the pages from us): cancelled, the pages stay here."""
        for t in self.pending():
            self._finish(t.id, "cancelled", reason)

    def pending(self) -> list[Ticket]:
        with self._lock:
            return list(self.tickets.values())


def forget(group: HandoffGroup, units: list[int]) -> None:
    """Unmap ``units`` of ``group`` in every region and drop their page handles, without
    telling the daemon (it moved the pages to another tenant already)."""
    group.forget(units)


def of(tenant: HandoffHolder) -> Handoffs:
    """The tenant's :class:`Handoffs`."""
    return tenant.handoffs


def offer(group: HandoffGroup, units: Sequence[int], to: str, ttl_s: float = 10.0) -> Ticket:
    return of(group.tenant).offer(group, units, to, ttl_s)


def claim(group: HandoffGroup, ticket: Ticket | str, at_units: Sequence[int],
          populate: bool = False, giver: int = 0) -> list[int]:
    return of(group.tenant).claim(group, ticket, at_units, populate, giver)


def cancel(tenant: HandoffHolder, ticket: Ticket | str) -> bool:
    return of(tenant).cancel(ticket)
