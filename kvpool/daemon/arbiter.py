"""Request handling: the daemon's state machine, free of sockets (testable alone).

``Arbiter.handle(identity, request)`` authorizes the request, dispatches it by type to
its handler and returns an :class:`~kvpool.daemon.outcome.Outcome`: the reply, the pfns
whose descriptors must go to the tenant's fd channel *before* the reply is sent (for
grants), and whether the tenant's session ends. A grant or lease that must wait for
reclaim returns a *deferred* outcome; :meth:`Arbiter.tick` later returns its real one
(with the envelope to answer). Unsolicited messages for tenants (``Reclaim``) are
queued in :attr:`Arbiter.outbox` for the server to send.

The arbiter owns the state (tenants, groups, pool, counters, recovery); each concept's
handlers live in their own file and reach the state through ``self.arbiter``:
:mod:`~kvpool.daemon.registry` (sessions, register, knobs, set_limit, drop),
:mod:`~kvpool.daemon.grants` (groups, grant, release, report, lease, reclaimed),
:mod:`~kvpool.daemon.adoption` (Adopt after a restart), :mod:`~kvpool.daemon.locate`
(locate a tenant by name), :mod:`~kvpool.daemon.views`
(ps, stats, map, check) and :mod:`~kvpool.daemon.integrity` (the self-check). Reclaim
policy lives in :mod:`kvpool.daemon.reclaim`, the weighted shares in
:mod:`kvpool.daemon.fairshare`.

**Adding a request type**: define it in :mod:`kvpool.protocol.requests` (its reply in
``replies.py``), write its handler ``(tenant, identity, request) -> Reply | Outcome``
in the file of its concept (or a new one), and register it in :meth:`Arbiter.__init__`
(or, from outside, with :meth:`Arbiter.add_handler`); ``auth.authorize`` decides who
may send it (``p.MONITOR_OPS``/``p.ADMIN_OPS``).

Every failure is a :class:`Fail` carrying a stable error code; the server turns any
other exception into ``INTERNAL`` and keeps serving.
"""

from __future__ import annotations

import logging
import socket
import time

from kvpool import protocol as p
from kvpool.daemon.adoption import Adoption
from kvpool.daemon.auth import Denied, authorize
from kvpool.daemon.config import Config
from kvpool.daemon.grants import Grants
from kvpool.daemon.handoff import Handoff
from kvpool.daemon.integrity import check_integrity
from kvpool.daemon.locate import Locator
from kvpool.daemon.outcome import Fail, Handler, Outcome
from kvpool.daemon.pool import Pool
from kvpool.daemon.reclaim import Ask, Reclaimer
from kvpool.daemon.regions import GroupRecord
from kvpool.daemon.registry import Registry
from kvpool.daemon.restart import Recovery
from kvpool.daemon.tenants import TenantRecord, Tenants
from kvpool.daemon.views import Views

__all__ = ["Arbiter", "Fail", "Outcome"]

log = logging.getLogger("kvpool.daemon")


class Arbiter:
    def __init__(self, cfg: Config, pool: Pool, budget: int):
        self.cfg = cfg
        self.pool = pool
        self.page_size = pool.page_size
        self.budget = budget
        self.tenants = Tenants()
        self.groups: dict[int, GroupRecord] = {}  # every live group, by id (all tenants)
        self.next_group = 1  # the next group id to try (see new_group_id)
        self.recovery = Recovery()
        self.outbox: list[tuple[bytes, p.Reply]] = []
        self.reclaimer = Reclaimer(self, cfg.reclaim_timeout_s, cfg.short_backoff_s)
        self.envelope: list[bytes] = []  # where the request being handled is answered
        self.started = time.monotonic()
        self.requests = 0
        self.errors = 0
        self.registry = Registry(self)
        self.grants = Grants(self)
        self.adoption = Adoption(self)
        self.views = Views(self)
        self.handoff = Handoff(self, cfg.handoff_pairs())
        g, v = self.grants, self.views
        self._handlers: dict[type[p.Request], Handler] = {
            p.Register: self.registry.register,
            p.CreateGroup: g.create_group,
            p.DestroyGroup: g.destroy_group,
            p.Grant: g.grant,
            p.Release: g.release,
            p.Report: g.report,
            p.Bye: lambda t, i, r: Outcome(p.Done(id=r.id), tenant=t, end_session=True),
            p.Ping: lambda t, i, r: p.Done(id=r.id),
            p.Ps: v.ps,
            p.Stats: v.stats,
            p.MapReq: v.map,
            p.SetLimit: self.registry.set_limit,
            p.Check: v.check,
            p.Lease: g.lease,
            p.Reclaimed: g.reclaimed,
            p.Adopt: self.adoption.adopt,
            p.Shutdown: lambda t, i, r: Outcome(p.Done(id=r.id), stop=True),
            p.Offer: self.handoff.offer,
            p.Claim: self.handoff.claim,
            p.Cancel: self.handoff.cancel,
            p.Locate: Locator(self).locate,
        }

    # ---- entry points -----------------------------------------------------------------
    def handle(self, identity: bytes, req: p.Request,
               envelope: list[bytes] | None = None) -> Outcome:
        self.requests += 1
        op = req.__struct_config__.tag
        assert isinstance(op, str)
        self.envelope = envelope or [identity]
        try:
            tenant = authorize(op, req.token, identity, self.tenants)
            result = self._handlers[type(req)](tenant, identity, req)
        except Denied as e:
            return self.fail(req.id, p.UNAUTHORIZED, str(e))
        except Fail as e:
            return self.fail(req.id, e.code, str(e))
        if isinstance(result, Outcome):
            return result
        return Outcome(result, tenant=tenant)

    def add_handler(self, req_type: type[p.Request], handler: Handler) -> None:
        """Handle requests of ``req_type`` with ``handler`` (e.g. the observer's Events)."""
        self._handlers[req_type] = handler

    def tick(self, now: float | None = None) -> list[Outcome]:
        """Serve waiting requests whose pages are free, fail the late ones, and send the
        reclaim asks still needed. Returns outcomes to emit (each with its envelope)."""
        now = time.monotonic() if now is None else now
        if self.recovery.finish_if_done(now):
            log.info("recovery done: %d tenants, %d pages adopted", len(self.tenants),
                     self.pool.granted)
        self.handoff.tick(now)  # expired tickets: their givers keep the pages
        if self.recovering:
            return []
        out = []
        for w, err in self.reclaimer.step(now):
            o = Outcome(err, tenant=w.tenant) if err is not None else self.grants.serve(w)
            if err is not None:
                self.errors += 1
            o.envelope = w.envelope
            out.append(o)
        return out

    def next_deadline(self) -> float | None:
        d = self.reclaimer.next_deadline()
        e = self.handoff.next_deadline()
        d = min(d, e) if d is not None and e is not None else (d if e is None else e)
        if self.recovering:
            until = self.recovery.until
            d = min(d, until) if d is not None else until
        return d

    # ---- sessions (the server's calls) ------------------------------------------------
    def open_session(self, conn: socket.socket, pid: int, uid: int, gid: int,
                     pidfd: int | None) -> TenantRecord:
        return self.registry.open(conn, pid, uid, gid, pidfd)

    def drop(self, t: TenantRecord, why: str) -> None:
        self.handoff.dropped(t)  # its offers end; its pages go back with the rest
        self.registry.drop(t, why)

    def unsolicited(self, t: TenantRecord, msg: p.Reply) -> None:
        """Queue a message for ``t`` (sent by the server on the ROUTER to its identity)."""
        if t.identity is not None:
            self.outbox.append((t.identity, msg))

    def take_outbox(self) -> list[tuple[bytes, p.Reply]]:
        """The queued unsolicited messages, oldest first (the queue is left empty)."""
        out, self.outbox = self.outbox, []
        return out

    # ---- restart ------------------------------------------------------------------
    @property
    def recovering(self) -> bool:
        """Rebuilding the accounting after a restart: grants and leases get ``BUSY``."""
        return self.recovery.active

    def begin_recovery(self, pids: set[int], names: dict[str, int], uids: dict[int, int],
                       next_group: int, until: float) -> None:
        """Wait for the previous daemon's live tenants (``pids``; their ``names`` and
        ``uids``) to adopt what they map, until ``until``; group ids continue from
        ``next_group``."""
        self.next_group = max(self.next_group, next_group)
        if pids:
            self.recovery.begin(pids, names, uids, until)

    def new_group_id(self) -> int:
        """The next free group id, in ``1..MAX_GROUP_ID`` (wrapping around, skipping live
        ones): ids never grow past what clients, the wire and ``state.json`` carry."""
        gid = self.next_group
        for _ in range(len(self.groups) + 2):
            if not 1 <= gid <= p.MAX_GROUP_ID:
                gid = 1
            if gid not in self.groups:
                break
            gid += 1
        self.next_group = gid + 1
        return gid

    # ---- shared helpers ------------------------------------------------------------
    def fail(self, id: int, code: str, message: str) -> Outcome:
        self.errors += 1
        return Outcome(p.error(id, code, message))

    def knobs(self, name: str, asked: p.Register | None = None) -> tuple[int, int, float]:
        return self.registry.knobs(name, asked)

    def limit_pages(self, name: str) -> int:
        return self.knobs(name)[1]

    def log_ignored(self, t: TenantRecord, ask: Ask) -> None:
        log.warning("tenant %d (%s) ignored reclaim %d (%s, %d pages still held above the "
                    "ask); capped at its min until it answers", t.id, t.name, ask.seq,
                    ask.reason, ask.pages)

    # ---- read-only views ---------------------------------------------------------------
    def tenant_info(self, t: TenantRecord, shares: dict[int, int] | None = None) -> p.TenantInfo:
        return self.views.tenant_info(t, shares)

    def pool_info(self) -> p.PoolInfo:
        return self.views.pool_info()

    def listed(self) -> list[p.TenantInfo]:
        return self.views.listed()

    def check_integrity(self) -> list[str]:
        return check_integrity(self)
