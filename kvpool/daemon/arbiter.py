"""Request handling: the daemon's state machine, free of sockets (testable alone).

``Arbiter.handle(identity, request)`` returns an :class:`Outcome`: the reply, the pfns
whose descriptors must go to the tenant's fd channel *before* the reply is sent (for
grants), and whether the tenant's session ends. A grant or lease that must wait for
reclaim returns a *deferred* outcome; :meth:`Arbiter.tick` later returns its real one
(with the envelope to answer). Unsolicited messages for tenants (``Reclaim``) are
queued in :attr:`Arbiter.outbox` for the server to send. Reclaim policy lives in
:mod:`kvpool.daemon.reclaim`, the weighted shares in :mod:`kvpool.daemon.fairshare`.

Every failure is a :class:`Fail` carrying a stable error code; the server turns any
other exception into ``INTERNAL`` and keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from dataclasses import dataclass, field

from kvpool import protocol as p
from kvpool.daemon.auth import Denied, authorize, may_claim, peer_groups
from kvpool.daemon.config import Config
from kvpool.daemon.pool import NoMemory, Pool
from kvpool.daemon.reclaim import Reclaimer, Waiter
from kvpool.daemon.regions import Group
from kvpool.daemon.tenants import NO_MEMORY_KINDS, Tenant, Tenants
from kvpool.sizes import parse_size

log = logging.getLogger("kvpool.daemon")

MAX_PAGES_PER_GRANT = 1 << 16


class Fail(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Outcome:
    reply: p.Reply | None
    send: list[int] = field(default_factory=list)  # pfns to pass on the fd channel first
    tenant: Tenant | None = None
    end_session: bool = False
    deferred: bool = False  # no reply now: tick() answers it later
    envelope: list[bytes] | None = None  # where to answer (deferred outcomes from tick)
    stop: bool = False  # an admin asked the daemon to stop


class Arbiter:
    def __init__(self, cfg: Config, pool: Pool, budget: int):
        self.cfg = cfg
        self.pool = pool
        self.page_size = pool.page_size
        self.budget = budget
        self.tenants = Tenants()
        self.knob_overrides: dict[str, dict] = {}  # set_limit changes, by tenant name
        self.recovering = False
        self.outbox: list[tuple[bytes, p.Reply]] = []
        self.reclaimer = Reclaimer(self, cfg.reclaim_timeout_s)
        self.groups: dict[int, Group] = {}  # every live group, by id (all tenants)
        self.recover_pids: set[int] = set()  # tenants of a previous daemon, not back yet
        self.recover_names: dict[str, int] = {}  # their names -> pids (kept for them)
        self.recover_uids: dict[int, int] = {}  # their pids -> uids (a reused pid is not them)
        self.recover_until = 0.0
        self._envelope: list[bytes] = []
        self.started = time.monotonic()
        self.requests = 0
        self.errors = 0
        self._next_group = 1
        self._handlers = {
            p.Register: self.register,
            p.CreateGroup: self.create_group,
            p.DestroyGroup: self.destroy_group,
            p.Grant: self.grant,
            p.Release: self.release,
            p.Report: self.report,
            p.Bye: self.bye,
            p.Ping: lambda t, i, r: p.Done(id=r.id),
            p.Ps: self.ps,
            p.Stats: self.stats,
            p.MapReq: self.map,
            p.SetLimit: self.set_limit,
            p.Check: self.check,
            p.Lease: self.lease,
            p.Reclaimed: self.reclaimed,
            p.Adopt: self.adopt,
            p.Shutdown: lambda t, i, r: Outcome(p.Done(id=r.id), stop=True),
        }

    # ---- entry point ------------------------------------------------------------------
    def handle(self, identity: bytes, req: p.Request, envelope: list[bytes] | None = None) -> Outcome:
        self.requests += 1
        op = req.__struct_config__.tag
        self._envelope = envelope or [identity]
        try:
            tenant = authorize(op, req.token, identity, self.tenants)
            result = self._handlers[type(req)](tenant, identity, req)
        except Denied as e:
            return self._fail(req.id, p.UNAUTHORIZED, str(e))
        except Fail as e:
            return self._fail(req.id, e.code, str(e))
        if isinstance(result, Outcome):
            return result
        return Outcome(result, tenant=tenant)

    def _cap(self, name: str, default: int) -> int:
        """A resource cap from the config (``default`` where the config predates it)."""
        return int(getattr(self.cfg, name, default))

    @staticmethod
    def _holder(t: Tenant, op: str) -> None:
        """Only memory-holding kinds hold memory: a monitor or admin session never does
        (so nothing it could hold escapes ``ps``, reclaim or the budget's accounting)."""
        if t.kind in NO_MEMORY_KINDS:
            raise Fail(p.UNAUTHORIZED, f"a {t.kind} session holds no memory ({op} refused)")

    def _fail(self, id: int, code: str, message: str) -> Outcome:
        self.errors += 1
        return Outcome(p.error(id, code, message))

    # ---- sessions ---------------------------------------------------------------------
    def open_session(self, conn, pid: int, uid: int, gid: int, pidfd: int | None) -> Tenant:
        """A new fd-channel connection: a tenant record with a fresh session token.
        Raises :class:`Fail` (``OVER_LIMIT``) past the per-uid or the global session cap
        (the server tells the peer why in its hello, then hangs up)."""
        per_uid = self._cap("max_sessions_per_uid", 64)
        if self.tenants.count_uid(uid) >= per_uid:
            raise Fail(p.OVER_LIMIT, f"uid {uid} has {per_uid} sessions open already "
                                     f"(max_sessions_per_uid)")
        total = self._cap("max_sessions", 1024)
        if len(self.tenants) >= total:
            raise Fail(p.OVER_LIMIT, f"the daemon serves {total} sessions already "
                                     f"(max_sessions)")
        return self.tenants.add(
            token=secrets.token_hex(16), pid=pid, uid=uid, gid=gid, conn=conn, pidfd=pidfd,
            peer_gids=peer_groups(pid, gid) if pid > 0 else {gid},
        )

    def drop(self, t: Tenant, why: str) -> None:
        """The tenant is gone: every page it held returns to the pool (to be zeroed)."""
        pages = 0
        for g in t.groups.values():
            pfns = g.release_all()
            self.pool.give_back(pfns, t.id)
            pages += len(pfns)
            self.groups.pop(g.id, None)
        t.groups.clear()
        t.granted = 0
        self.pool.unlease(t.lease_pages)
        t.lease_pages = 0
        t.ask = None
        self.reclaimer.forget(t)
        if t.arbitrated:  # a returning tenant's session ended: stop waiting for its pid
            self.recover_pids.discard(t.pid)  # (a monitor of that pid says nothing)
        self.tenants.remove(t)
        log.info("tenant %d (%s, pid %d) dropped: %s; %d pages returned",
                 t.id, t.name or "-", t.pid, why, pages)

    def knobs(self, name: str, asked: p.Register | None = None) -> tuple[int, int, float]:
        """``(min, max, weight)`` in pages for tenant ``name``: a live admin change wins,
        then the daemon config's ``[tenants.NAME]``, then what the tenant asked for at
        registration, then the defaults."""
        live = self.knob_overrides.get(name, {})
        configured = name in self.cfg.tenants
        policy = self.cfg.policy(name)

        def pick(key, conf, default):
            if key in live:
                return live[key]
            if configured and conf is not None:
                return conf
            if asked is not None and getattr(asked, key) is not None:
                return getattr(asked, key)
            return conf if conf is not None else default

        mx = pick("max", policy.max, self.cfg.default_max)
        mn = pick("min", policy.min if configured else None, 0)
        w = pick("weight", policy.weight if configured else None, 1.0)
        ps = self.page_size
        return (parse_size(mn, self.budget) // ps,
                min(parse_size(mx, self.budget), self.budget) // ps, float(w))

    def limit_pages(self, name: str) -> int:
        return self.knobs(name)[1]

    # ---- the arbitration step -------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[Outcome]:
        """Serve waiting requests whose pages are free, fail the late ones, and send the
        reclaim asks still needed. Returns outcomes to emit (each with its envelope)."""
        now = time.monotonic() if now is None else now
        if self.recovering and (now >= self.recover_until or not self.recover_pids):
            self.recovering = False
            log.info("recovery done: %d tenants, %d pages adopted", len(self.tenants),
                     self.pool.granted)
        if self.recovering:
            return []
        out = []
        for w, err in self.reclaimer.step(now):
            o = Outcome(err, tenant=w.tenant) if err is not None else self._serve(w)
            if err is not None:
                self.errors += 1
            o.envelope = w.envelope
            out.append(o)
        return out

    def next_deadline(self) -> float | None:
        d = self.reclaimer.next_deadline()
        if self.recovering:
            d = min(d, self.recover_until) if d is not None else self.recover_until
        return d

    def _serve(self, w: Waiter) -> Outcome:
        t, r = w.tenant, w.req
        if isinstance(r, p.Lease):
            return Outcome(self._lease_now(t, r, w.pages), tenant=t)
        return self._grant_now(t, t.groups[r.group], r)

    def log_ignored(self, t: Tenant, ask) -> None:
        log.warning("tenant %d (%s) ignored reclaim %d (%s, %d pages still held above the "
                    "ask); capped at its min until it answers", t.id, t.name, ask.seq,
                    ask.reason, ask.pages)

    # ---- tenant ops -----------------------------------------------------------------
    def register(self, t: Tenant, identity: bytes, r: p.Register) -> p.Reply:
        if r.version != p.VERSION:
            raise Fail(p.VERSION_MISMATCH, f"client speaks protocol {r.version}, daemon {p.VERSION}")
        if t.registered:
            raise Fail(p.BAD_REQUEST, "session already registered")
        if r.device != self.pool.backend.device and r.kind not in NO_MEMORY_KINDS:
            raise Fail(p.NOT_FOUND, f"device {r.device} is not served (this daemon serves "
                                    f"device {self.pool.backend.device})")
        if r.kind not in NO_MEMORY_KINDS:
            self._claim(t, r.name)
        mn, mx, weight = self.knobs(r.name, r)
        if r.kind in NO_MEMORY_KINDS:
            mn = mx = 0  # holds nothing: no knobs, no claim on a name's policy
        else:
            floors = sum(x.min_pages for x in self.tenants if x.arbitrated)
            if mn and floors + mn > self.budget // self.page_size:
                raise Fail(p.OVER_LIMIT, f"min of {mn} pages would make the guaranteed "
                                         f"minimums ({floors} pages) exceed the budget")
        t.name, t.kind, t.identity, t.registered = r.name, r.kind, identity, True
        t.min_pages, t.max_pages, t.weight = mn, mx, weight
        log.info("tenant %d registered: %s (%s), pid %d uid %d, limit %d pages",
                 t.id, t.name, t.kind, t.pid, t.uid, t.max_pages)
        return p.Registered(
            id=r.id, tenant=t.id, name=t.name, backend=self.pool.backend.name,
            device=self.pool.backend.device, page_size=self.page_size, budget=self.budget,
            limit=t.max_pages * self.page_size,
        )

    def _claim(self, t: Tenant, name: str) -> None:
        """May ``t`` register as ``name``: the config's ``uids``/``group`` of that name
        admit its peer, and no other live memory-holding session holds the name."""
        if name in self.cfg.tenants:
            why = may_claim(name, self.cfg.tenants[name], t.uid, t.peer_gids or {t.gid})
            if why:
                raise Fail(p.UNAUTHORIZED, why)
        owner = self.recover_names.get(name)
        if self.recovering and owner in self.recover_pids and (
                owner != t.pid or self.recover_uids.get(owner, t.uid) != t.uid):
            raise Fail(p.UNAUTHORIZED, f"tenant name {name!r} is kept for pid {owner}, a "
                                       f"tenant of the previous daemon, until it returns")
        holders = [x for x in self.tenants.named(name) if x is not t]
        if holders:
            h = holders[0]
            raise Fail(p.UNAUTHORIZED, f"tenant name {name!r} is held by tenant {h.id} "
                                       f"(pid {h.pid}); choose another name")

    def _group(self, t: Tenant, gid: int) -> Group:
        g = t.groups.get(gid)
        if g is None:
            if gid in self.groups:
                raise Fail(p.UNAUTHORIZED, f"group {gid} belongs to another tenant")
            raise Fail(p.NOT_FOUND, f"no group {gid} in this session")
        return g

    def create_group(self, t: Tenant, identity: bytes, r: p.CreateGroup) -> p.Reply:
        self._holder(t, "create_group")
        if r.capacity % self.page_size:
            raise Fail(p.BAD_REQUEST, f"capacity {r.capacity} is not a multiple of the page "
                                      f"size {self.page_size}")
        npages = r.capacity // self.page_size
        if npages > p.MAX_PAGES_PER_REGION:
            raise Fail(p.BAD_REQUEST, f"capacity of {npages} pages exceeds {p.MAX_PAGES_PER_REGION}")
        if r.bases and len(r.bases) != r.n_regions:
            raise Fail(p.BAD_REQUEST, f"{len(r.bases)} bases for {r.n_regions} regions")
        most = min(p.MAX_GROUPS, self._cap("max_groups_per_tenant", 64))
        if len(t.groups) >= most:
            raise Fail(p.OVER_LIMIT, f"a tenant may hold at most {most} groups "
                                     f"(max_groups_per_tenant)")
        virtual = sum(g.virtual_pages for g in t.groups.values())
        cap = self._cap("max_virtual_pages_per_tenant", 1 << 20)
        if virtual + npages * r.n_regions > cap:
            raise Fail(p.OVER_LIMIT, f"{r.n_regions} x {npages} virtual pages on top of the "
                                     f"{virtual} this tenant's groups span exceed "
                                     f"{cap} (max_virtual_pages_per_tenant)")
        g = Group(id=self._new_group_id(), tenant=t.id, n_regions=r.n_regions, npages=npages,
                  bases=list(r.bases), label=r.label)
        t.groups[g.id] = g
        self.groups[g.id] = g
        return p.GroupCreated(id=r.id, group=g.id, npages=npages)

    def _new_group_id(self) -> int:
        """The next free group id, in ``1..MAX_GROUP_ID`` (wrapping around, skipping live
        ones): ids never grow past what clients, the wire and ``state.json`` carry."""
        gid = self._next_group
        for _ in range(len(self.groups) + 2):
            if not 1 <= gid <= p.MAX_GROUP_ID:
                gid = 1
            if gid not in self.groups:
                break
            gid += 1
        self._next_group = gid + 1
        return gid

    def destroy_group(self, t: Tenant, identity: bytes, r: p.DestroyGroup) -> p.Reply:
        g = self._group(t, r.group)
        pfns = g.release_all()
        self.pool.give_back(pfns, t.id)
        t.granted -= len(pfns)
        self.reclaimer.released(t, len(pfns))
        del t.groups[g.id]
        self.groups.pop(g.id, None)
        return p.Done(id=r.id)

    def _units(self, g: Group, units: list[int]) -> None:
        if len(set(units)) != len(units):
            raise Fail(p.BAD_REQUEST, "a unit is named twice")
        for u in units:
            if u >= g.npages:
                raise Fail(p.BAD_REQUEST, f"unit {u} is outside the group ({g.npages} pages)")

    def grant(self, t: Tenant, identity: bytes, r: p.Grant) -> Outcome:
        self._holder(t, "grant")
        g = self._group(t, r.group)
        self._units(g, r.units)
        held = [u for u in r.units if u in g.units]
        if held:
            raise Fail(p.BAD_REQUEST, f"unit {held[0]} of group {g.id} is already granted")
        n = len(r.units) * g.n_regions
        if n > MAX_PAGES_PER_GRANT:
            raise Fail(p.BAD_REQUEST, f"{n} pages in one grant exceed {MAX_PAGES_PER_GRANT}")
        if any(set(w.req.units) & set(r.units) for w in self.reclaimer.waiters
               if w.tenant is t and isinstance(w.req, p.Grant) and w.req.group == g.id):
            raise Fail(p.BAD_REQUEST, f"a unit of group {g.id} is already being granted")
        self._admit(t, n, r.speculative)
        if not self._fits(t, n, r.speculative):
            return self._defer(t, r, n)
        return self._grant_now(t, g, r)

    def _admit(self, t: Tenant, n: int, speculative: bool) -> None:
        """Refuse what can never be granted now: past the limit, or during recovery."""
        if self.recovering:
            raise Fail(p.BUSY, "the daemon is rebuilding its accounting after a restart")
        kept = self.pool.retained_pages(t.id)  # released pages it still references
        if t.held + kept + t.waiting_pages + n > t.cap_pages:
            why = " (capped at its min: it ignored a reclaim)" if t.unresponsive else ""
            why += f" ({kept} released pages it still references count)" if kept else ""
            raise Fail(p.OVER_LIMIT, f"{t.name}: {t.held} + {n} pages would exceed its limit "
                                     f"of {t.cap_pages} pages{why}")

    def _fits(self, t: Tenant, n: int, speculative: bool) -> bool:
        """Whether ``n`` pages for ``t`` are served now rather than queued. They are when
        free memory covers them beyond what waiters are owed; and also when free memory
        covers them and ``t`` stays within its fair share: a request that fits is never
        queued behind one that does not (the waiter's pages then come from reclaim,
        which asks for what is missing at the next step). Speculative grants never take
        pages a waiter could use."""
        avail = self.pool.available
        if n <= avail - self.reclaimer.waiting_pages:
            return True
        if speculative or n > avail or not self.reclaimer.waiters or t.ask is not None:
            return False
        return self.reclaimer.may_grow(t, n)  # its fair share (for a lease too)

    def _defer(self, t: Tenant, r: p.Request, n: int) -> Outcome:
        """Not enough free memory: wait for reclaim, when ``t`` is entitled to it."""
        speculative = getattr(r, "speculative", False)
        if speculative or t.ask is not None or \
                not self.reclaimer.may_grow(t, n, lease=isinstance(r, p.Lease)):
            why = ("speculative grants use free memory only" if speculative else
                   f"{t.name} is being asked to give memory back" if t.ask is not None else
                   f"{t.name} is at its fair share")
            raise Fail(p.NO_MEMORY, f"{n} pages asked, {self.pool.available} available; {why}")
        self.reclaimer.wait(t, self._envelope, r, n, time.monotonic())
        return Outcome(None, tenant=t, deferred=True)

    def _grant_now(self, t: Tenant, g: Group, r: p.Grant) -> Outcome:
        n = len(r.units) * g.n_regions
        try:
            pfns = self.pool.take(n, t.id)
        except NoMemory as e:
            self.errors += 1
            return Outcome(p.error(r.id, p.NO_MEMORY, str(e)), tenant=t)
        g.grant(r.units, pfns)
        t.granted += n
        g.report(r.in_use, r.reserve)
        reply = p.Granted(id=r.id, group=g.id, units=r.units, nfds=n)
        return Outcome(reply, send=pfns, tenant=t)

    # ---- leases, reclaim answers, adoption ---------------------------------------------------
    def lease(self, t: Tenant, identity: bytes, r: p.Lease) -> p.Reply | Outcome:
        self._holder(t, "lease")
        pages = -(-r.bytes // self.page_size)
        if pages <= t.lease_pages:
            self.pool.unlease(t.lease_pages - pages)
            t.lease_pages = pages
            return p.Leased(id=r.id, bytes=pages * self.page_size)
        n = pages - t.lease_pages
        if any(w.tenant is t for w in self.reclaimer.waiters):
            raise Fail(p.BUSY, "a request of this tenant is already waiting")
        self._admit(t, n, False)
        if not self._fits(t, n, False):
            return self._defer(t, r, n)
        return self._lease_now(t, r, n)

    def _lease_now(self, t: Tenant, r: p.Lease, n: int) -> p.Reply:
        try:
            self.pool.lease(n)
        except NoMemory as e:
            self.errors += 1
            return p.error(r.id, p.NO_MEMORY, str(e))
        if self.pool.backend.name != "host":  # the device's real free memory decides too
            free, _ = self.pool.backend.mem_info()
            if free < n * self.page_size:
                self.pool.unlease(n)
                self.errors += 1
                return p.error(r.id, p.NO_MEMORY, f"the device has {free} bytes free, "
                                                  f"{n * self.page_size} leased")
        t.lease_pages += n
        return p.Leased(id=r.id, bytes=t.lease_pages * self.page_size)

    def reclaimed(self, t: Tenant, identity: bytes, r: p.Reclaimed) -> p.Reply:
        self.reclaimer.answered(t, r.seq, time.monotonic())
        return p.Done(id=r.id)

    def adopt(self, t: Tenant, identity: bytes, r: p.Adopt) -> p.Reply:
        """A tenant of the previous daemon reports what it still maps, with the pages'
        descriptors (``t.inbox``, read by the server). Recovery only, all or nothing:
        every descriptor it came with is closed whatever the outcome (the pool keeps
        its own reference to the pages it adopts)."""
        fds, t.inbox = t.inbox, []
        try:
            return self._adopt(t, r, fds)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _may_adopt(self, t: Tenant, r: p.Adopt) -> None:
        """Who may adopt: a memory-holding session of a pid the previous daemon recorded,
        once, while this daemon is recovering. An empty Adopt (nothing to report) is
        always accepted: it changes nothing."""
        self._holder(t, "adopt")
        if not r.groups and not r.lease and not r.nfds:
            return
        if not self.recovering:
            raise Fail(p.UNAUTHORIZED, "adopt is accepted only while the daemon recovers "
                                       "after a restart")
        if t.pid not in self.recover_pids or self.recover_uids.get(t.pid, t.uid) != t.uid:
            raise Fail(p.UNAUTHORIZED, f"pid {t.pid} (uid {t.uid}) was not a tenant of the "
                                       f"previous daemon (or has adopted already)")
        if t.groups or t.lease_pages:
            raise Fail(p.BAD_REQUEST, "adopt must come right after register")

    def _check_adopt(self, t: Tenant, r: p.Adopt, nfds: int) -> int:
        """Validate an Adopt against the state before any effect; returns its pages."""
        total = sum(len(g.units) * g.n_regions for g in r.groups)
        if total != r.nfds or nfds != total:
            raise Fail(p.BAD_REQUEST, f"adopt names {total} pages, says {r.nfds}, "
                                      f"sent {nfds} descriptors")
        ids = [g.id for g in r.groups]
        # ids the previous daemon can have handed out: below the next id it recorded
        top = min(self._next_group, p.MAX_GROUP_ID + 1)
        if any(i >= top for i in ids):
            raise Fail(p.BAD_REQUEST, f"adopt: group ids must be below {top} (ids the "
                                      f"previous daemon handed out)")
        if len(set(ids)) != len(ids) or any(i in self.groups for i in ids):
            raise Fail(p.BAD_REQUEST, "adopt reuses a group id that is taken")
        if len(r.groups) > self._cap("max_groups_per_tenant", 64):
            raise Fail(p.BAD_REQUEST, f"adopt: {len(r.groups)} groups exceed the per-tenant cap")
        virtual = 0
        for a in r.groups:
            npages = a.capacity // self.page_size
            if a.capacity % self.page_size or npages > p.MAX_PAGES_PER_REGION:
                raise Fail(p.BAD_REQUEST, f"adopt: group {a.id} capacity is not a valid "
                                          f"multiple of the page size")
            if len(set(a.units)) != len(a.units):
                raise Fail(p.BAD_REQUEST, f"adopt: group {a.id} names a unit twice")
            if any(u >= npages for u in a.units):
                raise Fail(p.BAD_REQUEST, f"adopt: group {a.id} does not fit its capacity")
            virtual += npages * a.n_regions
        if virtual > self._cap("max_virtual_pages_per_tenant", 1 << 20):
            raise Fail(p.BAD_REQUEST, f"adopt: {virtual} virtual pages exceed the per-tenant cap")
        lease = -(-r.lease // self.page_size)
        held = self.pool.granted + self.pool.leased + self.pool.retained_pages()
        if total + lease + held > self.pool.budget_pages:
            raise Fail(p.BAD_REQUEST, f"adopt: {total} pages and a lease of {lease} pages do "
                                      f"not fit the budget ({self.pool.budget_pages} pages, "
                                      f"{held} held)")
        if total + lease > t.max_pages:
            raise Fail(p.BAD_REQUEST, f"adopt: {total + lease} pages exceed {t.name}'s limit "
                                      f"of {t.max_pages} pages")
        return total

    def _adopt(self, t: Tenant, r: p.Adopt, fds: list[int]) -> p.Reply:
        self._may_adopt(t, r)
        if not r.groups and not r.lease and not r.nfds:
            if not fds:
                self.recover_pids.discard(t.pid)
                return p.Adopted(id=r.id, groups=[], pages=0)
        self._check_adopt(t, r, len(fds))
        known = self.pool.page_keys()
        pages, keys = [], set()
        try:
            for fd in fds:
                key = self.pool.page_key_of_fd(fd)
                if key is not None and (key in known or key in keys):
                    raise Fail(p.UNAUTHORIZED, "adopt names a page that is granted already")
                if key is not None:
                    keys.add(key)
                pages.append(self.pool.backend.import_(fd))
        except Fail:
            for page in pages:
                self.pool.backend.release(page)
            raise
        except Exception as e:
            for page in pages:
                self.pool.backend.release(page)
            raise Fail(p.BAD_REQUEST, f"adopt: a descriptor is not a page: {e}") from None
        i = 0
        for a in r.groups:
            g = Group(id=a.id, tenant=t.id, n_regions=a.n_regions,
                      npages=a.capacity // self.page_size, bases=list(a.bases), label=a.label)
            for u in a.units:
                pfns = [self.pool.adopt(pages[i + k], t.id) for k in range(a.n_regions)]
                i += a.n_regions
                g.units[u] = pfns
            g.report(a.in_use, a.reserve)
            t.groups[g.id] = g
            self.groups[g.id] = g
            t.granted += g.pages
        lease = -(-r.lease // self.page_size)
        self.pool.leased += lease
        t.lease_pages = lease
        self.recover_pids.discard(t.pid)
        log.info("tenant %d (%s, pid %d) adopted: %d groups, %d pages, lease %d pages",
                 t.id, t.name, t.pid, len(r.groups), t.granted, lease)
        return p.Adopted(id=r.id, groups=[g.id for g in r.groups], pages=t.granted)

    def unsolicited(self, t: Tenant, msg: p.Reply) -> None:
        """Queue a message for ``t`` (sent by the server on the ROUTER to its identity)."""
        if t.identity is not None:
            self.outbox.append((t.identity, msg))

    def release(self, t: Tenant, identity: bytes, r: p.Release) -> p.Reply:
        g = self._group(t, r.group)
        self._units(g, r.units)
        missing = [u for u in r.units if u not in g.units]
        if missing:
            raise Fail(p.BAD_REQUEST, f"unit {missing[0]} of group {g.id} is not granted")
        pfns = g.release(r.units)
        self.pool.give_back(pfns, t.id)
        t.granted -= len(pfns)
        self.reclaimer.released(t, len(pfns))
        g.report(r.in_use, r.reserve)
        return p.Done(id=r.id)

    def report(self, t: Tenant, identity: bytes, r: p.Report) -> p.Reply:
        self._group(t, r.group).report(r.in_use, r.reserve)
        return p.Done(id=r.id)

    def bye(self, t: Tenant, identity: bytes, r: p.Bye) -> Outcome:
        return Outcome(p.Done(id=r.id), tenant=t, end_session=True)

    # ---- monitor and admin ops ----------------------------------------------------------
    def tenant_info(self, t: Tenant, shares: dict[int, int] | None = None) -> p.TenantInfo:
        ps = self.page_size
        share = (shares or {}).get(t.id, 0)
        return p.TenantInfo(
            id=t.id, name=t.name, kind=t.kind, pid=t.pid, uid=t.uid, registered=t.registered,
            groups=len(t.groups), mapped=t.granted * ps, in_use=t.in_use_bytes(ps),
            reserve=t.reserve_pages * ps, min=t.min_pages * ps, max=t.max_pages * ps,
            weight=t.weight, lease=t.lease_pages * ps, share=share,
            asked=max(0, t.ask.pages) * ps if t.ask is not None else 0,  # type: ignore[attr-defined]
            ignored=t.ignored, unresponsive=t.unresponsive, waiting=t.waiting_pages * ps,
            retained=self.pool.retained_pages(t.id) * ps,
        )

    def pool_info(self) -> p.PoolInfo:
        pool, ps = self.pool, self.page_size
        return p.PoolInfo(
            backend=pool.backend.name, device=pool.backend.device, page_size=ps,
            budget=pool.budget_pages * ps, granted=pool.granted * ps, warm=len(pool.warm) * ps,
            dirty=len(pool.dirty) * ps, free=pool.free * ps, created=pool.created,
            warm_min=pool.warm_min * ps, warm_max=pool.warm_max * ps,
            leased=pool.leased * ps, waiting=self.reclaimer.waiting_pages * ps,
            recovering=self.recovering,
            retained=pool.retained_pages() * ps, renewed=pool.renewed,
        )

    def listed(self) -> list[p.TenantInfo]:
        """Tenants for ``ps``/``stats``: every session but monitor and admin ones, and
        every session that holds anything whatever its kind (none should)."""
        shares = self.reclaimer.shares()
        return [self.tenant_info(x, shares) for x in self.tenants
                if x.kind not in NO_MEMORY_KINDS or x.held or x.groups]

    def ps(self, t, identity, r: p.Ps) -> p.Reply:
        return p.PsReply(id=r.id, tenants=self.listed(), pool=self.pool_info())

    def stats(self, t, identity, r: p.Stats) -> p.Reply:
        return p.StatsReply(
            id=r.id, pool=self.pool_info(), tenants=self.listed(),
            uptime_s=time.monotonic() - self.started, requests=self.requests, errors=self.errors,
        )

    def map(self, t, identity, r: p.MapReq) -> p.Reply:
        """Groups in id order after ``r.after``, page tables run-length encoded (a reply's
        size follows the pages mapped, not the virtual size), cut at about
        :data:`p.MAP_REPLY_BYTES` with ``next`` saying where to go on."""
        tenants = list(self.tenants) if r.tenant is None else self.tenants.find(r.tenant)
        if r.tenant is not None and not tenants:
            raise Fail(p.NOT_FOUND, f"no tenant {r.tenant!r}")
        names = {x.id: x.name for x in tenants}
        ids = sorted(g.id for x in tenants for g in x.groups.values() if g.id > r.after)
        groups: list[p.GroupInfo] = []
        size = 0
        for n, gid in enumerate(ids):
            g = self.groups[gid]
            runs = [p.Run(a, b, c) for a, b, c in g.runs()]
            cost = 128 + 10 * (len(runs) + min(len(g.bases), p.MAP_BASES))
            if r.pfns:
                cost += 10 * g.pages + 10 * len(g.units)
            if groups and (size + cost > p.MAP_REPLY_BYTES or len(groups) >= r.limit):
                return p.MapReply(id=r.id, pool=self.pool_info(), groups=groups,
                                  next=groups[-1].id, truncated=len(ids) - n)
            size += cost
            groups.append(p.GroupInfo(
                id=g.id, tenant=g.tenant, tenant_name=names.get(g.tenant, ""), label=g.label,
                n_regions=g.n_regions, npages=g.npages, bases=g.bases[: p.MAP_BASES],
                runs=runs, pfns=dict(g.units) if r.pfns else None,
            ))
        return p.MapReply(id=r.id, pool=self.pool_info(), groups=groups)

    def set_limit(self, t, identity, r: p.SetLimit) -> p.Reply:
        change = {k: getattr(r, k) for k in ("min", "max", "weight") if getattr(r, k) is not None}
        named = self.tenants.named(r.tenant)
        if "min" in change:
            floors = sum(x.min_pages for x in self.tenants if x.arbitrated and x.name != r.tenant)
            if floors + len(named) * (change["min"] // self.page_size) > self.budget // self.page_size:
                raise Fail(p.OVER_LIMIT, "the guaranteed minimums would exceed the budget")
        self.knob_overrides.setdefault(r.tenant, {}).update(change)
        for x in named:
            x.min_pages, x.max_pages, x.weight = self.knobs(r.tenant)
        log.info("knobs of %s set: %s", r.tenant, change)
        # the server's tick() right after this reply asks tenants above the limit to shrink
        pending = sum(max(0, x.granted - max(0, x.max_pages - x.lease_pages)) for x in named)
        return p.LimitSet(id=r.id, tenant=r.tenant, tenants=len(named), applied=pending == 0,
                          pending=pending * self.page_size)

    def check(self, t, identity, r: p.Check) -> p.Reply:
        return p.CheckReply(id=r.id, problems=self.check_integrity())

    # ---- invariants -----------------------------------------------------------------
    def _check_groups(self) -> list[str]:
        """The group index is exactly the tenants' groups; ids stay in range; no tenant
        is past its caps on groups and virtual pages."""
        problems = []
        owned = {g.id: g for t in self.tenants for g in t.groups.values()}
        if owned.keys() != self.groups.keys() or any(self.groups[i] is not g
                                                     for i, g in owned.items()):
            extra = sorted(set(self.groups) ^ set(owned))[:8]
            problems.append(f"the group index and the tenants' groups differ (ids {extra})")
        bad = sorted(i for i in self.groups if not 1 <= i <= p.MAX_GROUP_ID)[:8]
        if bad:
            problems.append(f"group ids {bad} are outside 1..{p.MAX_GROUP_ID}")
        most = self._cap("max_groups_per_tenant", 64)
        vmost = self._cap("max_virtual_pages_per_tenant", 1 << 20)
        for t in self.tenants:
            virtual = sum(g.virtual_pages for g in t.groups.values())
            if len(t.groups) > most or virtual > vmost:
                problems.append(f"tenant {t.id} holds {len(t.groups)} groups spanning "
                                f"{virtual} virtual pages, past its caps ({most}, {vmost})")
        return problems

    def check_integrity(self) -> list[str]:
        """Every page is owned exactly once (warm pool, dirty list, or one region slot of
        its owner), per-tenant and pool totals agree, and the budget holds."""
        problems = self.pool.check()
        seen: dict[int, tuple[int, int, int]] = {}
        total = 0
        for t in self.tenants:
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
                        if self.pool.owner.get(pfn) != t.id:
                            problems.append(f"pfn {pfn} in tenant {t.id}'s table is owned by "
                                            f"{self.pool.owner.get(pfn)} in the pool")
                    pages += len(pfns)
                if not g.reserve <= g.units.keys():
                    problems.append(f"group {g.id} reports reserve units it does not hold")
            if pages != t.granted:
                problems.append(f"tenant {t.id} counts {t.granted} pages, its tables hold {pages}")
            total += pages
        problems += self._check_groups()
        if sum(t.lease_pages for t in self.tenants) != self.pool.leased:
            problems.append(f"tenants lease {sum(t.lease_pages for t in self.tenants)} pages, "
                            f"the pool counts {self.pool.leased}")
        if set(seen) != set(self.pool.owner):
            orphans = set(self.pool.owner) - set(seen)
            problems.append(f"pfns {sorted(orphans)[:8]} are granted but in no table")
        if total != self.pool.granted:
            problems.append(f"tables hold {total} pages, the pool counts {self.pool.granted}")
        return problems
