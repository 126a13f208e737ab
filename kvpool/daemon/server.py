"""The daemon's event loop: one thread, one ``zmq.Poller`` over

* the ROUTER control socket (``ipc://$RUN_DIR/control.sock``),
* the fd-channel listener (``$RUN_DIR/pages.sock``) and each tenant's connection,
* each tenant's pidfd (readable when the process exits),
* a self-pipe woken by SIGTERM/SIGINT,

plus timers (liveness, watchdog, status, reclaim deadlines) and idle work (scrubbing
released pages, keeping the warm pool between its bounds). Requests that wait for
reclaim are answered from :meth:`Arbiter.tick`, called after every message and at the
arbiter's next deadline: the loop never blocks on a tenant.

Restart: the daemon keeps ``state.json`` in the run directory (pids and names of its
tenants, the next group id). A new daemon that finds live pids there grants nothing until
those tenants have re-registered and adopted what they map (or ``recover_timeout_s``). Request logic lives in :mod:`kvpool.daemon.arbiter`;
this file only moves bytes and descriptors. Nothing a client sends can raise out of
the loop: bad frames get ``BAD_REQUEST``, handler bugs ``INTERNAL``.
"""

from __future__ import annotations

import contextlib
import grp
import json
import logging
import os
import select
import signal
import socket
import time

import psutil
import zmq

from kvpool import fdchannel, paths
from kvpool import protocol as p
from kvpool.daemon.arbiter import Arbiter, Outcome
from kvpool.daemon.auth import is_admin, peer_groups
from kvpool.daemon.config import Config
from kvpool.daemon.notify import Notifier
from kvpool.daemon.pool import Pool
from kvpool.daemon.tenants import Tenant
from kvpool.sizes import format_size, parse_size
from kvpool.vmm import open_backend

log = logging.getLogger("kvpool.daemon")

MAX_ZMQ_MESSAGE = 16 << 20  # larger frames make libzmq drop the peer (memory guard)
MAX_STASH = 1 << 16  # descriptors a tenant may send ahead of an Adopt
BURST = 64  # control messages handled per loop turn before looking at other sockets


class StartupError(RuntimeError):
    """The daemon cannot start (sockets, permissions, configuration)."""


class AlreadyRunning(StartupError):
    pass


class Server:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_dir = cfg.run_path
        page_size = parse_size(cfg.page_size) if cfg.page_size is not None else None
        self.backend = open_backend(cfg.backend, cfg.device, page_size)
        ps = self.backend.page_size
        _, total = self.backend.mem_info()
        budget_pages = parse_size(cfg.budget, total) // ps
        if budget_pages <= 0:
            raise ValueError(f"budget {cfg.budget!r} is smaller than one page ({format_size(ps)})")
        budget = budget_pages * ps
        self.pool = Pool(
            self.backend, budget_pages,
            warm_min=cfg.resolve_pages(cfg.warm_min, ps, budget),
            warm_max=cfg.resolve_pages(cfg.warm_max, ps, budget),
        )
        self.arbiter = Arbiter(cfg, self.pool, budget)
        self.notifier = Notifier.from_env()
        self._handles_are_fds = self.backend.name == "host"
        self._stop = False
        self._handlers: dict[int, object] = {}  # fileno -> callable(fileno)
        self._next_liveness = 0.0
        self._next_watchdog = 0.0
        self._next_status = 0.0
        self._state_dirty = False
        self._need_tick = False
        self.admin_gid: int | None = None

    # ---- setup / teardown -----------------------------------------------------------
    def start(self) -> None:
        try:
            paths.ensure_run_dir(self.run_dir)
            os.chmod(self.run_dir, 0o750)
        except OSError as e:
            raise StartupError(f"cannot create the run directory {self.run_dir}: {e}") from None
        if self.cfg.admin_group:
            try:
                self.admin_gid = grp.getgrnam(self.cfg.admin_group).gr_gid
            except KeyError:
                raise StartupError(f"admin group {self.cfg.admin_group!r} does not exist") from None
        pages_path = paths.pages_path(self.run_dir)
        with contextlib.suppress(OSError), fdchannel.connect(str(pages_path)):
            raise AlreadyRunning(f"a daemon already serves {self.run_dir}")
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_ZMQ_MESSAGE)
        self.router.setsockopt(zmq.SNDHWM, 10000)
        self.router.setsockopt(zmq.RCVHWM, 10000)
        control = paths.control_path(self.run_dir)
        with contextlib.suppress(FileNotFoundError):
            control.unlink()
        if self.cfg.socket_group:
            # The directory first, setgid: the sockets are born with the group, so no
            # client ever sees them (or the directory) owned by the wrong group.
            try:
                os.chown(self.run_dir, -1, grp.getgrnam(self.cfg.socket_group).gr_gid)
                os.chmod(self.run_dir, 0o2750)
            except (KeyError, OSError) as e:
                raise StartupError(f"cannot give the run directory to group "
                                   f"{self.cfg.socket_group!r}: {e}") from None
        try:
            self.router.bind(paths.control_endpoint(self.run_dir))
            self.listener = fdchannel.listen(str(pages_path), mode=self.cfg.socket_mode)
        except (zmq.ZMQError, OSError) as e:
            raise StartupError(f"cannot listen in {self.run_dir}: {e}") from None
        os.chmod(control, self.cfg.socket_mode)
        if self.cfg.socket_group:
            try:
                gid = grp.getgrnam(self.cfg.socket_group).gr_gid
                for path in (control, pages_path):
                    os.chown(path, -1, gid)
            except (KeyError, OSError) as e:
                raise StartupError(f"cannot give the sockets to group "
                                   f"{self.cfg.socket_group!r}: {e}") from None
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self._watch(self.listener.fileno(), self._accept)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._watch(self._wake_r, self._on_signal_pipe)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        log.info("serving %s: backend %s device %d, page %s, budget %s (%d pages), warm %d..%d",
                 self.run_dir, self.backend.name, self.backend.device,
                 format_size(self.pool.page_size), format_size(self.arbiter.budget),
                 self.pool.budget_pages, self.pool.warm_min, self.pool.warm_max)
        self._recover_state()
        raise_fd_limit()
        self.notifier.ready(self._status_line())

    # ---- restart state ----------------------------------------------------------------
    @property
    def _state_path(self):
        return self.run_dir / "state.json"

    def _recover_state(self) -> None:
        """Read the previous daemon's tenants: grants wait until the live ones adopted."""
        try:
            state = json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            return
        a = self.arbiter
        a._next_group = max(a._next_group, int(state.get("next_group", 1)))
        pids = {int(t["pid"]) for t in state.get("tenants", [])
                if int(t.get("pid", 0)) > 0 and psutil.pid_exists(int(t["pid"]))}
        pids.discard(os.getpid())
        if pids:
            a.recovering = True
            a.recover_pids = pids
            a.recover_until = time.monotonic() + self.cfg.recover_timeout_s
            log.info("recovering: waiting up to %gs for %d tenants of the previous daemon",
                     self.cfg.recover_timeout_s, len(pids))

    def _save_state(self) -> None:
        a = self.arbiter
        state = {"next_group": a._next_group, "tenants": [
            {"pid": t.pid, "name": t.name} for t in a.tenants if t.arbitrated]}
        tmp = self._state_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self._state_path)
        except OSError as e:
            log.warning("cannot save %s: %s", self._state_path, e)
        self._state_dirty = False

    def shutdown(self) -> None:
        self.notifier.stopping()
        for t in list(self.arbiter.tenants):
            self._drop(t, "daemon shutting down")
        with contextlib.suppress(OSError):
            self._state_path.unlink()
        self.poller.unregister(self.router)
        self.router.close(linger=0)
        self.ctx.term()
        self.listener.close()
        for path in (paths.control_path(self.run_dir), paths.pages_path(self.run_dir)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        signal.set_wakeup_fd(-1)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.pool.close()
        self.backend.close()
        self.notifier.close()
        log.info("stopped")

    def _abort_start(self) -> None:
        """Undo a partial start (never touching another daemon's sockets)."""
        router = getattr(self, "router", None)
        if router is not None:
            router.close(linger=0)
            self.ctx.term()
        listener = getattr(self, "listener", None)
        if listener is not None:
            listener.close()
            for path in (paths.control_path(self.run_dir), paths.pages_path(self.run_dir)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        self.pool.close()
        self.backend.close()

    def _on_signal(self, signum, frame) -> None:
        self._stop = True

    def _on_signal_pipe(self, fd: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(fd, 512)

    def _watch(self, fd: int, handler) -> None:
        self._handlers[fd] = handler
        self.poller.register(fd, zmq.POLLIN)

    def _unwatch(self, fd: int) -> None:
        if self._handlers.pop(fd, None) is not None:
            self.poller.unregister(fd)

    # ---- loop -----------------------------------------------------------------------
    def serve(self) -> None:
        try:
            self.start()
        except BaseException:
            self._abort_start()
            raise
        try:
            while not self._stop:
                self.turn()
        finally:
            self.shutdown()

    def turn(self) -> None:
        """One loop iteration: wait for input (or not, when idle work is pending)."""
        busy = self.pool.has_work()
        timeout_ms = 0 if busy else max(0.0, self._next_timer() - time.monotonic()) * 1000
        events = self.poller.poll(timeout_ms)
        for item, _ in events:
            if item is self.router:
                self._control()
            else:
                handler = self._handlers.get(item)
                if handler is not None:
                    handler(item)
        if self._need_tick:
            self._need_tick = False
            self._tick()
        self._timers()
        if busy and not events:
            self.pool.maintain(0.002)

    def _next_timer(self) -> float:
        t = min(self._next_liveness, self._next_watchdog, self._next_status)
        d = self.arbiter.next_deadline()
        return min(t, d + 0.001) if d is not None else t

    def _timers(self) -> None:
        now = time.monotonic()
        d = self.arbiter.next_deadline()
        if d is not None and now >= d:
            self._tick()
        if self._state_dirty:
            self._save_state()
        if now >= self._next_liveness:
            self._next_liveness = now + self.cfg.liveness_s
            self._check_liveness(now)
        if now >= self._next_watchdog:
            interval = self.notifier.watchdog_interval
            self._next_watchdog = now + (interval or 3600.0)
            if interval:
                self.notifier.watchdog()
        if now >= self._next_status:
            self._next_status = now + 5.0
            self.notifier.status(self._status_line())

    def _status_line(self) -> str:
        pool = self.pool
        return (f"{len(self.arbiter.tenants)} tenants; "
                f"{format_size(pool.granted * pool.page_size)} granted of "
                f"{format_size(self.arbiter.budget)}; {len(pool.warm)} warm pages")

    # ---- control socket -------------------------------------------------------------
    def _control(self) -> None:
        for _ in range(BURST):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._message(frames)

    def _message(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        envelope = [identity]
        if len(body) == 2 and body[0] == b"":  # a REQ socket's empty delimiter
            envelope.append(b"")
            body = body[1:]
        if len(body) != 1:
            self.arbiter.errors += 1
            self._reply(envelope, p.error(0, p.BAD_REQUEST, f"expected one frame, got {len(body)}"))
            return
        try:
            req = p.decode_request(body[0])
        except p.DecodeError as e:
            self.arbiter.requests += 1
            self.arbiter.errors += 1
            self._reply(envelope, p.error(e.id, e.code, str(e)))
            return
        try:
            if isinstance(req, p.Adopt):
                self._collect_fds(req)
            out = self.arbiter.handle(identity, req, envelope)
        except Exception as e:  # a bug must not stop the daemon
            log.exception("request %s failed", type(req).__name__)
            self.arbiter.errors += 1
            self._reply(envelope, p.error(req.id, p.INTERNAL, f"{type(e).__name__}: {e}"))
            return
        if not out.deferred:
            self._emit(envelope, req.id, out)
        if isinstance(req, (p.Register, p.CreateGroup, p.Adopt)) and out.reply is not None \
                and out.reply.ok:
            self._state_dirty = True
        if out.stop:
            log.info("shutdown requested by uid %d", out.tenant.uid if out.tenant else -1)
            self._stop = True
        self._tick()

    def _emit(self, envelope: list[bytes], req_id: int, out: Outcome) -> None:
        """Send one outcome: the grant's descriptors first, then the reply."""
        try:
            if out.send and not self._send_pages(out.tenant, req_id, out.send):
                self._reply(envelope, p.error(req_id, p.BUSY, "fd channel failed; session dropped"))
                return
        except Exception as e:  # a bug must not stop the daemon
            log.exception("sending pages failed")
            self.arbiter.errors += 1
            self._reply(envelope, p.error(req_id, p.INTERNAL, f"{type(e).__name__}: {e}"))
            return
        self._reply(envelope, out.reply)
        if out.end_session and out.tenant is not None:
            self._drop(out.tenant, "said bye")

    def _tick(self) -> None:
        """Answer waiting requests that are done, then send queued reclaim asks."""
        try:
            for out in self.arbiter.tick():
                self._emit(out.envelope, out.reply.id, out)
        except Exception:  # a bug must not stop the daemon
            log.exception("arbitration step failed")
        self._flush_outbox()

    def _collect_fds(self, req: p.Adopt) -> None:
        """Gather the descriptors an Adopt sent ahead on the sender's fd channel (some
        may already be stashed by :meth:`_conn_readable`) into ``t.inbox``."""
        t = self.arbiter.tenants.by_token.get(req.token)
        if t is None:
            return
        got = [fd for rid, fds in t.stash if rid == req.id for fd in fds]
        for rid, fds in t.stash:
            if rid != req.id:
                fdchannel.close_all(fds)
        t.stash = []
        deadline = time.monotonic() + 2.0
        try:
            while len(got) < req.nfds and time.monotonic() < deadline:
                data, fds = fdchannel.recv_fds(t.conn)
                if not data and not fds:
                    break
                if self._header_id(data) != req.id:
                    fdchannel.close_all(fds)
                    continue
                got.extend(fds)
        except OSError as e:
            log.warning("reading adopt descriptors of tenant %d: %s", t.id, e)
        t.inbox.extend(got)

    @staticmethod
    def _header_id(data: bytes) -> int | None:
        try:
            return p.decode_header(data).id
        except Exception:
            return None

    def _reply(self, envelope: list[bytes], reply: p.Reply) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart([*envelope, p.encode(reply)], zmq.NOBLOCK)

    def _flush_outbox(self) -> None:
        while self.arbiter.outbox:
            identity, msg = self.arbiter.outbox.pop(0)
            self._reply([identity], msg)

    def _send_pages(self, t: Tenant, req_id: int, pfns: list[int]) -> bool:
        """Pass the grant's descriptors (before the reply: the ordering rule)."""
        total = len(pfns)
        pages = self.pool.pages
        try:
            for first in range(0, total, fdchannel.MAX_FDS):
                chunk = pfns[first : first + fdchannel.MAX_FDS]
                header = p.encode(p.FdHeader(req_id, total, first))
                if self._handles_are_fds:
                    # host pages are memfds already: SCM_RIGHTS copies them, no dup needed
                    fdchannel.send_fds(t.conn, header, [pages[pfn].handle for pfn in chunk])
                    continue
                fds = [self.backend.export(pages[pfn]) for pfn in chunk]
                with fdchannel.closing(fds):
                    fdchannel.send_fds(t.conn, header, fds)
        except OSError as e:  # includes socket.timeout: the tenant stopped reading
            self._drop(t, f"fd channel send failed: {e}")
            return False
        return True

    # ---- fd channel -----------------------------------------------------------------
    def _accept(self, fd: int) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError as e:
            log.warning("accept failed: %s", e)
            return
        try:
            pid, uid, gid = fdchannel.peer_credentials(conn)
            pidfd = None
            if pid > 0:
                with contextlib.suppress(OSError, AttributeError):
                    pidfd = os.pidfd_open(pid)
            conn.settimeout(self.cfg.send_timeout_s)
            t = self.arbiter.open_session(conn, pid, uid, gid, pidfd)
            t.admin = is_admin(uid, peer_groups(pid, gid), self.admin_gid)
            hello = p.FdHello(p.VERSION, t.token, self.backend.name, self.backend.device,
                              self.pool.page_size)
            conn.send(p.encode(hello))
        except OSError as e:
            log.warning("fd-channel handshake failed: %s", e)
            conn.close()
            return
        self._watch(conn.fileno(), self._conn_readable)
        if pidfd is not None:
            self._watch(pidfd, self._pid_exited)
        log.debug("session %d opened for pid %d uid %d", t.id, pid, uid)

    def _conn_readable(self, fd: int) -> None:
        t = self.arbiter.tenants.by_fileno.get(fd)
        if t is None:
            self._unwatch(fd)
            return
        if not select.select([t.conn], [], [], 0)[0]:
            return  # already drained (an Adopt read its descriptors this turn)
        try:
            data, fds = fdchannel.recv_fds(t.conn, maxfds=fdchannel.MAX_FDS)
        except fdchannel.FdChannelError:
            return  # oversized junk: ignored (descriptors already closed)
        except (OSError, socket.timeout) as e:
            self._drop(t, f"fd channel error: {e}")
            return
        if not data and not fds:
            self._drop(t, "fd channel closed")
            return
        rid = self._header_id(data) if fds else None
        if rid is not None and t.registered and sum(len(f) for _, f in t.stash) + len(fds) <= MAX_STASH:
            t.stash.append((rid, fds))  # descriptors sent ahead of an Adopt
            return
        fdchannel.close_all(fds)  # tenants send nothing else here: never keep their fds

    def _pid_exited(self, fd: int) -> None:
        for t in self.arbiter.tenants:
            if t.pidfd == fd:
                self._drop(t, f"process {t.pid} exited")
                return
        self._unwatch(fd)

    def _check_liveness(self, now: float) -> None:
        for t in list(self.arbiter.tenants):
            if t.pidfd is None and t.pid > 0 and not psutil.pid_exists(t.pid):
                self._drop(t, f"process {t.pid} is gone")
            elif not t.registered and now - t.since > self.cfg.register_timeout_s:
                self._drop(t, "never registered")

    def _drop(self, t: Tenant, why: str) -> None:
        if t.id not in self.arbiter.tenants.by_id:
            return
        fileno = t.conn.fileno()
        self.arbiter.drop(t, why)
        fdchannel.close_all(t.inbox + [fd for _, fds in t.stash for fd in fds])
        t.inbox, t.stash = [], []
        if t.arbitrated:
            self._state_dirty = True
        self._need_tick = True
        if fileno >= 0:
            self._unwatch(fileno)
        t.conn.close()
        if t.pidfd is not None:
            self._unwatch(t.pidfd)
            with contextlib.suppress(OSError):
                os.close(t.pidfd)
            t.pidfd = None


def raise_fd_limit() -> None:
    """Host pages are descriptors: allow as many as the hard limit does."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(cfg: Config) -> None:
    Server(cfg).serve()
