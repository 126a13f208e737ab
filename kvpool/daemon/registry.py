"""Tenant sessions as the arbiter sees them: open, register, knobs, drop.

A session opens when a process connects the fd channel (:meth:`Registry.open`: a
record with a fresh token, within the per-uid and global session caps), registers a
name and kind with a control message (:meth:`Registry.register`: who may claim the
name, the knobs it gets), and ends with :meth:`Registry.drop`, which returns every page
and lease it held at once. Knobs (``min``/``max``/``shares``) come from a live admin
change first (``set_limit``), then the config's ``[tenants.NAME]``, then what the tenant
asked for, then the defaults.
"""

from __future__ import annotations

import logging
import secrets
import socket
from typing import Any

from kvpool import protocol as p
from kvpool.daemon.auth import may_claim, peer_groups
from kvpool.daemon.config import Config
from kvpool.daemon.ledger import Ledger
from kvpool.daemon.outcome import Fail, Sender
from kvpool.daemon.pool import Pool
from kvpool.daemon.reclaim import Reclaimer
from kvpool.daemon.regions import GroupIndex
from kvpool.daemon.restart import Recovery
from kvpool.daemon.tenants import NO_MEMORY_KINDS, TenantRecord, Tenants
from kvpool.protocol import endpoint
from kvpool.sizes import parse_size

log = logging.getLogger("kvpool.daemon")


def session_level(kind: str) -> int:
    """The log level of a session's register and drop lines: DEBUG for a monitor (every
    ``kvpool ps``, each ``top`` frame; it holds nothing), INFO for everyone else."""
    return logging.DEBUG if kind == "monitor" else logging.INFO


class Registry:
    """The sessions in ``tenants``, within ``cfg``'s caps and tenant policies; a session
    that ends gives its groups (``groups``) and lease back to ``pool`` through
    ``ledger`` and its waiters up (``reclaimer``), and stops ``recovery`` waiting for
    its pid. ``budget`` bytes."""

    def __init__(self, cfg: Config, pool: Pool, ledger: Ledger, budget: int,
                 tenants: Tenants, groups: GroupIndex, reclaimer: Reclaimer,
                 recovery: Recovery):
        self.cfg = cfg
        self.pool = pool
        self.ledger = ledger
        self.page_size = pool.page_size
        self.budget = budget
        self.tenants = tenants
        self.groups = groups
        self.reclaimer = reclaimer
        self.recovery = recovery
        self.knob_overrides: dict[str, dict[str, Any]] = {}  # set_limit changes, by name

    def open(self, conn: socket.socket, pid: int, uid: int, gid: int,
             pidfd: int | None) -> TenantRecord:
        """A new fd-channel connection: a tenant record with a fresh session token.
        Raises :class:`Fail` (``OVER_LIMIT``) past the per-uid or the global session cap
        (the server tells the peer why in its hello, then hangs up)."""
        per_uid = self.cfg.max_sessions_per_uid
        if self.tenants.count_uid(uid) >= per_uid:
            raise Fail(p.OVER_LIMIT, f"uid {uid} has {per_uid} sessions open already "
                                     f"(max_sessions_per_uid)")
        total = self.cfg.max_sessions
        if len(self.tenants.by_id) >= total:  # (every device's sessions)
            raise Fail(p.OVER_LIMIT, f"the daemon serves {total} sessions already "
                                     f"(max_sessions)")
        return self.tenants.add(
            token=secrets.token_hex(16), pid=pid, uid=uid, gid=gid, conn=conn, pidfd=pidfd,
            peer_gids=peer_groups(pid, gid) if pid > 0 else {gid},
        )

    def drop(self, t: TenantRecord, why: str) -> None:
        """The tenant is gone: every page it held returns to the pool (to be zeroed);
        the pages it still references stay charged to its uid (and configured name)."""
        pages = self.ledger.end(t)  # what it retains stays charged to its uid (name)
        for g in t.groups.values():
            self.groups.pop(g.id, None)
        t.groups.clear()
        t.ask = None
        self.reclaimer.forget(t)
        if t.arbitrated:  # a returning tenant's session ended: stop waiting for its pid
            self.recovery.returned(t.pid)  # (a monitor of that pid says nothing)
        self.tenants.remove(t)
        log.log(session_level(t.kind), "tenant %d (%s, pid %d) dropped: %s; %d pages returned",
                t.id, t.name or "-", t.pid, why, pages)

    def knobs(self, name: str, asked: p.Register | None = None) -> tuple[int, int, float]:
        """``(min, max, shares)`` for tenant ``name`` (``min`` and ``max`` in pages): a live
        admin change wins, then the daemon config's ``[tenants.NAME]``, then what the
        tenant asked for at registration, then the defaults."""
        cfg = self.cfg
        live = self.knob_overrides.get(name, {})
        configured = name in cfg.tenants
        policy = cfg.policy(name)

        def pick(key: str, conf: Any, default: Any) -> Any:
            if key in live:
                return live[key]
            if configured and conf is not None:
                return conf
            if asked is not None and getattr(asked, key) is not None:
                return getattr(asked, key)
            return conf if conf is not None else default

        mx = pick("max", policy.max, cfg.default_max)
        mn = pick("min", policy.min if configured else None, 0)
        w = pick("shares", policy.shares if configured else None, 1.0)
        ps, budget = self.page_size, self.budget
        return (parse_size(mn, budget) // ps,
                min(parse_size(mx, budget), budget) // ps, float(w))

    def register(self, t: TenantRecord, sender: Sender, r: p.Register) -> p.Reply:
        device = self.pool.backend.device
        if r.version != p.VERSION:
            raise Fail(p.VERSION_MISMATCH, f"client speaks protocol {r.version}, daemon {p.VERSION}")
        if t.registered:
            raise Fail(p.BAD_REQUEST, "session already registered")
        if r.endpoint is not None:
            why = endpoint.why_not(r.endpoint)
            if why is None and r.kind in NO_MEMORY_KINDS:
                why = f"a {r.kind} session serves nothing: it registers no endpoint"
            if why:
                raise Fail(p.BAD_REQUEST, why)
        if r.device != device and r.kind not in NO_MEMORY_KINDS:
            raise Fail(p.NOT_FOUND, f"device {r.device} is not served (this daemon serves "
                                    f"device {device})")
        if r.kind not in NO_MEMORY_KINDS:
            self._claim(t, r.name)
        if r.endpoint:
            self._claim_endpoint(t, r.endpoint)
        mn, mx, shares = self.knobs(r.name, r)
        if r.kind in NO_MEMORY_KINDS:
            mn = mx = 0  # holds nothing: no knobs, no claim on a name's policy
        else:
            floors = sum(x.min_pages for x in self.tenants if x.arbitrated)
            if mn and floors + mn > self.budget // self.page_size:
                raise Fail(p.OVER_LIMIT, f"min of {mn} pages would make the guaranteed "
                                         f"minimums ({floors} pages) exceed the budget")
        t.name, t.kind, t.identity, t.registered = r.name, r.kind, sender.identity, True
        t.policy_name = r.name if r.kind not in NO_MEMORY_KINDS and \
            r.name in self.cfg.tenants else ""
        t.endpoint = r.endpoint or ""
        t.engine = r.engine or ""
        t.group = r.group or ""
        t.min_pages, t.max_pages, t.shares = mn, mx, shares
        log.log(session_level(t.kind), "tenant %d registered: %s (%s), pid %d uid %d, "
                "limit %d pages", t.id, t.name, t.kind, t.pid, t.uid, t.max_pages)
        return p.Registered(
            id=r.id, tenant=t.id, name=t.name, backend=self.pool.backend.name,
            device=device, page_size=self.page_size, budget=self.budget,
            limit=t.max_pages * self.page_size,
        )

    def _claim(self, t: TenantRecord, name: str) -> None:
        """May ``t`` register as ``name``: the config's ``uids``/``group`` of that name
        admit its peer, and no other live memory-holding session holds the name."""
        if name in self.cfg.tenants:
            why = may_claim(name, self.cfg.tenants[name], t.uid, t.peer_gids or {t.gid})
            if why:
                raise Fail(p.UNAUTHORIZED, why)
        owner = self.recovery.keeper_of(name, t.pid, t.uid)
        if owner is not None:
            raise Fail(p.UNAUTHORIZED, f"tenant name {name!r} is kept for pid {owner}, a "
                                       f"tenant of the previous daemon, until it returns")
        holders = [x for x in self.tenants.named(name) if x is not t]
        if holders:
            h = holders[0]
            raise Fail(p.UNAUTHORIZED, f"tenant name {name!r} is held by tenant {h.id} "
                                       f"(pid {h.pid}); choose another name")

    def _claim_endpoint(self, t: TenantRecord, url: str) -> None:
        """One endpoint per live tenant: no other registered session names ``url`` or
        another spelling of its listener (:func:`endpoint.same_listener`)."""
        for x in self.tenants:
            if x is not t and x.registered and x.endpoint and \
                    endpoint.same_listener(x.endpoint, url):
                raise Fail(p.UNAUTHORIZED, f"endpoint {url} is registered by tenant "
                                           f"{x.name!r} (id {x.id}) as {x.endpoint}; one "
                                           f"endpoint per live tenant")

    def set_limit(self, t: TenantRecord, sender: Sender, r: p.SetLimit) -> p.Reply:
        ps = self.page_size
        change = {k: getattr(r, k) for k in ("min", "max", "shares") if getattr(r, k) is not None}
        named = self.tenants.named(r.tenant)
        if "min" in change:
            floors = sum(x.min_pages for x in self.tenants if x.arbitrated and x.name != r.tenant)
            if floors + len(named) * (change["min"] // ps) > self.budget // ps:
                raise Fail(p.OVER_LIMIT, "the guaranteed minimums would exceed the budget")
        self.knob_overrides.setdefault(r.tenant, {}).update(change)
        for x in named:
            x.min_pages, x.max_pages, x.shares = self.knobs(r.tenant)
        log.info("knobs of %s set: %s", r.tenant, change)
        # the server's tick() right after this reply asks tenants above the limit to shrink
        pending = sum(max(0, x.granted - max(0, x.max_pages - x.lease_pages)) for x in named)
        return p.LimitSet(id=r.id, tenant=r.tenant, tenants=len(named), applied=pending == 0,
                          pending=pending * ps)
