"""A monitor/admin connection (used by the CLI).

Read-only ops (``ps``, ``stats``, ``map``, ``check``) need a registered session, so a
monitor opens an fd-channel session and registers it as kind ``monitor`` (holds no
memory, not listed by ``ps``). Admin ops (``set_limit``, ``shutdown``) are decided from
the caller's identity as the kernel reports it (``SO_PEERCRED``) on that channel: the
daemon checks that the peer is root, the daemon's user or in its admin group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar, overload

from kvpool import paths
from kvpool import protocol as p
from kvpool.client_lib.connection import Connection

R = TypeVar("R", bound=p.Reply)


class Monitor:
    """One fd-channel session registered as kind ``monitor`` (it holds no memory and is
    not listed by ``ps``): the daemon answers ``ps``/``stats``/``map``/``check`` only to
    registered sessions, and decides admin ops from this session's peer credentials."""

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, timeout_s: float = 5.0,
                 device: int | None = None):
        """``device``: the device whose tenants and pool it reads (a daemon serving
        several; None: the daemon's first)."""
        self.run_dir = paths.run_dir(run_dir)
        self.timeout_s = timeout_s
        self.conn = Connection(Path(self.run_dir), timeout_s=timeout_s)
        try:
            if device is None:
                device = self.conn.hello.device if self.conn.hello is not None else 0
            self.conn.call(p.Register(name="monitor", kind="monitor", device=device),
                           p.Registered)
        except BaseException:
            self.conn.close()
            raise

    @overload
    def call(self, req: p.Request) -> p.Reply: ...

    @overload
    def call(self, req: p.Request, expect: type[R]) -> R: ...

    def call(self, req: p.Request, expect: type[p.Reply] = p.Reply) -> p.Reply:
        """Send ``req``; the reply, checked to be an ``expect`` (any reply by default).
        Admin ops go through here too: the daemon decides them from this session's
        peer credentials."""
        return self.conn.call(req, expect)[0]

    def ps(self) -> p.PsReply:
        return self.call(p.Ps(), p.PsReply)

    def stats(self) -> p.StatsReply:
        return self.call(p.Stats(), p.StatsReply)

    def map(self, tenant: str | None = None, pfns: bool = False) -> p.MapReply:
        """The whole map: the daemon sends it in bounded pages (``next``), joined here."""
        reply = self.call(p.MapReq(tenant=tenant, pfns=pfns), p.MapReply)
        groups = list(reply.groups)
        while reply.next is not None:
            reply = self.call(p.MapReq(tenant=tenant, pfns=pfns, after=reply.next), p.MapReply)
            groups.extend(reply.groups)
        return p.MapReply(id=reply.id, pool=reply.pool, groups=groups)

    def set_limit(self, tenant: str, nbytes: int | None = None, *, min: int | None = None,
                  shares: float | None = None) -> p.LimitSet:
        """Change ``tenant``'s knobs (admin); the reply says whether the change is
        applied or how many bytes are still being reclaimed."""
        return self.call(p.SetLimit(tenant=tenant, max=nbytes, min=min, shares=shares),
                         p.LimitSet)

    def sleep(self, tenant: str, wake: bool = False) -> int:
        """Ask every tenant called ``tenant`` to sleep (or wake): how many were asked
        (0: none is connected). Its own uid's tenants, or any for an admin."""
        return self.call(p.SleepTenant(name=tenant, wake=wake), p.SleepAsked).tenants

    def shutdown(self) -> None:
        """Stop the daemon (admin)."""
        self.call(p.Shutdown(), p.Done)

    def check(self) -> list[str]:
        return self.call(p.Check(), p.CheckReply).problems

    def close(self) -> None:
        try:
            self.conn.call(p.Bye(), p.Done)
        except Exception:
            pass
        self.conn.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
