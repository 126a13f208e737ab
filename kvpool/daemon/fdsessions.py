"""fd-channel sessions: accept, hello, inbound descriptors, and the end of a session.

A session is born when a process connects ``pages.sock``: the socket is non-blocking
from the start, the peer's pid/uid/gid come from ``SO_PEERCRED`` (never from what it
says), a pidfd watches its process, and the ``FdHello`` (session token, backend, page
size) is sent at once (a fresh socket's buffer cannot be full). A session past a cap is
told why in its hello and hung up on; refusals are logged at most once per
``refusal_log_interval_s``. EOF, a socket error, the pid's exit, a pid gone without a
pidfd, or never registering within ``register_timeout_s`` ends the session (the server
drops the tenant and its memory returns).

Inbound, tenants send only descriptors ahead of an ``Adopt`` (headed by its request
id): they are *stashed*, at most the budget's page count across all tenants; anything
else is closed at once. An Adopt whose announced descriptors are not all in yet is
*parked* (:class:`fdqueue.Parked`) and handled once they are, or refused after
``adopt_wait_s``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

import psutil
import zmq

from kvpool import fdchannel
from kvpool import protocol as p
from kvpool.daemon import fdqueue
from kvpool.daemon.auth import is_admin, peer_groups
from kvpool.daemon.outcome import Fail
from kvpool.daemon.tenants import TenantRecord

if TYPE_CHECKING:
    from kvpool.daemon.server import Server

log = logging.getLogger("kvpool.daemon")


def close_session(conn: socket.socket, pidfd: int | None) -> None:
    conn.close()
    if pidfd is not None:
        with contextlib.suppress(OSError):
            os.close(pidfd)


def header_id(data: bytes) -> int | None:
    try:
        return p.decode_header(data).id
    except Exception:
        return None


class FdSessions:
    def __init__(self, server: Server, listener: socket.socket):
        self.server = server
        self.listener = listener
        self.parked: dict[int, fdqueue.Parked] = {}  # tenant id -> Adopt awaiting its fds
        self._refusal_logged = -1e9  # when a refused session was last logged
        self._refusals_quiet = 0  # refused sessions not logged since

    # ---- accept ---------------------------------------------------------------------
    def accept(self, fd: int, ev: int = 0) -> None:
        for _ in range(self.server.cfg.accept_burst):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accept failed: %s", e)
                return
            self.open(conn)

    def _hello(self, token: str, error: str = "") -> bytes:
        b = self.server.backend
        return p.encode(p.FdHello(p.VERSION, token, b.name, b.device,
                                  self.server.pool.page_size, error=error))

    def open(self, conn: socket.socket) -> None:
        """A new fd-channel session: non-blocking from the start, hello sent at once (a
        fresh socket's buffer is empty, so that send cannot find it full)."""
        s = self.server
        pidfd = None
        pid = uid = -1
        try:
            conn.setblocking(False)
            pid, uid, gid = fdchannel.peer_credentials(conn)
            if pid > 0:
                with contextlib.suppress(OSError, AttributeError):
                    pidfd = os.pidfd_open(pid)
            t = s.arbiter.open_session(conn, pid, uid, gid, pidfd)
        except OSError as e:
            log.warning("fd-channel session failed: %s", e)
            close_session(conn, pidfd)
            return
        except Fail as e:  # a session cap: the peer reads why in its hello, then EOF
            self._log_refusal(pid, uid, e)
            with contextlib.suppress(OSError):
                conn.send(self._hello("", error=str(e)))
            close_session(conn, pidfd)
            return
        except Exception as e:  # a bug must not stop the daemon (nor leak the socket)
            log.exception("fd-channel session failed: %s", e)
            close_session(conn, pidfd)
            return
        try:
            t.admin = is_admin(uid, t.peer_gids or peer_groups(pid, gid), s.admin_gid)
            conn.send(self._hello(t.token))
        except Exception as e:  # (OSError, or a bug)
            log.warning("fd-channel handshake failed: %s: %s", type(e).__name__, e)
            s.arbiter.drop(t, "handshake failed")
            close_session(conn, pidfd)
            return
        s.watch(conn.fileno(), self.on_event)
        if pidfd is not None:
            s.watch(pidfd, self.on_pid_exit)
        log.debug("session %d opened for pid %d uid %d", t.id, pid, uid)

    def _log_refusal(self, pid: int, uid: int, e: Exception) -> None:
        """Log a refused session, at most once per ``refusal_log_interval_s`` (a flood
        must not become a flood of log lines): the count not logged comes with the next."""
        now = time.monotonic()
        if now - self._refusal_logged < self.server.cfg.refusal_log_interval_s:
            self._refusals_quiet += 1
            return
        more = f" ({self._refusals_quiet} more refused since the last line)" \
            if self._refusals_quiet else ""
        log.warning("session of pid %d uid %d refused: %s%s", pid, uid, e, more)
        self._refusal_logged, self._refusals_quiet = now, 0

    # ---- events -------------------------------------------------------------------
    def on_event(self, fd: int, ev: int) -> None:
        s = self.server
        t = s.arbiter.tenants.by_fileno.get(fd)
        if t is None:
            s.unwatch(fd)
            return
        if ev & zmq.POLLOUT:
            s.fdsend.flush(t)
        if ev & ~zmq.POLLOUT and t.id in s.arbiter.tenants.by_id:
            self.read(t)

    def read(self, t: TenantRecord) -> None:
        """Up to ``burst`` messages from ``t``'s fd channel, without blocking:
        descriptors headed by a request id are stashed for an Adopt (at most the budget's
        page count, all tenants together), anything else is closed at once."""
        s = self.server
        for _ in range(s.cfg.burst):
            try:
                data, fds = fdchannel.recv_fds(t.conn, maxfds=fdchannel.MAX_FDS)
            except (BlockingIOError, InterruptedError):
                break
            except fdchannel.FdChannelError:
                continue  # oversized junk: ignored (descriptors already closed)
            except OSError as e:
                s.drop(t, f"fd channel error: {e}")
                return
            if not data and not fds:
                s.drop(t, "fd channel closed")
                return
            rid = header_id(data) if fds else None
            if rid is None or not t.registered:
                fdchannel.close_all(fds)  # tenants send nothing else here: never keep their fds
                continue
            stashed = sum(fdqueue.stash_size(x.stash) for x in s.arbiter.tenants)
            if stashed + len(fds) > s.pool.budget_pages:  # (per tenant and in all)
                fdchannel.close_all(fds)
                s.drop(t, "sent descriptors ahead of Adopts past the budget's page count")
                return
            t.stash.append((rid, fds))  # descriptors sent ahead of an Adopt
        if t.id in self.parked:
            self.unpark(t)

    def on_pid_exit(self, fd: int, ev: int = 0) -> None:
        s = self.server
        for t in s.arbiter.tenants:
            if t.pidfd == fd:
                s.drop(t, f"process {t.pid} exited")
                return
        s.unwatch(fd)

    def check_liveness(self, now: float) -> None:
        s = self.server
        for t in list(s.arbiter.tenants):
            if t.pidfd is None and t.pid > 0 and not psutil.pid_exists(t.pid):
                s.drop(t, f"process {t.pid} is gone")
            elif not t.registered and now - t.since > s.cfg.register_timeout_s:
                s.drop(t, "never registered")

    # ---- Adopt: descriptors sent ahead --------------------------------------------------
    def park(self, identity: bytes, envelope: list[bytes], req: p.Adopt,
             t: TenantRecord) -> bool:
        """Park ``req`` when its announced descriptors are not all in yet (True)."""
        if fdqueue.stashed(t.stash, req.id) >= req.nfds:
            return False
        self.parked[t.id] = fdqueue.Parked(identity, envelope, req,
                                           time.monotonic() + self.server.cfg.adopt_wait_s)
        return True

    @staticmethod
    def take_stash(t: TenantRecord, rid: int) -> None:
        """Move the descriptors stashed for Adopt ``rid`` into ``t.inbox`` (the arbiter
        reads them there); close any others."""
        for r, fds in t.stash:
            if r == rid:
                t.inbox.extend(fds)
            else:
                fdchannel.close_all(fds)
        t.stash = []

    def unpark(self, t: TenantRecord) -> None:
        """Handle ``t``'s parked Adopt if its descriptors are in, or refuse it once late."""
        s = self.server
        parked = self.parked.get(t.id)
        if parked is None:
            return
        req = parked.req
        have = fdqueue.stashed(t.stash, req.id)
        if have < req.nfds and time.monotonic() < parked.deadline:
            return
        del self.parked[t.id]
        if have < req.nfds:
            self.take_stash(t, -1)  # closes them all
            s.control.refuse(parked.envelope, req.id, p.BAD_REQUEST,
                             f"adopt announced {req.nfds} descriptors, {have} arrived in "
                             f"{s.cfg.adopt_wait_s:g} s")
            return
        s.handle(parked.identity, parked.envelope, req, t)

    def next_deadline(self) -> float | None:
        return min((x.deadline for x in self.parked.values()), default=None)

    def expire(self, now: float) -> None:
        """Refuse (or, their descriptors in, handle) Adopts parked past their deadline."""
        for tid, parked in list(self.parked.items()):
            t = self.server.arbiter.tenants.by_id.get(tid)
            if t is not None and now >= parked.deadline:
                self.unpark(t)

    def forget(self, t: TenantRecord) -> None:
        self.parked.pop(t.id, None)
