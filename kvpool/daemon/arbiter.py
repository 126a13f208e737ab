"""Request handling: the daemon's state machine, free of sockets (testable alone).

``Arbiter.handle(identity, request)`` authorizes the request, dispatches it by type to
its handler and returns an :class:`~kvpool.daemon.outcome.Outcome`: the reply, the pfns
whose descriptors must go to the tenant's fd channel *before* the reply is sent (for
grants), and whether the tenant's session ends. A grant or lease that must wait for
reclaim returns a *deferred* outcome; :meth:`Arbiter.tick` later returns its real one
(with the envelope to answer). Unsolicited messages for tenants (``Reclaim``,
``Settled``) are queued in the :class:`~kvpool.daemon.outcome.Outbox` for the server to
send (:meth:`Arbiter.take_outbox`).

The arbiter builds the state (tenants, the group index, the pool it is given, the
request counters, the recovery) and hands each concept's handler only the parts it acts
on: :mod:`~kvpool.daemon.registry` (sessions, register, knobs, set_limit, drop),
:mod:`~kvpool.daemon.grants` (groups, grant, release, report, lease, reclaimed),
:mod:`~kvpool.daemon.adoption` (Adopt after a restart), :mod:`~kvpool.daemon.handoff`
(offer, claim, cancel), :mod:`~kvpool.daemon.locate` (locate a tenant by name),
:mod:`~kvpool.daemon.weights` (weight sets: create, seal, attach, detach),
:mod:`~kvpool.daemon.sleepers` (sleep states, the operator's sleep/wake, who the reclaimer
puts to sleep),
:mod:`~kvpool.daemon.views` (ps, stats, map, check) and
:mod:`~kvpool.daemon.integrity` (the self-check). Reclaim policy lives in
:mod:`kvpool.daemon.reclaim`, the weighted shares in :mod:`kvpool.daemon.fairshare`.
What is left here is the dispatch table, the tick and the session calls of the server.
An observer (:mod:`kvpool.daemon.hooks`, set with :meth:`Arbiter.observe`) hears of
every request handled, every tick and every session dropped.

**Adding a request type**: define it in :mod:`kvpool.protocol.requests` (its reply in
``replies.py``), write its handler ``(tenant, sender, request) -> Reply | Outcome``
in the file of its concept (or a new one, taking the state it needs in its
constructor), and register it in :meth:`Arbiter.__init__` (or, from outside, with
:meth:`Arbiter.add_handler`); ``auth.authorize`` decides who may send it
(``p.MONITOR_OPS``/``p.ADMIN_OPS``).

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
from kvpool.daemon.counters import Counters
from kvpool.daemon.events import Moves
from kvpool.daemon.gangs import GangDevice, Gangs
from kvpool.daemon.grants import Grants
from kvpool.daemon.handoff import Handoff
from kvpool.daemon.hooks import ArbiterObserver, NoObserver
from kvpool.daemon.integrity import Integrity
from kvpool.daemon.ledger import Ledger
from kvpool.daemon.locate import Locator
from kvpool.daemon.outcome import Fail, Handler, Outbox, Outcome, Sender
from kvpool.daemon.policy import POLICIES
from kvpool.daemon.pool import Pool
from kvpool.daemon.reclaim import Reclaimer, Waiter
from kvpool.daemon.regions import GroupIndex
from kvpool.daemon.registry import Registry
from kvpool.daemon.restart import Recovery
from kvpool.daemon.sleepers import SleepBook
from kvpool.daemon.tenants import TenantRecord, Tenants
from kvpool.daemon.views import Views
from kvpool.daemon.weights import WeightSets

__all__ = ["Arbiter", "Fail", "Outcome"]

log = logging.getLogger("kvpool.daemon")


class Arbiter:
    """One device's arbiter: ``pool`` of ``budget`` bytes under ``cfg``. With several
    devices (kvpool.daemon.devices) each has one, over its device's view of the
    daemon-wide session index ``tenants``, all sharing ``gangs``; alone, it has its own."""

    def __init__(self, cfg: Config, pool: Pool, budget: int, tenants: Tenants | None = None,
                 gangs: Gangs | None = None):
        self.cfg = cfg
        self.pool = pool
        self.page_size = pool.page_size
        self.budget = budget
        self.device = pool.backend.device
        self.tenants = Tenants(self.device, tenants) if tenants is not None else Tenants()
        self.gangs = gangs if gangs is not None else Gangs(cfg.reclaim_timeout_s)
        self.groups = GroupIndex()  # every live group, by id (all tenants)
        self.recovery = Recovery()
        self.outbox = Outbox()
        self.counters = Counters()
        self.observer: ArbiterObserver = NoObserver()
        self.moves = Moves(self.device, self.page_size)  # handlers record moves here (events.py)
        most, vmost = cfg.max_groups_per_tenant, cfg.max_virtual_pages_per_tenant
        # every page move of this device (the reclaimer hears of pages given back)
        self.ledger = Ledger(pool, self.moves, lambda t, n: self.reclaimer.released(t, n))
        self.weights = WeightSets(pool, self.tenants, lambda: self.reclaimer.waiting_pages,
                                  self._weights_wait, ledger=self.ledger)
        self.sleep = SleepBook(cfg, self.tenants, self.outbox, cfg.reclaim_timeout_s,
                               self.weights.sole_pages, moves=self.moves)
        self.reclaimer = Reclaimer(self.tenants, pool, budget, self.outbox,
                                   cfg.reclaim_timeout_s, cfg.short_backoff_s,
                                   POLICIES.lookup(cfg.reclaim_policy), self.weights, self.sleep)
        self.registry = Registry(cfg, pool, self.ledger, budget, self.tenants, self.groups,
                                 self.reclaimer, self.recovery)
        self.grants = Grants(pool, self.ledger, self.groups, self.reclaimer, self.recovery,
                             self.counters, most, vmost)
        self.adoption = Adoption(pool, self.ledger, self.groups, self.recovery, most, vmost)
        self.handoff = Handoff(pool, self.ledger, self.tenants, self.groups, self.reclaimer,
                               self.recovery, self.outbox, cfg.handoff_pairs(),
                               cfg.handoff_letgo_s)
        self.gangs.attach(self.device, GangDevice(self.ledger, self.grants, self.reclaimer))
        self.integrity = Integrity(pool, self.ledger, self.tenants, self.groups, self.handoff,
                                   most, vmost, self.weights, self.gangs)
        self.views = Views(pool, self.tenants, self.groups, self.reclaimer, self.recovery,
                           self.counters, self.integrity, self.weights, self.sleep)
        locator = Locator(self.tenants, self.handoff.pairs)
        g, v, h, solo = self.grants, self.views, self.handoff, self._solo
        self._handlers: dict[type[p.Request], Handler] = {
            p.Register: self._register,
            p.CreateGroup: self._create_group,
            p.DestroyGroup: solo(g.destroy_group, "destroy a group (a gang's groups end "
                                                  "with the gang: bye)"),
            p.Grant: self._grant,
            p.Release: self._release,
            p.CreateGang: self.gangs.create,
            p.Report: g.report,
            p.Bye: lambda t, s, r: Outcome(p.Done(id=r.id), tenant=t, end_session=True),
            p.Ping: lambda t, s, r: p.Done(id=r.id),
            p.Ps: v.ps,
            p.Stats: v.stats,
            p.MapReq: v.map,
            p.SetLimit: self.registry.set_limit,
            p.Check: v.check,
            p.Lease: solo(g.lease, "lease"),
            p.Reclaimed: g.reclaimed,
            p.Adopt: solo(self.adoption.adopt, "adopt"),
            p.Shutdown: lambda t, s, r: Outcome(p.Done(id=r.id), stop=True),
            p.Offer: solo(h.offer, "hand pages over"),
            p.Claim: solo(h.claim, "claim pages"),
            p.Cancel: h.cancel,
            p.Locate: locator.locate,
            p.WeightCreate: solo(self.weights.create, "create a weight set"),
            p.WeightSeal: self.weights.seal,
            p.WeightAttach: solo(self.weights.attach, "attach a weight set"),
            p.WeightDetach: self.weights.detach,
            p.WeightWrite: self.weights.write,
            p.WeightPublish: self.weights.publish,
            p.WeightUse: self.weights.use,
            p.SleepTenant: self.sleep.sleep_tenant,
            p.TenantState: lambda t, s, r: self.sleep.tenant_state(t, s, r, time.monotonic()),
            p.Room: lambda t, s, r: g.room(t, self.sleep.record(t).state, r),
        }

    def _register(self, t: TenantRecord, sender: Sender, r: p.Register) -> p.Reply:
        gang = self.gangs.check_join(t, r)  # a rank joining: every check before anything
        reply = self.registry.register(t, sender, r)  # raises Fail when refused
        self.sleep.registered(t, r)
        if gang is not None and isinstance(reply, p.Registered) and r.rank is not None:
            self.gangs.joined(gang, t, r.rank)
            reply.gang_id, reply.rank = gang.id, t.rank
            reply.limit = t.max_pages * self.page_size
        return reply

    # ---- gangs: a rank's memory moves with the gang's (kvpool.daemon.gangs) ----------
    def _grant(self, t: TenantRecord, sender: Sender, r: p.Grant) -> p.Reply | Outcome:
        if t.gang:
            return self.gangs.part(t, sender, r)
        return self.grants.grant(t, sender, r)

    def _release(self, t: TenantRecord, sender: Sender, r: p.Release) -> p.Reply | Outcome:
        if t.gang:
            return self.gangs.part(t, sender, r)
        return self.grants.release(t, sender, r)

    def _create_group(self, t: TenantRecord, sender: Sender, r: p.CreateGroup) -> p.Reply:
        if not t.gang:
            return self.grants.create_group(t, sender, r)
        self.gangs.check_group(t, r)  # the layout's next group
        reply = self.grants.create_group(t, sender, r)
        assert isinstance(reply, p.GroupCreated)
        self.gangs.group_created(t, reply.group)
        return reply

    @staticmethod
    def _solo(handler: Handler, what: str) -> Handler:
        """``handler``, refused to a gang's rank (it holds memory through the gang's
        groups only)."""
        def run(t: TenantRecord | None, sender: Sender, r: p.Request) -> p.Reply | Outcome:
            if t is not None and t.gang:
                raise Fail(p.BAD_REQUEST, f"a rank of a gang may not {what}")
            return handler(t, sender, r)
        return run

    def observe(self, observer: ArbiterObserver) -> None:
        """Report what the arbiter (and its reclaimer) decide to ``observer``."""
        self.observer = observer
        self.reclaimer.observe(observer)

    # ---- entry points -----------------------------------------------------------------
    def handle(self, identity: bytes, req: p.Request,
               envelope: list[bytes] | None = None) -> Outcome:
        sender = self.tenants.by_token.get(req.token) if req.token else None
        before = sender.granted if sender is not None else 0
        t0 = time.perf_counter()
        out = self._dispatch(identity, req, envelope)
        self.observer.handled(req, out, time.perf_counter() - t0, before, sender)
        return out

    def _dispatch(self, identity: bytes, req: p.Request,
                  envelope: list[bytes] | None) -> Outcome:
        self.counters.requests += 1
        op = req.__struct_config__.tag
        assert isinstance(op, str)
        sender = Sender(identity, envelope or [identity])
        try:
            tenant = authorize(op, req.token, identity, self.tenants)
            result = self._handlers[type(req)](tenant, sender, req)
        except Denied as e:
            return self.fail(req.id, p.UNAUTHORIZED, str(e))
        except Fail as e:
            return self.fail(req.id, e.code, str(e))
        if isinstance(result, Outcome):
            return result
        return Outcome(result, tenant=tenant)

    def observed(self, outs: list[Outcome]) -> None:
        """Answers to this device's tenants made outside :meth:`tick` (a gang's parts,
        answered once every rank's is in): the observer hears of them as of tick's."""
        self.observer.ticked(outs)

    def add_handler(self, req_type: type[p.Request], handler: Handler) -> None:
        """Handle requests of ``req_type`` with ``handler`` (e.g. the observer's Events)."""
        self._handlers[req_type] = handler

    def tick(self, now: float | None = None) -> list[Outcome]:
        """Serve waiting requests whose pages are free, fail the late ones, and send the
        reclaim asks still needed. Returns outcomes to emit (each with its envelope).
        Never raises: a bug in the step is logged and counted, and every waiter it took
        off the queue is still answered (served, or ``INTERNAL`` when serving it raised)."""
        now = time.monotonic() if now is None else now
        outs: list[Outcome] = []
        try:
            self._step(now, outs)
        except Exception:  # a bug: the waiters already taken are answered below
            self.counters.errors += 1
            log.exception("device %d: the reclaim step failed", self.device)
        outs += [self._answer(w, err) for w, err in self.reclaimer.take_done()]
        try:
            self.observer.ticked(outs)
        except Exception:
            log.exception("device %d: the observer failed", self.device)
        return outs

    def _step(self, now: float, out: list[Outcome]) -> None:
        if self.recovery.finish_if_done(now):
            log.info("recovery done: %d tenants, %d pages adopted", len(self.tenants),
                     self.pool.granted)
        self.handoff.tick(now)  # expired tickets: their givers keep the pages
        if self.recovering:
            return
        out += self.handoff.let_go(now)  # claims whose givers have let go (or failed to)
        self.reclaimer.step(now)  # (the waiters it took are answered by tick)
        self.gangs.serve()  # waiting gang grants every device covers now (all at once)
        self.gangs.mirror_asks(now)  # a gang is asked as one (every rank, same ask)

    def _answer(self, w: Waiter, err: p.Reply | None) -> Outcome:
        """The outcome for a waiter taken off the queue: ``err``, or served now (an
        ``INTERNAL`` error when serving raises: a bug, logged)."""
        if err is None:
            try:
                o = self._serve(w)
            except Exception as e:
                log.exception("device %d: serving tenant %d's waiting %s failed",
                              self.device, w.tenant.id, type(w.req).__name__)
                err = p.error(w.req.id, p.INTERNAL, f"{type(e).__name__}: {e}")
        if err is not None:
            self.counters.errors += 1
            o = Outcome(err, tenant=w.tenant)
        o.envelope = w.envelope
        return o

    def _serve(self, w: Waiter) -> Outcome:
        """A waiter whose pages are free: a weight set's create, or a grant/lease."""
        if isinstance(w.req, p.WeightCreate):
            return self.weights.serve(w.tenant, w.req, w.pages)
        return self.grants.serve(w)

    def _weights_wait(self, t: TenantRecord, sender: Sender, r: p.WeightCreate,
                      n: int) -> Outcome | None:
        """A weight set that does not fit waits for reclaim as a grant of ``n`` pages
        would (up to ``t``'s fair share, or what putting an idle tenant to sleep frees);
        None: ``t`` may not take memory from others now (refused ``NO_MEMORY``)."""
        now = time.monotonic()
        if t.ask is not None or not (self.reclaimer.may_grow(t, n)
                                     or self.reclaimer.sleep_would_cover(t, n, now)):
            return None
        self.reclaimer.wait(t, sender.envelope, r, n, now)
        return Outcome(None, tenant=t, deferred=True)

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
        held, arbitrated, t0 = t.held, t.arbitrated, time.perf_counter()
        self.handoff.dropped(t)  # its offers end; its pages go back with the rest
        self.weights.dropped(t)  # its holds end; a set it was loading goes
        self.sleep.dropped(t)  # its sleep state is forgotten
        self.gangs.dropped(t, why)  # its gang ends: every rank's pages return
        self.registry.drop(t, why)
        self.observer.dropped(t, why, held, arbitrated, time.perf_counter() - t0)

    def take_outbox(self) -> list[tuple[bytes, p.Reply]]:
        """The queued unsolicited messages, oldest first (the queue is left empty)."""
        return self.outbox.take()

    # ---- restart ------------------------------------------------------------------
    @property
    def recovering(self) -> bool:
        """Rebuilding the accounting after a restart: grants and leases get ``BUSY``."""
        return self.recovery.active

    @property
    def next_group(self) -> int:
        """The next group id to try (``GroupIndex.new_id``)."""
        return self.groups.next_id

    @next_group.setter
    def next_group(self, value: int) -> None:
        self.groups.next_id = value

    def begin_recovery(self, pids: set[int], names: dict[str, int], uids: dict[int, int],
                       next_group: int, until: float) -> None:
        """Wait for the previous daemon's live tenants (``pids``; their ``names`` and
        ``uids``) to adopt what they map, until ``until``; group ids continue from
        ``next_group``."""
        self.groups.continue_from(next_group)
        if pids:
            self.recovery.begin(pids, names, uids, until)

    # ---- shared helpers ------------------------------------------------------------
    def fail(self, id: int, code: str, message: str) -> Outcome:
        self.counters.errors += 1
        return Outcome(p.error(id, code, message))

    # ---- read-only views ---------------------------------------------------------------
    def pool_info(self) -> p.PoolInfo:
        return self.views.pool_info()

    def listed(self) -> list[p.TenantInfo]:
        return self.views.listed()

    def check_integrity(self) -> list[str]:
        return self.integrity.check()
