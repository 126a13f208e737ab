"""Tenant records: who holds what, and the knobs arbitration will use.

A tenant is born when a process connects the fd channel (the daemon reads its pid and
uid there and issues a session token); it is *registered* once a control message with
that token binds a ZeroMQ identity and a name. It dies on fd-channel EOF, when its pid
exits, on ``bye``, or when it never registers. Death returns every page it holds.
"""

from __future__ import annotations

import itertools
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from kvpool import protocol as p
from kvpool.daemon.pool import Payer
from kvpool.daemon.regions import GroupRecord

# session kinds that hold no memory (daemon-enforced)
NO_MEMORY_KINDS: tuple[p.Kind, ...] = ("monitor", "admin")


@dataclass(eq=False)
class Ask:
    """What the daemon asked a tenant to give back and is still waiting for
    (:mod:`kvpool.daemon.reclaim` sends it; ``TenantRecord.ask`` holds it)."""

    seq: int
    pages: int  # still to come (decremented as the tenant releases)
    mode: p.ReclaimMode
    urgent: bool
    deadline: float
    reason: str


@dataclass(eq=False)
class TenantRecord:
    """The daemon's record of one session (the client's session object is
    ``kvpool.client_lib.Tenant``)."""

    id: int
    token: str
    pid: int
    uid: int
    gid: int
    conn: socket.socket  # fd channel
    pidfd: int | None = None
    name: str = ""
    kind: p.SessionKind = ""  # (Register.kind; "" until it registers)
    policy_name: str = ""  # its name when the config gives it a policy ([tenants.NAME])
    identity: bytes | None = None  # ZeroMQ routing id, set at register
    registered: bool = False
    endpoint: str = ""  # where it says it serves (Register.endpoint, validated; Locate)
    group: str = ""  # the group it said it belongs to (Register.group; a label for ps)
    engine: str = ""  # the metrics dialect its endpoint serves (Register.engine; a label)
    admin: bool = False  # an admin identity (decided from SO_PEERCRED at accept)
    peer_gids: set[int] = field(default_factory=set)  # primary + supplementary, at accept
    min_pages: int = 0  # guaranteed: never reclaimed
    max_pages: int = 0  # hard limit
    shares: float = 1.0  # its fair share of contended memory (a proportional count)
    groups: dict[int, GroupRecord] = field(default_factory=dict)
    granted: int = 0  # pages in this tenant's tables (sum over groups)
    lease_pages: int = 0  # pages leased (no table: the tenant's own allocator uses them)
    # pages of the weight sets it holds (kvpool.daemon.weights): each counts against its
    # max, none in ``held`` (they are not its to give back: the pool counts a set once)
    weight_pages: int = 0
    since: float = field(default_factory=time.monotonic)
    # reclaim state (see kvpool.daemon.reclaim)
    ask: Ask | None = None  # the outstanding ask, if any
    short_until: float = 0.0  # answered a shrink short: not asked to shrink before this
    ignored: int = 0  # asks that expired unanswered
    unresponsive: bool = False  # capped at min_pages until it answers a reclaim
    waiting_pages: int = 0  # pages of its requests queued for reclaim
    inbox: list[int] = field(default_factory=list)  # fds it sent for an Adopt (server-read)
    stash: list[tuple[int, list[int]]] = field(default_factory=list)  # (request id, fds) ahead
    device: int = 0  # the device it holds memory on (Register.device; 0 until then)
    gang: int = 0  # the gang it is a rank of (kvpool.daemon.gangs; 0: none)
    rank: int = 0

    @property
    def held(self) -> int:
        """Pages counted against the budget for this tenant: tables plus lease."""
        return self.granted + self.lease_pages

    @property
    def payer(self) -> Payer:
        """Who pays for what it retains once its session has ended."""
        return Payer(self.uid, self.policy_name)

    @property
    def cap_pages(self) -> int:
        """The most it may hold now: ``max``, or ``min`` while unresponsive."""
        return min(self.max_pages, self.min_pages) if self.unresponsive else self.max_pages

    @property
    def arbitrated(self) -> bool:
        """Takes part in arbitration (registered, not a monitor/admin session)."""
        return self.registered and self.kind not in NO_MEMORY_KINDS

    @property
    def in_use_pages(self) -> int:
        return self.granted - self.reserve_pages

    @property
    def reserve_pages(self) -> int:
        return sum(len(g.reserve) * g.n_regions for g in self.groups.values())

    def in_use_bytes(self, page_size: int) -> int:
        reported = [g.in_use for g in self.groups.values()]
        if reported and all(r is not None for r in reported):
            return sum(r for r in reported if r is not None)
        return self.in_use_pages * page_size


class Tenants:
    """Indexes over live tenants: by id, by session token, by fd-channel fileno.

    With ``device`` (and the daemon-wide index ``share``), a *device view*: the same
    indexes (sessions, tokens and ids are daemon-wide), but iterating, ``named`` and
    ``len`` see only the tenants on that device (``TenantRecord.device``), which is what
    one device's arbiter, reclaimer and views work over (kvpool.daemon.devices)."""

    def __init__(self, device: int | None = None, share: Tenants | None = None) -> None:
        self.by_id: dict[int, TenantRecord]
        self.by_token: dict[str, TenantRecord]
        self.by_fileno: dict[int, TenantRecord]
        self._ids: Iterator[int]
        if share is not None:
            self.by_id, self.by_token = share.by_id, share.by_token
            self.by_fileno, self._ids = share.by_fileno, share._ids
        else:
            self.by_id, self.by_token, self.by_fileno = {}, {}, {}
            self._ids = itertools.count(1)
        self.device = device

    def add(self, **kw: Any) -> TenantRecord:
        t = TenantRecord(id=next(self._ids), **kw)
        if self.device is not None:
            t.device = self.device
        self.by_id[t.id] = t
        self.by_token[t.token] = t
        self.by_fileno[t.conn.fileno()] = t
        return t

    def remove(self, t: TenantRecord) -> None:
        self.by_id.pop(t.id, None)
        self.by_token.pop(t.token, None)
        for fd, other in list(self.by_fileno.items()):
            if other is t:
                del self.by_fileno[fd]

    def named(self, name: str) -> list[TenantRecord]:
        """Memory-holding tenants called ``name`` (monitor and admin sessions claim no
        name). At most one is registered at a time (the arbiter refuses a second)."""
        return [t for t in self if t.name == name and t.arbitrated]

    def count_uid(self, uid: int) -> int:
        return sum(1 for t in self.by_id.values() if t.uid == uid)

    def find(self, key: str) -> list[TenantRecord]:
        """Tenants whose name is ``key``, or whose id is ``key``."""
        if key.isdigit() and int(key) in self.by_id:
            return [self.by_id[int(key)]]
        return self.named(key)

    def __iter__(self) -> Iterator[TenantRecord]:
        if self.device is None:
            return iter(list(self.by_id.values()))
        return iter([t for t in self.by_id.values() if t.device == self.device])

    def __len__(self) -> int:
        if self.device is None:
            return len(self.by_id)
        return sum(1 for t in self.by_id.values() if t.device == self.device)
