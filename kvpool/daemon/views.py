"""Read-only views of the arbiter's state: ``ps``, ``stats``, ``map`` and ``check``.

Nothing here changes state. Replies stay bounded: ``ps``/``stats`` list tenants (never
pages), ``map`` run-length encodes page tables and pages its reply at about
:data:`p.MAP_REPLY_BYTES`. Monitor and admin sessions are left out of listings unless
they hold something (none should: ``check`` says so).

Who sees what (:func:`sees_all`): an admin identity (root, the daemon's uid, the admin
group) and a tenant's own uid see everything; for another uid's tenants a session
sees names, sizes and states only: no pid and no endpoint in ``ps``/``stats``, and no
region bases, pfns or label in ``map`` (``pid`` 0, ``endpoint`` "", ``bases`` [],
``pfns`` None, ``label`` "").
"""

from __future__ import annotations

from kvpool import protocol as p
from kvpool.daemon.counters import Counters
from kvpool.daemon.integrity import Integrity
from kvpool.daemon.outcome import Fail, Sender
from kvpool.daemon.pool import Pool
from kvpool.daemon.reclaim import Reclaimer
from kvpool.daemon.regions import GroupIndex
from kvpool.daemon.restart import Recovery
from kvpool.daemon.sleepers import SleepBook
from kvpool.daemon.tenants import NO_MEMORY_KINDS, TenantRecord, Tenants
from kvpool.daemon.weights import WeightSets


def sees_all(asker: TenantRecord | None, owner_uid: int) -> bool:
    """Whether ``asker`` may see the pids, endpoints and addresses of a tenant of uid
    ``owner_uid``: an admin, or the same uid."""
    return asker is not None and (asker.admin or asker.uid == owner_uid)


class Views:
    """Views of ``pool``, ``tenants`` and their groups (``groups``), with the fair shares and
    waiting pages of ``reclaimer``, whether ``recovery`` is active, the request
    ``counters``, ``integrity``'s self-check, the ``weights`` sets and the tenants'
    ``sleep`` states."""

    def __init__(self, pool: Pool, tenants: Tenants, groups: GroupIndex,
                 reclaimer: Reclaimer, recovery: Recovery, counters: Counters,
                 integrity: Integrity, weights: WeightSets, sleep: SleepBook):
        self.pool = pool
        self.page_size = pool.page_size
        self.tenants = tenants
        self.groups = groups
        self.reclaimer = reclaimer
        self.recovery = recovery
        self.counters = counters
        self.integrity = integrity
        self.weights = weights
        self.sleep = sleep

    def tenant_info(self, t: TenantRecord, fair: dict[int, int] | None = None) -> p.TenantInfo:
        ps = self.page_size
        fair_share = (fair or {}).get(t.id, 0)
        rest = self.sleep.record(t)
        return p.TenantInfo(
            id=t.id, name=t.name, kind=t.kind, pid=t.pid, uid=t.uid, registered=t.registered,
            groups=len(t.groups), mapped=t.granted * ps, in_use=t.in_use_bytes(ps),
            reserve=t.reserve_pages * ps, min=t.min_pages * ps, max=t.max_pages * ps,
            shares=t.shares, lease=t.lease_pages * ps, fair_share=fair_share,
            asked=max(0, t.ask.pages) * ps if t.ask is not None else 0,
            ignored=t.ignored, unresponsive=t.unresponsive, waiting=t.waiting_pages * ps,
            retained=self.pool.retained_pages(t.id) * ps, endpoint=t.endpoint,
            weights=t.weight_pages * ps, weight_sets=self.weights.keys_of(t),
            state=rest.state, sleepable=rest.sleepable, group=t.group, device=t.device,
            gang=t.gang, rank=t.rank,
            chunk=max((g.chunk_units * g.n_regions * ps for g in t.groups.values()), default=0),
        )

    def pool_info(self) -> p.PoolInfo:
        pool, ps = self.pool, self.page_size
        return p.PoolInfo(
            backend=pool.backend.name, device=pool.backend.device, page_size=ps,
            budget=pool.budget_pages * ps, granted=pool.granted * ps, warm=len(pool.warm) * ps,
            dirty=len(pool.dirty) * ps, free=pool.free * ps, created=pool.created,
            warm_min=pool.warm_min * ps, warm_max=pool.warm_max * ps,
            leased=pool.leased * ps, waiting=self.reclaimer.waiting_pages * ps,
            recovering=self.recovery.active,
            retained=pool.retained_pages() * ps, renewed=pool.renewed,
            weights=self.weights.pages * ps, weights_cached=self.weights.cached_pages * ps,
            weight_sets=len(self.weights.sets),
            weights_across_uids=self.weights.shared_across_uids,
        )

    def listed(self, asker: TenantRecord | None = None) -> list[p.TenantInfo]:
        """Tenants for ``ps``/``stats``: every session but monitor and admin ones, and
        every session that holds anything whatever its kind (none should). With
        ``asker``, other uids' tenants lose what only their uid and admins may see
        (:func:`sees_all`); without, everything (the daemon's own observers)."""
        fair = self.reclaimer.fair_shares()
        out = []
        for x in self.tenants:
            if x.kind in NO_MEMORY_KINDS and not x.held and not x.groups \
                    and not x.weight_pages:
                continue
            info = self.tenant_info(x, fair)
            if asker is not None and not sees_all(asker, x.uid):
                info.pid, info.endpoint = 0, ""
            out.append(info)
        return out

    def ps(self, t: TenantRecord, sender: Sender, r: p.Ps) -> p.Reply:
        ps = self.page_size
        uids = {x.id: x.uid for x in self.tenants}
        by_uid = {u: n * ps for u, n in self.pool.retained_by_uid(uids).items()}
        return p.PsReply(id=r.id, tenants=self.listed(t), pool=self.pool_info(),
                         retained_by_uid=by_uid)

    def stats(self, t: TenantRecord, sender: Sender, r: p.Stats) -> p.Reply:
        n = self.counters
        return p.StatsReply(
            id=r.id, pool=self.pool_info(), tenants=self.listed(t),
            uptime_s=n.uptime_s, requests=n.requests, errors=n.errors,
        )

    def map(self, t: TenantRecord, sender: Sender, r: p.MapReq) -> p.Reply:
        """Groups in id order after ``r.after``, page tables run-length encoded (a reply's
        size follows the pages mapped, not the virtual size), cut at about
        :data:`p.MAP_REPLY_BYTES` with ``next`` saying where to go on."""
        tenants = list(self.tenants) if r.tenant is None else self.tenants.find(r.tenant)
        if r.tenant is not None and not tenants:
            raise Fail(p.NOT_FOUND, f"no tenant {r.tenant!r}")
        names = {x.id: x.name for x in tenants}
        open_ = {x.id for x in tenants if sees_all(t, x.uid)}  # the rest: sizes, states
        ids = sorted(g.id for x in tenants for g in x.groups.values() if g.id > r.after)
        groups: list[p.GroupInfo] = []
        size = 0
        for n, gid in enumerate(ids):
            g = self.groups[gid]
            runs = [p.Run(start, length, reserve) for start, length, reserve in g.runs()]
            cost = 128 + 10 * (len(runs) + min(len(g.bases), p.MAP_BASES))
            if r.pfns:
                cost += 10 * g.pages + 10 * len(g.units)
            if groups and (size + cost > p.MAP_REPLY_BYTES or len(groups) >= r.limit):
                return p.MapReply(id=r.id, pool=self.pool_info(), groups=groups,
                                  next=groups[-1].id, truncated=len(ids) - n)
            size += cost
            shown = g.tenant in open_
            groups.append(p.GroupInfo(
                id=g.id, tenant=g.tenant, tenant_name=names.get(g.tenant, ""),
                label=g.label if shown else "", n_regions=g.n_regions, npages=g.npages,
                bases=g.bases[: p.MAP_BASES] if shown else [], runs=runs,
                pfns=dict(g.units) if r.pfns and shown else None, chunk_units=g.chunk_units,
            ))
        return p.MapReply(id=r.id, pool=self.pool_info(), groups=groups)

    def check(self, t: TenantRecord, sender: Sender, r: p.Check) -> p.Reply:
        return p.CheckReply(id=r.id, problems=self.integrity.check())
