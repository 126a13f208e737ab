"""The daemon's event loop: one thread, one ``zmq.Poller`` (poll(2), no descriptor-number
limit) over

* the ROUTER control socket (``ipc://$RUN_DIR/control.sock``),
* the fd-channel listener (``$RUN_DIR/pages.sock``) and each tenant's connection,
* each tenant's pidfd (readable when the process exits),
* a self-pipe woken by SIGTERM/SIGINT,

plus timers (liveness, watchdog, status, reclaim deadlines, full fd sockets, parked
Adopts) and idle work (scrubbing released pages, keeping the warm pool between its
bounds). Request logic lives in :mod:`kvpool.daemon.arbiter`; this file only moves
bytes and descriptors.

The loop never blocks on one peer:

* every fd-channel socket is non-blocking; a grant's descriptors go through the
  tenant's bounded queue (:class:`fdqueue.Outbound`), sent as the socket takes them
  (``POLLOUT``), and its reply leaves only after them (the ordering rule). While the
  queue is not empty the session's requests get ``BUSY``; a tenant whose socket stays
  full for ``send_timeout_s`` (or whose queue overflows) is dropped, its memory returned;
* inbound descriptors are stashed as they arrive (at most the budget's page count, all
  tenants together); an ``Adopt`` waits parked until its announced descriptors are all in, or is
  refused after :data:`fdqueue.ADOPT_WAIT_S`;
* control messages are read frame by frame: past :data:`MAX_FRAMES` one is refused and
  its rest discarded a slice per turn, never buffered;
* requests that wait for reclaim are answered from :meth:`Arbiter.tick`.

Nothing a client sends can raise out of the loop: bad frames get ``BAD_REQUEST``,
handler bugs ``INTERNAL``, and an unexpected exception while serving one peer's socket
drops that tenant, never the daemon.

Restart: the daemon keeps ``state.json`` in the run directory (pids and names of its
tenants, the next group id). A new daemon that finds live pids there grants nothing until
those tenants have re-registered and adopted what they map (or ``recover_timeout_s``).
The file is removed only on a clean, requested stop that leaves no tenant behind, never
on a crash path (a stopped daemon's tenants keep their pages and re-adopt them).
"""
from __future__ import annotations

import contextlib
import grp
import json
import logging
import os
import signal
import socket
import time

import psutil
import zmq

from kvpool import fdchannel, paths
from kvpool import protocol as p
from kvpool.daemon import fdqueue, observe
from kvpool.daemon.arbiter import Arbiter, Fail, Outcome
from kvpool.daemon.auth import is_admin, peer_groups
from kvpool.daemon.config import Config
from kvpool.daemon.notify import Notifier
from kvpool.daemon.pool import Pool
from kvpool.daemon.tenants import Tenant
from kvpool.sizes import format_size, parse_size
from kvpool.vmm import open_backend

log = logging.getLogger("kvpool.daemon")

MAX_ZMQ_MESSAGE = 2 * p.MAX_FRAME  # larger frames make libzmq drop the peer (memory guard)
MAX_FRAMES = 4  # frames of one control message: identity, [empty delimiter], body (+1 spare)
DRAIN_SLICE = 4096  # frames of a refused message discarded per loop turn
BURST = 64  # messages handled per socket per loop turn before looking at other sockets
ACCEPT_BURST = 8  # fd-channel connections accepted per loop turn
INTERLEAVE = 8  # fd-channel events handled between two looks at the control socket


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
        try:  # budget vs the device, tenants' min vs the budget (ConfigError)
            budget_pages = cfg.check_budget(total, ps) // ps
        except ValueError:
            self.backend.close()
            raise
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
        self._out: dict[int, fdqueue.Outbound] = {}  # tenant id -> fd messages still to send
        self._parked: dict[int, fdqueue.Parked] = {}  # tenant id -> Adopt awaiting its fds
        self._discard: list | None = None  # [identity, frames read] of a refused message
        self._refusal_logged = -1e9  # when a refused session was last logged
        self._refusals_quiet = 0  # refused sessions not logged since

    # ---- setup / teardown -----------------------------------------------------------
    def start(self) -> None:
        try:
            paths.ensure_run_dir(self.run_dir)
        except paths.UnsafePath as e:
            raise StartupError(f"refusing to serve: {e}") from None
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
        self.listener.setblocking(False)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self._watch(self.listener.fileno(), self._accept)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._watch(self._wake_r, self._on_signal_pipe)
        self.observer = observe.attach(self)  # counters, event log, /metrics if configured
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
            state = json.loads(paths.read_private(self._state_path))
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
            a.recover_names = {str(t.get("name", "")): int(t["pid"]) for t in state["tenants"]
                               if int(t.get("pid", 0)) in pids}
            a.recover_uids = {int(t["pid"]): int(t["uid"]) for t in state["tenants"]
                              if int(t.get("pid", 0)) in pids and "uid" in t}
            a.recover_until = time.monotonic() + self.cfg.recover_timeout_s
            log.info("recovering: waiting up to %gs for %d tenants of the previous daemon",
                     self.cfg.recover_timeout_s, len(pids))

    def _save_state(self) -> None:
        a = self.arbiter
        state = {"next_group": a._next_group, "tenants": [
            {"pid": t.pid, "uid": t.uid, "name": t.name} for t in a.tenants if t.arbitrated]}
        try:
            paths.write_private(self._state_path, json.dumps(state).encode())
        except OSError as e:
            log.warning("cannot save %s: %s", self._state_path, e)
        self._state_dirty = False

    def shutdown(self, clean: bool = True) -> None:
        """Close everything. ``state.json`` (the restart state) is removed only after a
        clean, requested stop with no tenant left; otherwise the next daemon waits for
        the tenants to re-adopt what they still map."""
        self.notifier.stopping()
        self.observer.close()
        # tenants keep their mapped pages across a stop too: while any is left, the next
        # daemon must recover them (Adopt is accepted only then), clean stop or not
        keep = not clean or any(t.arbitrated for t in self.arbiter.tenants)
        if keep:
            self._save_state()
        for t in list(self.arbiter.tenants):
            self._drop(t, "daemon shutting down")
        if not keep:
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

    def _on_signal_pipe(self, fd: int, ev: int = 0) -> None:
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
        Control messages are looked at again every :data:`INTERLEAVE` fd-channel events,
        so a flood of connections or hang-ups does not hold up the tenants' requests."""
        busy = self.pool.has_work() or self._discard is not None
        timeout_ms = 0 if busy else max(0.0, self._next_timer() - time.monotonic()) * 1000
        events = self.poller.poll(timeout_ms)
        for i, (item, ev) in enumerate(events):
            if item is self.router:
                self._guard(None, self._control)
                continue
            handler = self._handlers.get(item)
            if handler is not None:
                self._guard(item, handler, item, ev)
            if i % INTERLEAVE == INTERLEAVE - 1 and self.router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._guard(None, self._control)
        if self._need_tick:
            self._need_tick = False
            self._tick()
        self._guard(None, self._timers)
        if busy and not events:
            self.pool.maintain(0.002)

    def _guard(self, fd: int | None, fn, *args) -> None:
        """Run ``fn``; an unexpected exception drops the tenant behind ``fd`` (if any)."""
        try:
            fn(*args)
        except Exception as e:  # a bug must not stop the daemon
            self.arbiter.errors += 1
            t = self._tenant_of_fd(fd) if fd is not None else None
            log.exception("handling %s failed", f"tenant {t.id}" if t else f"fd {fd}"
                          if fd is not None else "the loop step")
            if t is not None:
                self._drop(t, f"internal error: {type(e).__name__}: {e}")
            elif fd is not None and fd not in (self.listener.fileno(), self._wake_r):
                self._unwatch(fd)

    def _tenant_of_fd(self, fd: int):
        t = self.arbiter.tenants.by_fileno.get(fd)
        if t is None:
            t = next((x for x in self.arbiter.tenants if x.pidfd == fd), None)
        return t

    def _next_timer(self) -> float:
        t = min(self._next_liveness, self._next_watchdog, self._next_status)
        for out in self._out.values():
            if out.stuck_since is not None:
                t = min(t, out.stuck_since + self.cfg.send_timeout_s)
        for parked in self._parked.values():
            t = min(t, parked.deadline)
        d = self.arbiter.next_deadline()
        return min(t, d + 0.001) if d is not None else t

    def _timers(self) -> None:
        now = time.monotonic()
        d = self.arbiter.next_deadline()
        if d is not None and now >= d:
            self._tick()
        self._expire(now)
        if self._state_dirty:
            self._save_state()
        if now >= self._next_liveness:
            self._next_liveness = now + self.cfg.liveness_s
            self._check_liveness(now)
            if self.pool.recheck_retained():  # released pages a tenant kept, now gone
                self._need_tick = True  # waiting grants may fit now
        if now >= self._next_watchdog:
            interval = self.notifier.watchdog_interval
            self._next_watchdog = now + (interval or 3600.0)
            if interval:
                self.notifier.watchdog()
        if now >= self._next_status:
            self._next_status = now + 5.0
            self.notifier.status(self._status_line())

    def _expire(self, now: float) -> None:
        """Drop tenants whose fd socket stayed full too long; refuse overdue Adopts."""
        for tid, out in list(self._out.items()):
            t = self.arbiter.tenants.by_id.get(tid)
            if t is not None and out.stuck_since is not None \
                    and now - out.stuck_since >= self.cfg.send_timeout_s:
                self._drop(t, f"fd channel full for {self.cfg.send_timeout_s:g} s "
                              f"({out.fds} descriptors queued)")
        for tid, parked in list(self._parked.items()):
            t = self.arbiter.tenants.by_id.get(tid)
            if t is not None and now >= parked.deadline:
                self._unpark(t)

    def _status_line(self) -> str:
        pool = self.pool
        return (f"{len(self.arbiter.tenants)} tenants; "
                f"{format_size(pool.granted * pool.page_size)} granted of "
                f"{format_size(self.arbiter.budget)}; {len(pool.warm)} warm pages")

    # ---- control socket -------------------------------------------------------------
    def _control(self) -> None:
        """Up to :data:`BURST` messages, read frame by frame: a message of more than
        :data:`MAX_FRAMES` frames is refused and its rest discarded unread, a slice per
        turn (never buffered whole)."""
        for _ in range(BURST):
            if self._discard is not None and not self._drain():
                return
            try:
                frames = self._recv_frames()
            except zmq.Again:
                return
            if frames is not None:
                self._message(frames)

    def _recv_frames(self) -> list[bytes] | None:
        frames = [self.router.recv(zmq.NOBLOCK)]
        while self.router.getsockopt(zmq.RCVMORE):
            if len(frames) == MAX_FRAMES:
                envelope = frames[:2] if frames[1] == b"" else frames[:1]
                self.arbiter.requests += 1
                self.arbiter.errors += 1
                self._reply(envelope, p.error(0, p.BAD_REQUEST,
                                              f"a message has at most {MAX_FRAMES - 1} frames"))
                self._discard = [frames[0], len(frames)]
                return None
            frames.append(self.router.recv(zmq.NOBLOCK))
        return frames

    def _drain(self) -> bool:
        """Discard up to :data:`DRAIN_SLICE` frames of a refused message; True once done."""
        for _ in range(DRAIN_SLICE):
            frame = self.router.recv(zmq.NOBLOCK, copy=False)  # (freed at once)
            self._discard[1] += 1
            if not frame.more:
                log.warning("discarded a control message of %d frames", self._discard[1])
                self._discard = None
                return True
        return False

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
        t = self._session(identity, req)
        if t is not None and (t.id in self._parked or self._out.get(t.id)):
            self.arbiter.requests += 1
            self.arbiter.errors += 1
            self._reply(envelope, p.error(req.id, p.BUSY, "the previous request of this "
                                          "session is still being served (its descriptors)"))
            return
        if isinstance(req, p.Adopt) and t is not None \
                and fdqueue.stashed(t.stash, req.id) < req.nfds:
            self._parked[t.id] = fdqueue.Parked(identity, envelope, req,
                                                time.monotonic() + fdqueue.ADOPT_WAIT_S)
            return
        self._handle(identity, envelope, req, t)

    def _session(self, identity: bytes, req: p.Request):
        """The registered session ``req`` speaks for from ``identity``, if any."""
        t = self.arbiter.tenants.by_token.get(req.token) if req.token else None
        if t is None or not t.registered or t.identity != identity:
            return None
        return t

    def _handle(self, identity: bytes, envelope: list[bytes], req: p.Request, t) -> None:
        uid = t.uid if t is not None else None
        try:
            if isinstance(req, p.Adopt) and t is not None:
                self._take_stash(t, req.id)
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
            if uid is None and out.tenant is not None:
                uid = out.tenant.uid
            log.info("shutdown requested by uid %s", uid if uid is not None else "unknown")
            self._stop = True
        self._tick()

    def _emit(self, envelope: list[bytes], req_id: int, out: Outcome) -> None:
        """Send one outcome: the grant's descriptors first (queued), then the reply."""
        t = out.tenant
        if t is not None and t.id in self.arbiter.tenants.by_id and (out.send or self._out.get(t.id)):
            q = self._out.setdefault(t.id, fdqueue.Outbound())
            total = len(out.send)
            for first in range(0, total, fdchannel.MAX_FDS):
                header = p.encode(p.FdHeader(req_id, total, first))
                q.push_fds(header, out.send[first : first + fdchannel.MAX_FDS])
            q.push_reply(envelope, p.encode(out.reply), out.end_session)
            if q.overflowing:
                self._drop(t, f"{q.fds} descriptors queued on its fd channel")
                return
            self._flush(t)
            return
        if out.send:  # the session ended while the grant waited: nothing to pair it with
            self._reply(envelope, p.error(req_id, p.BUSY, "the session was dropped"))
            return
        self._reply(envelope, out.reply)
        if out.end_session and t is not None:
            self._drop(t, "said bye")

    def _tick(self) -> None:
        """Answer waiting requests that are done, then send queued reclaim asks."""
        try:
            for out in self.arbiter.tick():
                self._emit(out.envelope, out.reply.id, out)
        except Exception:  # a bug must not stop the daemon
            log.exception("arbitration step failed")
        self._flush_outbox()

    # ---- adopt: descriptors sent ahead ------------------------------------------------
    def _take_stash(self, t: Tenant, rid: int) -> None:
        """Move the descriptors stashed for Adopt ``rid`` into ``t.inbox`` (the arbiter
        reads them there); close any others."""
        for r, fds in t.stash:
            if r == rid:
                t.inbox.extend(fds)
            else:
                fdchannel.close_all(fds)
        t.stash = []

    def _unpark(self, t: Tenant) -> None:
        """Handle ``t``'s parked Adopt if its descriptors are in, or refuse it once late."""
        parked = self._parked.get(t.id)
        if parked is None:
            return
        req = parked.req
        have = fdqueue.stashed(t.stash, req.id)
        if have < req.nfds and time.monotonic() < parked.deadline:
            return
        del self._parked[t.id]
        if have < req.nfds:
            self.arbiter.requests += 1
            self.arbiter.errors += 1
            self._take_stash(t, -1)  # closes them all
            self._reply(parked.envelope, p.error(req.id, p.BAD_REQUEST, f"adopt announced "
                        f"{req.nfds} descriptors, {have} arrived in {fdqueue.ADOPT_WAIT_S:g} s"))
            return
        self._handle(parked.identity, parked.envelope, req, t)

    @staticmethod
    def _header_id(data: bytes) -> int | None:
        try:
            return p.decode_header(data).id
        except Exception:
            return None

    def _reply(self, envelope: list[bytes], reply: p.Reply | bytes) -> None:
        frame = reply if isinstance(reply, bytes) else p.encode(reply)
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart([*envelope, frame], zmq.NOBLOCK)

    def _flush_outbox(self) -> None:
        while self.arbiter.outbox:
            identity, msg = self.arbiter.outbox.pop(0)
            self._reply([identity], msg)

    # ---- fd channel: outbound ----------------------------------------------------------
    def _flush(self, t: Tenant) -> None:
        """Send ``t``'s queued messages while its socket takes them (never blocking);
        wait for ``POLLOUT`` when it is full. Replies leave only after the descriptors
        queued before them (the ordering rule)."""
        q = self._out.get(t.id)
        while q:
            item = q.items[0]
            if isinstance(item, fdqueue.QueuedReply):
                q.pop()
                self._reply(item.envelope, item.frame)
                if item.end_session:
                    self._drop(t, "said bye")
                    return
                continue
            try:
                sent = self._send_message(t, item)
            except Exception as e:  # the socket failed, or exporting a page did (a bug)
                self._drop(t, f"fd channel send failed: {type(e).__name__}: {e}")
                return
            if not sent:
                if q.stuck_since is None:
                    q.stuck_since = time.monotonic()
                self._want_write(t.conn.fileno(), True)
                return
            q.pop()
        self._out.pop(t.id, None)
        self._want_write(t.conn.fileno(), False)

    def _send_message(self, t: Tenant, item: fdqueue.FdMessage) -> bool:
        """One fd message; False when the socket is full. Only pages ``t`` still owns
        are ever sent (a queued pfn it gave back meanwhile is a bug: the tenant drops)."""
        pages, owner = self.pool.pages, self.pool.owner
        if any(owner.get(pfn) != t.id for pfn in item.pfns):
            raise OSError("a queued page is no longer this tenant's")
        if self._handles_are_fds:
            # host pages are memfds already: SCM_RIGHTS copies them, no dup needed
            fds, owned = [pages[pfn].handle for pfn in item.pfns], False
        else:
            fds, owned = [self.backend.export(pages[pfn]) for pfn in item.pfns], True
        try:
            fdchannel.send_fds(t.conn, item.header, fds)
        except (BlockingIOError, InterruptedError):
            return False
        finally:
            if owned:
                fdchannel.close_all(fds)
        return True

    def _want_write(self, fd: int, on: bool) -> None:
        if fd >= 0 and fd in self._handlers:
            self.poller.register(fd, zmq.POLLIN | (zmq.POLLOUT if on else 0))

    # ---- fd channel: sessions and inbound ----------------------------------------------
    def _accept(self, fd: int, ev: int = 0) -> None:
        for _ in range(ACCEPT_BURST):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accept failed: %s", e)
                return
            self._open(conn)

    def _open(self, conn: socket.socket) -> None:
        """A new fd-channel session: non-blocking from the start, hello sent at once (a
        fresh socket's buffer is empty, so that send cannot find it full)."""
        pidfd = None
        try:
            conn.setblocking(False)
            pid, uid, gid = fdchannel.peer_credentials(conn)
            if pid > 0:
                with contextlib.suppress(OSError, AttributeError):
                    pidfd = os.pidfd_open(pid)
            t = self.arbiter.open_session(conn, pid, uid, gid, pidfd)
        except OSError as e:
            log.warning("fd-channel session failed: %s", e)
            self._close_session(conn, pidfd)
            return
        except Fail as e:  # a session cap: the peer reads why in its hello, then EOF
            self._log_refusal(pid, uid, e)
            with contextlib.suppress(OSError):
                conn.send(p.encode(p.FdHello(p.VERSION, "", self.backend.name,
                                             self.backend.device, self.pool.page_size,
                                             error=str(e))))
            self._close_session(conn, pidfd)
            return
        except Exception as e:  # a bug must not stop the daemon (nor leak the socket)
            log.exception("fd-channel session failed: %s", e)
            self._close_session(conn, pidfd)
            return
        try:
            t.admin = is_admin(uid, getattr(t, "peer_gids", None) or peer_groups(pid, gid),
                               self.admin_gid)
            conn.send(p.encode(p.FdHello(p.VERSION, t.token, self.backend.name,
                                         self.backend.device, self.pool.page_size)))
        except Exception as e:  # (OSError, or a bug)
            log.warning("fd-channel handshake failed: %s: %s", type(e).__name__, e)
            self.arbiter.drop(t, "handshake failed")
            self._close_session(conn, pidfd)
            return
        self._watch(conn.fileno(), self._conn_event)
        if pidfd is not None:
            self._watch(pidfd, self._pid_exited)
        log.debug("session %d opened for pid %d uid %d", t.id, pid, uid)

    def _log_refusal(self, pid: int, uid: int, e: Exception) -> None:
        """Log a refused session, at most once a second (a flood must not become a
        flood of log lines): the count of the ones not logged comes with the next."""
        now = time.monotonic()
        if now - self._refusal_logged < 1.0:
            self._refusals_quiet += 1
            return
        more = f" ({self._refusals_quiet} more refused since the last line)" \
            if self._refusals_quiet else ""
        log.warning("session of pid %d uid %d refused: %s%s", pid, uid, e, more)
        self._refusal_logged, self._refusals_quiet = now, 0

    @staticmethod
    def _close_session(conn: socket.socket, pidfd: int | None) -> None:
        conn.close()
        if pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(pidfd)

    def _conn_event(self, fd: int, ev: int) -> None:
        t = self.arbiter.tenants.by_fileno.get(fd)
        if t is None:
            self._unwatch(fd)
            return
        if ev & zmq.POLLOUT:
            self._flush(t)
        if ev & ~zmq.POLLOUT and t.id in self.arbiter.tenants.by_id:
            self._read(t)

    def _read(self, t: Tenant) -> None:
        """Up to :data:`BURST` messages from ``t``'s fd channel, without blocking:
        descriptors headed by a request id are stashed for an Adopt (at most the budget's
        page count, all tenants together), anything else is closed at once."""
        for _ in range(BURST):
            try:
                data, fds = fdchannel.recv_fds(t.conn, maxfds=fdchannel.MAX_FDS)
            except (BlockingIOError, InterruptedError):
                break
            except fdchannel.FdChannelError:
                continue  # oversized junk: ignored (descriptors already closed)
            except OSError as e:
                self._drop(t, f"fd channel error: {e}")
                return
            if not data and not fds:
                self._drop(t, "fd channel closed")
                return
            rid = self._header_id(data) if fds else None
            if rid is None or not t.registered:
                fdchannel.close_all(fds)  # tenants send nothing else here: never keep their fds
                continue
            stashed = sum(fdqueue.stash_size(x.stash) for x in self.arbiter.tenants)
            if stashed + len(fds) > self.pool.budget_pages:  # (per tenant and in all)
                fdchannel.close_all(fds)
                self._drop(t, "sent descriptors ahead of Adopts past the budget's page count")
                return
            t.stash.append((rid, fds))  # descriptors sent ahead of an Adopt
        if t.id in self._parked:
            self._unpark(t)

    def _pid_exited(self, fd: int, ev: int = 0) -> None:
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
        self._out.pop(t.id, None)
        self._parked.pop(t.id, None)
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
