"""Every device one daemon serves: a stack each, one session index, the gangs.

``kvpool daemon --devices all|N|0,1`` (``Config.devices``) opens one *stack* per device
(:class:`Stack`: the backend opened on that ordinal, a :class:`~kvpool.daemon.pool.Pool`
with that device's budget, an :class:`~kvpool.daemon.arbiter.Arbiter` over that
device's tenants). The host backend opens the same way, so ``--devices 2`` on host is
two independent pools: the stand-in for two GPUs. Nothing here branches on a backend's
name.

The stacks share the daemon-wide session index (:attr:`Devices.tenants`: tokens, ids,
fd-channel filenos; each arbiter sees its device's view of it) and the
:class:`~kvpool.daemon.gangs.Gangs`. A session opens on the first device (it holds
nothing yet) and belongs to the device its ``Register`` names from then on
(:meth:`Devices.route`); every request of a session goes to its device's arbiter.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from typing import Iterator

from kvpool import protocol as p
from kvpool.daemon.arbiter import Arbiter
from kvpool.daemon.config import Config
from kvpool.daemon.gangs import Gangs
from kvpool.daemon.pool import Pool
from kvpool.daemon.tenants import NO_MEMORY_KINDS, TenantRecord, Tenants
from kvpool.sizes import parse_size
from kvpool.vmm import Backend, device_count, open_backend


@dataclass
class Stack:
    """One device: its backend, pool (``budget`` bytes) and arbiter."""

    device: int
    backend: Backend
    pool: Pool
    arbiter: Arbiter
    budget: int


def open_stack(cfg: Config, device: int, tenants: Tenants, gangs: Gangs) -> Stack:
    """Open ``device``'s backend and build its pool and arbiter (``cfg.for_device``:
    its budget); raises ``ConfigError`` (the backend closed) when the budget does not
    fit the device."""
    dcfg = cfg.for_device(device)
    page_size = parse_size(cfg.page_size) if cfg.page_size is not None else None
    backend = open_backend(cfg.backend, device, page_size, cfg.huge_pages)
    ps = backend.page_size
    free, total = backend.mem_info()
    try:  # budget vs the device, tenants' min vs the budget (ConfigError)
        budget_pages = dcfg.check_budget(total, ps, free) // ps
    except ValueError:
        backend.close()
        raise
    pool = Pool(backend, budget_pages,
                warm_min=dcfg.resolve_pages(cfg.warm_min, ps, budget_pages * ps),
                warm_max=dcfg.resolve_pages(cfg.warm_max, ps, budget_pages * ps))
    arbiter = Arbiter(dcfg, pool, budget_pages * ps, tenants, gangs)
    return Stack(device, backend, pool, arbiter, budget_pages * ps)


class Devices:
    """The stacks of every device in ``cfg`` (:meth:`Config.device_ordinals`), the
    daemon-wide session index and the gangs. Also the fd channel's ``SessionBook``:
    sessions open on the first device."""

    def __init__(self, cfg: Config):
        self.tenants = Tenants()  # daemon-wide: every device's sessions
        self.gangs = Gangs(cfg.reclaim_timeout_s)
        ordinals = cfg.device_ordinals(lambda: device_count(cfg.backend))
        self.stacks: dict[int, Stack] = {}
        try:
            for d in ordinals:
                self.stacks[d] = open_stack(cfg, d, self.tenants, self.gangs)
        except BaseException:
            self.close()
            raise
        self.first = self.stacks[ordinals[0]]

    def __iter__(self) -> Iterator[Stack]:
        return iter(list(self.stacks.values()))

    @property
    def pools(self) -> dict[int, Pool]:
        return {d: s.pool for d, s in self.stacks.items()}

    def arbiter_of(self, t: TenantRecord | None) -> Arbiter:
        """The arbiter of ``t``'s device (the first device's for no session)."""
        s = self.stacks.get(t.device) if t is not None else None
        return s.arbiter if s is not None else self.first.arbiter

    def route(self, t: TenantRecord | None, req: p.Request) -> str | None:
        """Before a request is handled: an unregistered session's ``Register`` moves it
        to the device it names (it holds nothing yet). Returns why the request is
        refused here (a memory-holding session naming a device not served), else None."""
        if t is None or t.registered or not isinstance(req, p.Register):
            return None
        if req.device in self.stacks:
            t.device = req.device
            return None
        t.device = self.first.device
        if req.kind in NO_MEMORY_KINDS:
            return None  # a monitor of a device not served reads the first one
        return (f"device {req.device} is not served (this daemon serves "
                f"{'device' if len(self.stacks) == 1 else 'devices'} "
                f"{', '.join(map(str, self.stacks))})")

    # ---- SessionBook (kvpool.daemon.fdsessions) ----------------------------------------
    def open_session(self, conn: socket.socket, pid: int, uid: int, gid: int,
                     pidfd: int | None) -> TenantRecord:
        return self.first.arbiter.open_session(conn, pid, uid, gid, pidfd)

    def drop(self, t: TenantRecord, why: str) -> None:
        self.arbiter_of(t).drop(t, why)

    def close(self) -> None:
        """Release every device's pages and close its backend."""
        for s in list(self.stacks.values()):
            s.pool.close()
            s.backend.close()


def metrics_off(cfg: Config) -> Config:
    """``cfg`` without the metrics exporter (one per daemon: the first device's)."""
    return dataclasses.replace(cfg, metrics_address=None)
