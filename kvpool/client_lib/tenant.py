"""A tenant: one process's registered session with the daemon.

``connect(name=...)`` opens the fd channel (the daemon reads our pid/uid there and hands
out a session token), registers over ZeroMQ, and opens this process's own vmm backend of
the daemon's kind and page size. Closing (or leaving the ``with`` block) releases every
unit of every group and ends the session; if the process dies instead, the daemon sees
the fd channel close and takes everything back itself.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

from kvpool import paths
from kvpool import protocol as p
from kvpool.client_lib.connection import Connection
from kvpool.client_lib.regions import RegionGroup
from kvpool.vmm import open_backend

log = logging.getLogger("kvpool.client")


class Tenant:
    def __init__(self, name: str, device: int = 0, run_dir: str | os.PathLike | None = None,
                 kind: str = "engine", timeout_s: float = 10.0):
        self.run_dir = paths.run_dir(run_dir)
        self.conn = Connection(Path(self.run_dir), timeout_s=timeout_s)
        self.closed = False
        try:
            reply, _ = self.conn.call(p.Register(name=name, kind=kind, device=device))
            hello = self.conn.hello
            assert hello is not None
            self.backend = open_backend(hello.backend, device, hello.page_size)
        except BaseException:
            self.conn.close()
            raise
        self.info: p.Registered = reply
        self.id = reply.tenant
        self.name = name
        self.device = device
        self.page_size = reply.page_size
        self.limit = reply.limit
        self.budget = reply.budget
        self.groups: dict[int, RegionGroup] = {}
        self.on_message: Callable[[p.Reply], None] | None = None

    def call(self, req: p.Request) -> tuple[p.Reply, list[int]]:
        return self.conn.call(req)

    def region_group(self, n_regions: int, capacity_bytes: int, label: str = "") -> RegionGroup:
        """Reserve ``n_regions`` ranges of ``capacity_bytes`` (rounded up to pages) each
        and register them with the daemon; nothing is mapped yet."""
        g = RegionGroup(self, n_regions, capacity_bytes, label)
        self.groups[g.id] = g
        return g

    def poll(self) -> list[p.Reply]:
        """Handle unsolicited messages from the daemon (allocators' refill threads call
        this). Each goes to ``on_message`` when set; otherwise a ``Reclaim`` is answered
        from the cheapest source, the allocators' reserves (unused mapped units)."""
        msgs = self.conn.poll()
        for m in msgs:
            if self.on_message is not None:
                self.on_message(m)
            elif isinstance(m, p.Reclaim):
                self.reclaim_reserve(m.bytes)
        return msgs

    def reclaim_reserve(self, nbytes: int) -> int:
        """Release up to ``nbytes`` of reserve units (rounded up to whole chunks) from
        every group's allocator; returns the bytes released."""
        freed = 0
        for g in list(self.groups.values()):
            if freed >= nbytes:
                break
            if g.allocator is not None:
                freed += g.allocator.release_reserve(nbytes - freed)
        return freed

    def ping(self) -> None:
        self.conn.call(p.Ping())

    def close(self) -> None:
        if self.closed:
            return
        try:
            for g in list(self.groups.values()):
                try:
                    g.close()
                except Exception:
                    log.exception("closing group %d failed", g.id)
            try:
                self.conn.call(p.Bye())
            except Exception as e:  # the daemon may be gone; EOF tells it anyway
                log.debug("bye failed: %s", e)
        finally:
            self.closed = True
            self.conn.close()
            self.backend.close()

    def __enter__(self) -> "Tenant":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(name: str, device: int = 0, run_dir: str | os.PathLike | None = None,
            kind: str = "engine", timeout_s: float = 10.0) -> Tenant:
    """Register with the daemon serving ``run_dir`` (see :mod:`kvpool.paths`)."""
    return Tenant(name, device=device, run_dir=run_dir, kind=kind, timeout_s=timeout_s)
