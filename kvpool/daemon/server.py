"""The daemon's event loop: one thread, one ``zmq.Poller`` (poll(2), no descriptor-number
limit) over

* the ROUTER control socket (``ipc://$RUN_DIR/control.sock``: :mod:`.control`),
* the fd-channel listener (``$RUN_DIR/pages.sock``) and each tenant's connection
  (:mod:`.fdsessions` inbound, :mod:`.fdsend` outbound),
* each tenant's pidfd (readable when the process exits),
* a self-pipe woken by SIGTERM/SIGINT,

plus timers and idle work (scrubbing released pages, keeping the warm pool between its
bounds). Request logic lives in :mod:`kvpool.daemon.arbiter`; start-up and run-dir
safety in :mod:`.startup`; the restart state in :mod:`.restart`; the poller in
:mod:`.fdwatch`. This file builds the parts (each given the collaborators it uses:
the pool, the arbiter's tenants, the poller, the callbacks into the loop), runs the
loop and its timers, admits requests and ends sessions.

Timers (:meth:`Server.next_due`, :meth:`Server.run_timers`):

* reclaim deadlines and the end of recovery (``Arbiter.next_deadline``): a tick;
* fd sockets full for ``send_timeout_s``: the tenant is dropped; parked Adopts past
  ``adopt_wait_s``: refused;
* restart state changed: ``state.json`` saved;
* every ``liveness_s``: tenants whose pid is gone (no pidfd) or that never registered
  are dropped, and retained pages rechecked (waiting grants may fit after);
* the systemd watchdog, and a status line every ``status_interval_s``.

The loop never blocks on one peer:

* every fd-channel socket is non-blocking; a grant's descriptors go through the
  tenant's bounded queue, sent as the socket takes them (``POLLOUT``), and its reply
  leaves only after them (the ordering rule). While the queue is not empty the
  session's requests get ``BUSY``; a tenant whose socket stays full for
  ``send_timeout_s`` (or whose queue overflows) is dropped, its memory returned;
* inbound descriptors are stashed as they arrive (at most the budget's page count, all
  tenants together); an ``Adopt`` waits parked until its announced descriptors are all
  in, or is refused after ``adopt_wait_s``;
* control messages are read frame by frame and a turn handles at most ``burst`` per
  socket; requests that wait for reclaim are answered from :meth:`Arbiter.tick`.

Nothing a client sends can raise out of the loop: bad frames get ``BAD_REQUEST``,
handler bugs ``INTERNAL``, and an unexpected exception while serving one peer's socket
drops that tenant, never the daemon.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable

from kvpool import fdchannel
from kvpool import protocol as p
from kvpool.discovery import EndpointsFileError, advertised_address
from kvpool.daemon import observe
from kvpool.daemon.config import Config
from kvpool.daemon.control import Control
from kvpool.daemon.devices import Devices, metrics_off
from kvpool.daemon.endpoints import EndpointsKeeper
from kvpool.daemon.events import EventLog
from kvpool.daemon.fdsend import FdSender
from kvpool.daemon.fdsessions import FdSessions
from kvpool.daemon.fdwatch import FdWatch
from kvpool.daemon.notify import Notifier
from kvpool.daemon.outcome import Outcome
from kvpool.daemon.restart import StateFile
from kvpool.daemon.startup import (
    AlreadyRunning, Sockets, StartupError, group_id, open_sockets, prepare_run_dir,
)
from kvpool.daemon.tenants import TenantRecord
from kvpool.limits import raise_fd_limit
from kvpool.sizes import format_size

__all__ = ["AlreadyRunning", "Server", "StartupError", "raise_fd_limit", "run"]

log = logging.getLogger("kvpool.daemon")

SLOW_STEP_S = 1.0  # a handler or request that holds the loop this long is logged

NO_WATCHDOG_S = 3600.0  # how often the watchdog timer wakes when systemd set none


class Server:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_dir = cfg.run_path
        # every device's stack (backend, pool, arbiter); the first one's are also
        # ``backend``/``pool``/``arbiter``: restart state, counters, the hello
        self.devices = Devices(cfg)
        first = self.devices.first
        self.backend, self.pool, self.arbiter = first.backend, first.pool, first.arbiter
        self.gangs = self.devices.gangs
        self.notifier = Notifier.from_env()
        self.state = StateFile(self.run_dir)
        self.sockets = Sockets(self.run_dir)
        self.fdwatch = FdWatch()
        self.fdsend = FdSender(self.devices.pools, self.devices.tenants, self.fdwatch,
                               self.reply, self.drop, cfg.max_queued_fds, cfg.send_timeout_s,
                               {s.device: s.arbiter.weights for s in self.devices})
        self._stop = False
        self._state_dirty = False
        self.endpoints: EndpointsKeeper | None = None  # --endpoints-file (endpoints.py)
        self._endpoints_dirty = False
        self._need_tick = False
        self.admin_gid: int | None = None
        self.next_liveness = 0.0  # when each periodic timer is due next (monotonic)
        self.next_watchdog = 0.0
        self.next_status = 0.0

    # ---- setup / teardown -----------------------------------------------------------
    def start(self) -> None:
        prepare_run_dir(self.run_dir)
        if self.cfg.admin_group:
            self.admin_gid = group_id(self.cfg.admin_group, "admin group")
        open_sockets(self.cfg, self.run_dir, self.sockets)
        self._start_endpoints()
        assert self.sockets.router is not None and self.sockets.listener is not None
        cfg, a = self.cfg, self.arbiter
        self.control = Control(self.sockets.router, a.counters, self.receive, cfg.burst,
                               cfg.drain_slice)
        self.sessions = FdSessions(self.sockets.listener, cfg, self.devices, self.pool,
                                   self.fdwatch,
                                   self.fdsend, self.drop, self.handle, self.control.refuse,
                                   self.admin_gid)
        self.fdwatch.add_socket(self.control.router)
        self.fdwatch.watch(self.sessions.listener.fileno(), self.sessions.accept)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.fdwatch.watch(self._wake_r, self._on_signal_pipe)
        # counters, event log, /metrics if configured
        # one event log for every device (one seq order); one exporter (the first
        # device's) with every device's metrics
        events = EventLog(size=cfg.event_ring)
        self.observers = [observe.attach(s.arbiter, self.fdwatch, self.reply, metrics_off(cfg),
                                         events=events)
                          for s in self.devices if s.arbiter is not a]
        self.observer = observe.attach(a, self.fdwatch, self.reply, cfg, self.observers,
                                       events=events)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        for s in self.devices:
            log.info("serving %s: backend %s device %d, page %s, budget %s (%d pages), "
                     "warm %s..%s", self.run_dir, s.backend.name, s.device,
                     format_size(s.pool.page_size), format_size(s.budget),
                     s.pool.budget_pages, format_size(s.pool.warm_min * s.pool.page_size),
                     format_size(s.pool.warm_max * s.pool.page_size))
        for name in self.cfg.unbound_names():
            log.warning("tenant name %r is configured without uids or group: only the "
                        "daemon's own uid (%d) may register it; list uids = [...] (or a "
                        "group) in [tenants.%s] to admit others", name, os.getuid(), name)
        self.devices.begin_recovery(self.state, self.cfg.recover_timeout_s)
        raise_fd_limit()
        self.notifier.ready(self.status_line())

    def _start_endpoints(self) -> None:
        """``endpoints_file``: written at once (empty), a StartupError of one line when
        it cannot be."""
        cfg = self.cfg
        if cfg.endpoints_file is None:
            return
        keeper = EndpointsKeeper(Path(cfg.endpoints_file),
                                 advertised_address("", cfg.endpoints_address),
                                 cfg.endpoints_namespace)
        try:
            keeper.start()
        except EndpointsFileError as e:
            raise StartupError(str(e)) from None
        self.endpoints = keeper
        log.info("keeping the endpoints file %s (address %s)", cfg.endpoints_file,
                 keeper.address)

    def update_endpoints(self) -> None:
        """(timer pass) The endpoints file, when a register, a state or a session's end
        may have changed it."""
        if self.endpoints is None or not self._endpoints_dirty:
            return
        self._endpoints_dirty = False
        devices = self.devices
        self.endpoints.update(
            devices.tenants,
            lambda t: devices.arbiter_of(t).sleep.record(t).state == "asleep")

    def _save_state(self) -> None:
        self.devices.save_state(self.state)  # (every device's; gangs are not adopted)
        self._state_dirty = False

    def save_state_if_changed(self) -> None:
        if self._state_dirty:
            self._save_state()

    def tick_soon(self) -> None:
        """Run the arbiter's tick at the end of this loop turn."""
        self._need_tick = True

    def shutdown(self, clean: bool = True) -> None:
        """Close everything. ``state.json`` (the restart state) is removed only after a
        clean, requested stop with no tenant left; otherwise the next daemon waits for
        the tenants to re-adopt what they still map."""
        self.notifier.stopping()
        if self.endpoints is not None:
            self.endpoints.close()  # no endpoint left
        self.observer.close()
        for obs in self.observers:
            obs.close()
        # tenants keep their mapped pages across a stop too: while any is left, the next
        # daemon must recover them (Adopt is accepted only then), clean stop or not
        keep = not clean or any(t.arbitrated for t in self.devices.tenants)
        if keep:
            self._save_state()
        for t in list(self.devices.tenants):
            self.drop(t, "daemon shutting down")
        if not keep:
            self.state.remove()
        self.fdwatch.remove_socket(self.control.router)
        self.sockets.close()
        signal.set_wakeup_fd(-1)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.devices.close()
        self.notifier.close()
        log.info("stopped")

    def _abort_start(self) -> None:
        """Undo a partial start (never touching another daemon's sockets)."""
        if self.endpoints is not None:
            self.endpoints.close()
        self.sockets.close()
        self.devices.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop = True

    def _on_signal_pipe(self, fd: int, ev: int = 0) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(fd, 512)

    def stop(self) -> None:
        """End the loop after this turn (a clean, requested stop)."""
        self._stop = True

    # ---- loop -----------------------------------------------------------------------
    def serve(self) -> None:
        try:
            self.start()
        except BaseException:
            self._abort_start()
            raise
        clean = False
        try:
            while not self._stop:
                self.turn()
            clean = True
        finally:
            self.shutdown(clean)

    def turn(self) -> None:
        """One loop iteration: wait for input (or not, when idle work is pending).

        A handler that raises drops the tenant whose socket it served (never the daemon).
        Control messages are looked at again every ``interleave`` fd-channel events, so a
        flood of connections or hang-ups does not hold up the tenants' requests."""
        pools = [s.pool for s in self.devices]
        busy = any(pool.has_work() for pool in pools) or self.control.discard is not None
        wait_s = 0.0 if busy else max(0.0, self.next_due() - time.monotonic())
        events = self.fdwatch.poll(int(wait_s * 1000))  # (pyzmq truncates float ms alike)
        every = self.cfg.interleave
        for i, (item, ev) in enumerate(events):
            if item is self.control.router:
                self._guard(None, self.control.read)
                continue
            handler = self.fdwatch.handler(item)
            if handler is not None:
                self._guard(item, handler, item, ev)
            if i % every == every - 1 and self.control.readable:
                self._guard(None, self.control.read)
        if self._need_tick:
            self._need_tick = False
            self.tick()
        self._guard(None, self.run_timers)
        if busy and not events:
            for pool in pools:
                if pool.has_work() and pool.maintain(self.cfg.idle_work_s):
                    self.tick_soon()  # retained pages went: waiting grants may fit now

    def _guard(self, fd: int | None, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn``; an unexpected exception drops the tenant behind ``fd`` (if any)."""
        began = time.monotonic()
        try:
            fn(*args)
        except Exception as e:  # a bug must not stop the daemon
            self.arbiter.counters.errors += 1
            t = self._tenant_of_fd(fd) if fd is not None else None
            log.exception("handling %s failed", f"tenant {t.id}" if t else f"fd {fd}"
                          if fd is not None else "the loop step")
            if t is not None:
                self.drop(t, f"internal error: {type(e).__name__}: {e}")
            elif fd is not None and fd not in (self.sessions.listener.fileno(), self._wake_r):
                self.fdwatch.unwatch(fd)
        finally:
            took = time.monotonic() - began
            if took >= SLOW_STEP_S:  # every request behind it waited as long
                log.warning("the event loop was held %.1f s by %s", took,
                            getattr(fn, "__qualname__", repr(fn)))

    def _tenant_of_fd(self, fd: int) -> TenantRecord | None:
        t = self.devices.tenants.by_fileno.get(fd)
        if t is None:
            t = next((x for x in self.devices.tenants if x.pidfd == fd), None)
        return t

    # ---- timers -----------------------------------------------------------------------
    def next_due(self) -> float:
        """The monotonic time the loop must wake at, at the latest."""
        times = [self.next_liveness, self.next_watchdog, self.next_status]
        stuck = self.fdsend.next_deadline()
        parked = self.sessions.next_deadline()
        times += [x for x in (stuck, parked) if x is not None]
        t = min(times)
        for d in self._deadlines():
            t = min(t, d + 0.001)
        return t

    def _deadlines(self) -> list[float]:
        """Every device's arbiter deadline, and the gangs' (waiting parts)."""
        ds = [s.arbiter.next_deadline() for s in self.devices] + [self.gangs.next_deadline()]
        return [d for d in ds if d is not None]

    def run_timers(self) -> None:
        """Whatever is due now."""
        now = time.monotonic()
        if any(now >= d for d in self._deadlines()):
            self.tick()
        self.fdsend.expire(now)
        self.sessions.expire(now)
        self.save_state_if_changed()
        self.update_endpoints()
        if now >= self.next_liveness:
            self.next_liveness = now + self.cfg.liveness_s
            self.sessions.check_liveness(now)
            if any([s.pool.recheck_retained() for s in self.devices]):  # kept pages gone
                self.tick_soon()  # waiting grants may fit now (a pass goes on when idle)
        if now >= self.next_watchdog:
            interval = self.notifier.watchdog_interval
            self.next_watchdog = now + (interval or NO_WATCHDOG_S)
            if interval:
                self.notifier.watchdog()
        if now >= self.next_status:
            self.next_status = now + self.cfg.status_interval_s
            self.notifier.status(self.status_line())

    def status_line(self) -> str:
        return f"{len(self.devices.tenants)} tenants; " + "; ".join(
            f"device {s.device}: {format_size(s.pool.granted * s.pool.page_size)} granted of "
            f"{format_size(s.budget)}, {len(s.pool.warm)} warm pages" for s in self.devices)

    # ---- requests -------------------------------------------------------------------
    def receive(self, identity: bytes, envelope: list[bytes], req: p.Request) -> None:
        """A decoded request: ``BUSY`` while the session's previous one is still being
        served (descriptors queued, or an Adopt parked), parked when it is an Adopt
        whose descriptors are not all in, handled otherwise."""
        t = self._session(identity, req)
        if t is not None and (t.id in self.sessions.parked or self.fdsend.busy(t)):
            self.control.refuse(envelope, req.id, p.BUSY, "the previous request of this "
                                "session is still being served (its descriptors)")
            return
        if isinstance(req, p.Adopt) and t is not None and \
                self.sessions.park(identity, envelope, req, t):
            return
        self.handle(identity, envelope, req, t)

    def _session(self, identity: bytes, req: p.Request) -> TenantRecord | None:
        """The registered session ``req`` speaks for from ``identity``, if any."""
        t = self.devices.tenants.by_token.get(req.token) if req.token else None
        if t is None or not t.registered or t.identity != identity:
            return None
        return t

    def handle(self, identity: bytes, envelope: list[bytes], req: p.Request,
               t: TenantRecord | None) -> None:
        uid = t.uid if t is not None else None
        sender = self.devices.tenants.by_token.get(req.token) if req.token else None
        why = self.devices.route(sender, req)  # a Register names the session's device
        if why is not None:
            self.arbiter.counters.errors += 1
            self.control.reply(envelope, p.error(req.id, p.NOT_FOUND, why))
            return
        began = time.monotonic()
        try:
            if isinstance(req, p.Adopt) and t is not None:
                self.sessions.take_stash(t, req.id)
            out = self.devices.arbiter_of(sender).handle(identity, req, envelope)
            took = time.monotonic() - began
            if took >= SLOW_STEP_S:
                log.warning("a %s request took %.1f s to handle", type(req).__name__, took)
        except Exception as e:  # a bug must not stop the daemon
            log.exception("request %s failed", type(req).__name__)
            self.arbiter.counters.errors += 1
            self.control.reply(envelope, p.error(req.id, p.INTERNAL, f"{type(e).__name__}: {e}"))
            return
        if not out.deferred:
            self.fdsend.emit(envelope, req.id, out)
        if isinstance(req, (p.Register, p.CreateGroup, p.Adopt)) and out.reply is not None \
                and out.reply.ok:
            self._state_dirty = True
        if isinstance(req, (p.Register, p.TenantState, p.SleepTenant, p.Bye)):
            self._endpoints_dirty = True
        if out.stop:
            if uid is None and out.tenant is not None:
                uid = out.tenant.uid
            log.info("shutdown requested by uid %s", uid if uid is not None else "unknown")
            self.stop()
        self.tick()

    def tick(self) -> None:
        """Answer waiting requests that are done (every device's, the gangs' parts),
        then send queued reclaim asks and gang notices. Each device's step and each
        answer runs on its own (:meth:`_guard`): a bug in one loses no other device's
        answers (and ``Arbiter.tick`` answers the waiters its own step took)."""
        self._guard(None, self.gangs.expire, time.monotonic())
        for s in self.devices:
            self._guard(None, lambda a=s.arbiter: self._emit(a.tick()))
        self._guard(None, self._emit_gang_parts)
        queued = [m for s in self.devices for m in s.arbiter.take_outbox()]
        for identity, msg in queued + self.gangs.outbox.take():
            self.control.reply([identity], msg)

    def _emit_gang_parts(self) -> None:
        ready = self.gangs.take_ready()  # gang parts answered (every rank's, or late)
        self._emit(ready)
        for s in self.devices:
            mine = [o for o in ready if o.tenant is not None and o.tenant.device == s.device]
            if mine:
                s.arbiter.observed(mine)

    def _emit(self, outs: list[Outcome]) -> None:
        """Send each answer (its descriptors first), each on its own."""
        for out in outs:
            self._guard(None, self._emit_one, out)

    def _emit_one(self, out: Outcome) -> None:
        assert out.envelope is not None and out.reply is not None
        self.fdsend.emit(out.envelope, out.reply.id, out)

    def drop(self, t: TenantRecord, why: str) -> None:
        """End ``t``'s session: its memory returns, its sockets and pidfd close."""
        if t.id not in self.devices.tenants.by_id:
            return
        fileno = t.conn.fileno()
        self.fdsend.forget(t)
        self.sessions.forget(t)
        self.devices.drop(t, why)
        fdchannel.close_all(t.inbox + [fd for _, fds in t.stash for fd in fds])
        t.inbox, t.stash = [], []
        if t.arbitrated:
            self._state_dirty = True
        self._endpoints_dirty = True
        self._need_tick = True
        if fileno >= 0:
            self.fdwatch.unwatch(fileno)
        t.conn.close()
        if t.pidfd is not None:
            self.fdwatch.unwatch(t.pidfd)
            with contextlib.suppress(OSError):
                os.close(t.pidfd)
            t.pidfd = None

    def reply(self, envelope: list[bytes], reply: p.Reply | bytes) -> None:
        """Send a reply on the control socket (never blocking)."""
        self.control.reply(envelope, reply)


def run(cfg: Config) -> None:
    Server(cfg).serve()

