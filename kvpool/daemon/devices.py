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
import logging
import socket
import time
from dataclasses import dataclass
from typing import Iterator

from kvpool import protocol as p
from kvpool.daemon.arbiter import Arbiter
from kvpool.daemon.config import Config
from kvpool.daemon.gangs import Gangs
from kvpool.daemon.pool import Pool
from kvpool.daemon.restart import StateFile, devices_of, live_tenants, next_group_of
from kvpool.daemon.tenants import TenantRecord, Tenants
from kvpool.sizes import parse_size
from kvpool.vmm import Backend, device_count, open_backend

log = logging.getLogger("kvpool.daemon")


@dataclass
class Stack:
    """One device: its backend, pool (``budget`` bytes) and arbiter."""

    device: int
    backend: Backend
    pool: Pool
    arbiter: Arbiter
    budget: int


def open_stack(cfg: Config, device: int, tenants: Tenants, gangs: Gangs,
               served: int = 1) -> Stack:
    """Open ``device``'s backend and build its pool and arbiter (``cfg.for_device``:
    its budget), one of ``served`` devices; raises ``ConfigError`` (the backend closed)
    when the budget does not fit the device (on a backend whose devices share one
    memory, host RAM: an equal ``served``-th of it)."""
    dcfg = cfg.for_device(device)
    page_size = parse_size(cfg.page_size) if cfg.page_size is not None else None
    backend = open_backend(cfg.backend, device, page_size, cfg.huge_pages)
    ps = backend.page_size
    free, total = backend.mem_info()
    share = served if backend.caps.devices_share_memory else 1
    try:  # budget vs the device, tenants' min vs the budget (ConfigError)
        budget_pages = dcfg.check_budget(total, ps, free, share) // ps
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
                self.stacks[d] = open_stack(cfg, d, self.tenants, self.gangs, len(ordinals))
        except BaseException:
            self.close()
            raise
        self.first = self.stacks[ordinals[0]]

    def __iter__(self) -> Iterator[Stack]:
        return iter(list(self.stacks.values()))

    @property
    def served(self) -> list[int]:
        """Every device served, in order."""
        return list(self.stacks)

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
        refused here (a session naming a device not served, a monitor's too: it would
        read another device's state as if it were the one asked), else None."""
        if t is None or t.registered or not isinstance(req, p.Register):
            return None
        if req.device in self.stacks:
            t.device = req.device
            return None
        t.device = self.first.device
        return (f"device {req.device} is not served (this daemon serves "
                f"{'device' if len(self.stacks) == 1 else 'devices'} "
                f"{', '.join(map(str, self.stacks))})")

    # ---- restart (kvpool.daemon.restart) ------------------------------------------------
    def save_state(self, state: StateFile) -> None:
        """Every device's live tenants (gang ranks excepted: a restart ends a gang) and
        next group ids, for the next daemon."""
        first = self.first.arbiter
        tenants = [t for t in self.tenants if t.arbitrated and not t.gang]
        state.save(first.next_group, tenants,
                   {d: s.arbiter.next_group for d, s in self.stacks.items()})

    def begin_recovery(self, state: StateFile, timeout_s: float) -> None:
        """Each device waits for the previous daemon's tenants that held memory on it."""
        saved = state.load()
        if saved is None:
            return
        first = self.first.device
        where = devices_of(saved, first)
        pids, names, uids = live_tenants(saved)
        until = time.monotonic() + timeout_s
        for d, s in self.stacks.items():
            mine = {pid for pid in pids if d in where.get(pid, {first})}
            s.arbiter.begin_recovery(
                mine, {n: pid for n, pid in names.items() if pid in mine},
                {pid: uid for pid, uid in uids.items() if pid in mine},
                next_group_of(saved, d, first), until)
        if pids:
            log.info("recovering: waiting up to %gs for %d tenants of the previous daemon",
                     timeout_s, len(pids))

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
