"""Request handling: the daemon's state machine, free of sockets (testable alone).

``Arbiter.handle(identity, request)`` returns an :class:`Outcome`: the reply, the pfns
whose descriptors must go to the tenant's fd channel *before* the reply is sent (for
grants), and whether the tenant's session ends. Unsolicited messages for tenants
(``Reclaim``) are queued in :attr:`Arbiter.outbox` for the server to send.

Every failure is a :class:`Fail` carrying a stable error code; the server turns any
other exception into ``INTERNAL`` and keeps serving.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

from kvpool import protocol as p
from kvpool.daemon.auth import Denied, authorize
from kvpool.daemon.config import Config
from kvpool.daemon.pool import NoMemory, Pool
from kvpool.daemon.regions import Group
from kvpool.daemon.tenants import Tenant, Tenants
from kvpool.sizes import parse_size

log = logging.getLogger("kvpool.daemon")

MAX_PAGES_PER_GRANT = 1 << 16


class Fail(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Outcome:
    reply: p.Reply
    send: list[int] = field(default_factory=list)  # pfns to pass on the fd channel first
    tenant: Tenant | None = None
    end_session: bool = False


class Arbiter:
    def __init__(self, cfg: Config, pool: Pool, budget: int):
        self.cfg = cfg
        self.pool = pool
        self.page_size = pool.page_size
        self.budget = budget
        self.tenants = Tenants()
        self.limits: dict[str, int] = {}  # set_limit overrides, by tenant name (bytes)
        self.outbox: list[tuple[bytes, p.Reply]] = []
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
        }

    # ---- entry point ------------------------------------------------------------------
    def handle(self, identity: bytes, req: p.Request) -> Outcome:
        self.requests += 1
        op = req.__struct_config__.tag
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

    def _fail(self, id: int, code: str, message: str) -> Outcome:
        self.errors += 1
        return Outcome(p.error(id, code, message))

    # ---- sessions ---------------------------------------------------------------------
    def open_session(self, conn, pid: int, uid: int, gid: int, pidfd: int | None) -> Tenant:
        """A new fd-channel connection: a tenant record with a fresh session token."""
        return self.tenants.add(
            token=secrets.token_hex(16), pid=pid, uid=uid, gid=gid, conn=conn, pidfd=pidfd
        )

    def drop(self, t: Tenant, why: str) -> None:
        """The tenant is gone: every page it held returns to the pool (to be zeroed)."""
        pages = 0
        for g in t.groups.values():
            pfns = g.release_all()
            self.pool.give_back(pfns, t.id)
            pages += len(pfns)
        t.groups.clear()
        t.granted = 0
        self.tenants.remove(t)
        log.info("tenant %d (%s, pid %d) dropped: %s; %d pages returned",
                 t.id, t.name or "-", t.pid, why, pages)

    def limit_pages(self, name: str) -> int:
        if name in self.limits:
            nbytes = self.limits[name]
        else:
            policy = self.cfg.policy(name)
            raw = policy.max if policy.max is not None else self.cfg.default_max
            nbytes = parse_size(raw, self.budget)
        return min(nbytes, self.budget) // self.page_size

    # ---- tenant ops -----------------------------------------------------------------
    def register(self, t: Tenant, identity: bytes, r: p.Register) -> p.Reply:
        if r.version != p.VERSION:
            raise Fail(p.VERSION_MISMATCH, f"client speaks protocol {r.version}, daemon {p.VERSION}")
        if t.registered:
            raise Fail(p.BAD_REQUEST, "session already registered")
        if r.device != self.pool.backend.device:
            raise Fail(p.NOT_FOUND, f"device {r.device} is not served (this daemon serves "
                                    f"device {self.pool.backend.device})")
        policy = self.cfg.policy(r.name)
        t.name, t.kind, t.identity, t.registered = r.name, r.kind, identity, True
        t.max_pages = self.limit_pages(r.name)
        t.min_pages = parse_size(policy.min, self.budget) // self.page_size
        t.weight = float(policy.weight)
        log.info("tenant %d registered: %s (%s), pid %d uid %d, limit %d pages",
                 t.id, t.name, t.kind, t.pid, t.uid, t.max_pages)
        return p.Registered(
            id=r.id, tenant=t.id, name=t.name, backend=self.pool.backend.name,
            device=self.pool.backend.device, page_size=self.page_size, budget=self.budget,
            limit=t.max_pages * self.page_size,
        )

    def _group(self, t: Tenant, gid: int) -> Group:
        g = t.groups.get(gid)
        if g is None:
            raise Fail(p.NOT_FOUND, f"no group {gid} in this session")
        return g

    def create_group(self, t: Tenant, identity: bytes, r: p.CreateGroup) -> p.Reply:
        if r.capacity % self.page_size:
            raise Fail(p.BAD_REQUEST, f"capacity {r.capacity} is not a multiple of the page "
                                      f"size {self.page_size}")
        npages = r.capacity // self.page_size
        if npages > p.MAX_PAGES_PER_REGION:
            raise Fail(p.BAD_REQUEST, f"capacity of {npages} pages exceeds {p.MAX_PAGES_PER_REGION}")
        if r.bases and len(r.bases) != r.n_regions:
            raise Fail(p.BAD_REQUEST, f"{len(r.bases)} bases for {r.n_regions} regions")
        if len(t.groups) >= p.MAX_GROUPS:
            raise Fail(p.OVER_LIMIT, f"a session may hold at most {p.MAX_GROUPS} groups")
        g = Group(id=self._next_group, tenant=t.id, n_regions=r.n_regions, npages=npages,
                  bases=list(r.bases), label=r.label)
        self._next_group += 1
        t.groups[g.id] = g
        return p.GroupCreated(id=r.id, group=g.id, npages=npages)

    def destroy_group(self, t: Tenant, identity: bytes, r: p.DestroyGroup) -> p.Reply:
        g = self._group(t, r.group)
        pfns = g.release_all()
        self.pool.give_back(pfns, t.id)
        t.granted -= len(pfns)
        del t.groups[g.id]
        return p.Done(id=r.id)

    def _units(self, g: Group, units: list[int]) -> None:
        if len(set(units)) != len(units):
            raise Fail(p.BAD_REQUEST, "a unit is named twice")
        for u in units:
            if u >= g.npages:
                raise Fail(p.BAD_REQUEST, f"unit {u} is outside the group ({g.npages} pages)")

    def grant(self, t: Tenant, identity: bytes, r: p.Grant) -> Outcome:
        g = self._group(t, r.group)
        self._units(g, r.units)
        held = [u for u in r.units if u in g.units]
        if held:
            raise Fail(p.BAD_REQUEST, f"unit {held[0]} of group {g.id} is already granted")
        n = len(r.units) * g.n_regions
        if n > MAX_PAGES_PER_GRANT:
            raise Fail(p.BAD_REQUEST, f"{n} pages in one grant exceed {MAX_PAGES_PER_GRANT}")
        if t.granted + n > t.max_pages:
            raise Fail(p.OVER_LIMIT, f"{t.name}: {t.granted} + {n} pages would exceed its limit "
                                     f"of {t.max_pages} pages")
        if n > self.pool.available:
            self.on_short(t, n - self.pool.available)
        try:
            pfns = self.pool.take(n, t.id)
        except NoMemory as e:
            raise Fail(p.NO_MEMORY, str(e)) from None
        g.grant(r.units, pfns)
        t.granted += n
        g.report(r.in_use, r.reserve)
        reply = p.Granted(id=r.id, group=g.id, units=r.units, nfds=n)
        return Outcome(reply, send=pfns, tenant=t)

    def on_short(self, t: Tenant, pages: int) -> None:
        """The budget is ``pages`` short for ``t``'s request: the place where reclaim
        (warm pool, other tenants' reserves, tenants above their fair share, never below
        ``min``) will be triggered. Today only the warm pool is spent (``take`` does)."""

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
        g.report(r.in_use, r.reserve)
        return p.Done(id=r.id)

    def report(self, t: Tenant, identity: bytes, r: p.Report) -> p.Reply:
        self._group(t, r.group).report(r.in_use, r.reserve)
        return p.Done(id=r.id)

    def bye(self, t: Tenant, identity: bytes, r: p.Bye) -> Outcome:
        return Outcome(p.Done(id=r.id), tenant=t, end_session=True)

    # ---- monitor and admin ops ----------------------------------------------------------
    def tenant_info(self, t: Tenant) -> p.TenantInfo:
        ps = self.page_size
        return p.TenantInfo(
            id=t.id, name=t.name, kind=t.kind, pid=t.pid, uid=t.uid, registered=t.registered,
            groups=len(t.groups), mapped=t.granted * ps, in_use=t.in_use_bytes(ps),
            reserve=t.reserve_pages * ps, min=t.min_pages * ps, max=t.max_pages * ps,
            weight=t.weight,
        )

    def pool_info(self) -> p.PoolInfo:
        pool, ps = self.pool, self.page_size
        return p.PoolInfo(
            backend=pool.backend.name, device=pool.backend.device, page_size=ps,
            budget=pool.budget_pages * ps, granted=pool.granted * ps, warm=len(pool.warm) * ps,
            dirty=len(pool.dirty) * ps, free=pool.free * ps, created=pool.created,
            warm_min=pool.warm_min * ps, warm_max=pool.warm_max * ps,
        )

    def ps(self, t, identity, r: p.Ps) -> p.Reply:
        return p.PsReply(id=r.id, tenants=[self.tenant_info(x) for x in self.tenants],
                         pool=self.pool_info())

    def stats(self, t, identity, r: p.Stats) -> p.Reply:
        return p.StatsReply(
            id=r.id, pool=self.pool_info(), tenants=[self.tenant_info(x) for x in self.tenants],
            uptime_s=time.monotonic() - self.started, requests=self.requests, errors=self.errors,
        )

    def map(self, t, identity, r: p.MapReq) -> p.Reply:
        tenants = list(self.tenants) if r.tenant is None else self.tenants.find(r.tenant)
        if r.tenant is not None and not tenants:
            raise Fail(p.NOT_FOUND, f"no tenant {r.tenant!r}")
        groups = [
            p.GroupInfo(
                id=g.id, tenant=x.id, tenant_name=x.name, label=g.label, n_regions=g.n_regions,
                npages=g.npages, bases=g.bases, table=g.table(),
                pfns=dict(g.units) if r.pfns else None,
            )
            for x in tenants
            for g in x.groups.values()
        ]
        return p.MapReply(id=r.id, pool=self.pool_info(), groups=groups)

    def set_limit(self, t, identity, r: p.SetLimit) -> p.Reply:
        self.limits[r.tenant] = r.max
        for x in self.tenants.named(r.tenant):
            x.max_pages = self.limit_pages(r.tenant)
            # Above the new limit: a later issue's reclaim asks it to shrink.
        log.info("limit of %s set to %d bytes", r.tenant, r.max)
        return p.Done(id=r.id)

    def check(self, t, identity, r: p.Check) -> p.Reply:
        return p.CheckReply(id=r.id, problems=self.check_integrity())

    # ---- invariants -----------------------------------------------------------------
    def check_integrity(self) -> list[str]:
        """Every page is owned exactly once (warm pool, dirty list, or one region slot of
        its owner), per-tenant and pool totals agree, and the budget holds."""
        problems = self.pool.check()
        seen: dict[int, tuple[int, int, int]] = {}
        total = 0
        for t in self.tenants:
            pages = 0
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
        if set(seen) != set(self.pool.owner):
            orphans = set(self.pool.owner) - set(seen)
            problems.append(f"pfns {sorted(orphans)[:8]} are granted but in no table")
        if total != self.pool.granted:
            problems.append(f"tables hold {total} pages, the pool counts {self.pool.granted}")
        return problems
