"""The daemon's decisions and memory moves as one stream: a bounded ring buffer plus
long-poll followers, and :class:`Moves`, the one place a handler records a move.

One :class:`EventLog` serves the whole daemon (every device's events, each marked with
its ``device``: one ``seq`` order, so ``kvpool events --since`` means the same on every
device). Each device's handlers record through that device's :class:`Moves` (one call
per move: ``moves.record(kind, tenant, bytes, **cause)``): grants and releases, reclaim
asks and answers, leases, sleeps and wakes with their reason, weight sets created,
sealed, attached, detached and evicted, a dead tenant's memory returned.

Every event gets the next ``seq`` (1, 2, ...). :meth:`EventLog.after` answers an
``Events{since}`` request from the ring; events older than the ring holds are counted
as ``lost`` (the reader sees the gap, nothing is buffered for it). A follower (an
``Events{follow}`` request with nothing new yet) is parked, at most one per session (a
newer request replaces it), and answered as soon as events arrive: the log asks the
loop to wake (``wake``) once per batch, and :meth:`EventLog.flush` replies from the
loop thread. Memory is bounded by the ring and by one parked request per session; a
slow follower costs nothing but the gap it will see.

Only the event loop's thread touches an :class:`EventLog`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from kvpool import protocol as p

if TYPE_CHECKING:
    from kvpool.daemon.tenants import TenantRecord

log = logging.getLogger("kvpool.daemon.events")

RING = 4096  # events kept (the default of Config.event_ring)


@dataclass
class Follower:
    tenant_id: int
    envelope: list[bytes]
    req: p.Events


class EventLog:
    def __init__(self, size: int = RING, wake: Callable[[], None] | None = None):
        self.ring: deque[p.EventInfo] = deque(maxlen=size)
        self.seq = 0
        self.followers: dict[int, Follower] = {}  # session (tenant id) -> parked request
        self.wake = wake  # asks the loop to flush (set once, by the first observer)
        self._woken = False
        self.recorded: Counter[int] = Counter()  # device -> events recorded since start

    def waker(self, wake: Callable[[], None]) -> None:
        """``wake`` asks the loop to flush the followers; the first caller's is kept (one
        log serves every device, and one observer's wake is enough)."""
        if self.wake is None:
            self.wake = wake

    def record(self, kind: str, tenant: TenantRecord | None = None, nbytes: int = 0,
               device: int = 0, **detail: Any) -> p.EventInfo:
        """Append one event (about ``tenant``, or about none) of ``device``."""
        self.seq += 1
        self.recorded[device] += 1
        ev = p.EventInfo(seq=self.seq, time=time.time(), kind=kind,
                         tenant=tenant.name if tenant is not None else "",
                         tenant_id=tenant.id if tenant is not None else 0,
                         bytes=nbytes, device=device, detail=detail)
        self.ring.append(ev)
        if self.followers and not self._woken and self.wake is not None:
            self._woken = True
            self.wake()
        return ev

    def after(self, since: int, tenant: str | None = None,
              limit: int = p.EVENTS_LIMIT) -> p.EventsReply:
        """Events with ``seq > since`` (only those naming ``tenant``, by name or id, when
        given), oldest first, at most ``limit``; ``next`` is where to go on from. A
        ``since`` past the last seq (a previous daemon's) starts from the beginning."""
        if since > self.seq:
            since = 0
        oldest = self.ring[0].seq if self.ring else self.seq + 1
        lost = max(0, oldest - since - 1)
        out: list[p.EventInfo] = []
        last = self.seq
        for i in range(max(0, since + 1 - oldest), len(self.ring)):
            ev = self.ring[i]
            if tenant is None or ev.tenant == tenant or str(ev.tenant_id) == tenant \
                    or tenant in ev.detail.get("tenants", ()):
                out.append(ev)
                if len(out) >= limit:
                    last = ev.seq
                    break
        return p.EventsReply(events=out, next=last, lost=lost)

    def request(self, tenant_id: int, envelope: list[bytes], r: p.Events) -> p.EventsReply | None:
        """Answer ``r`` now, or park it (``follow`` with nothing new): None then."""
        reply = self.after(r.since, r.tenant, r.limit)
        if reply.events or reply.lost or not r.follow:
            self.followers.pop(tenant_id, None)
            reply.id = r.id
            return reply
        self.followers[tenant_id] = Follower(tenant_id, list(envelope), r)
        return None

    def forget(self, tenant_id: int) -> None:
        self.followers.pop(tenant_id, None)

    def flush(self, send: Callable[[list[bytes], p.Reply], None]) -> int:
        """Answer every parked follower that has something new; returns how many."""
        self._woken = False
        done = 0
        for tid, f in list(self.followers.items()):
            reply = self.after(f.req.since, f.req.tenant, f.req.limit)
            if reply.events or reply.lost:
                del self.followers[tid]
                reply.id = f.req.id
                send(f.envelope, reply)
                done += 1
            else:
                f.req.since = reply.next  # skip what this follower's filter left out
        return done


Watch = Callable[[p.EventInfo], None]


class Moves:
    """Where one device's handlers record what they did with memory, and why: one call
    per move, ``moves.record(kind, tenant, nbytes, **cause)`` (``cause``: small values,
    e.g. ``reason="pressure"``, ``key=...``). Records nothing until the observer attaches
    the daemon's :class:`EventLog` (:meth:`attach`); ``watch`` then hears every event of
    this device as it is recorded (the observer's reclaim round).

    Obligations of a caller: record after the move is done (the numbers are the state
    now), only from the loop's thread. :meth:`record` never raises and is cheap (an
    append to a bounded ring): it may sit on the grant path."""

    def __init__(self, device: int = 0, page_size: int = 1):
        self.device = device
        self.page_size = page_size
        self.log: EventLog | None = None
        self.watch: Watch | None = None

    def attach(self, events: EventLog, watch: Watch | None = None) -> None:
        self.log, self.watch = events, watch

    def record(self, kind: str, tenant: TenantRecord | None = None, nbytes: int = 0,
               **cause: Any) -> None:
        if self.log is None:
            return
        try:
            ev = self.log.record(kind, tenant, nbytes, device=self.device, **cause)
            if self.watch is not None:
                self.watch(ev)
        except Exception:  # recording must never change what the daemon does
            log.exception("recording a %s event failed", kind)

    def pages(self, kind: str, tenant: TenantRecord | None, pages: int, **cause: Any) -> None:
        """:meth:`record` of ``pages`` pages of this device."""
        self.record(kind, tenant, pages * self.page_size, **cause)
