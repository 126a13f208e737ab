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
from typing import Callable, Optional, Protocol

import psutil
import zmq

from kvpool import fdchannel
from kvpool import protocol as p
from kvpool.daemon import fdqueue
from kvpool.daemon.auth import is_admin, peer_groups
from kvpool.daemon.config import Config
from kvpool.daemon.fdsend import Drop, FdSender
from kvpool.daemon.fdwatch import FdWatch
from kvpool.daemon.outcome import Fail
from kvpool.daemon.pool import Pool
from kvpool.daemon.tenants import TenantRecord, Tenants

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


class SessionBook(Protocol):
    """The sessions' records (the arbiter): opened here at accept, looked up by the fd
    they arrive on."""

    tenants: Tenants

    @property
    def served(self) -> list[int]:
        """Every device served (named in each hello)."""

    def open_session(self, conn: socket.socket, pid: int, uid: int, gid: int,
                     pidfd: int | None) -> TenantRecord:
        """A record for a new connection; raises ``Fail`` past a session cap."""

    def drop(self, t: TenantRecord, why: str) -> None:
        """Forget ``t`` (its memory returns); closes none of its descriptors."""


# (identity, envelope, request, the session it speaks for): serve a request (Server.handle)
Handle = Callable[[bytes, list[bytes], p.Request, Optional[TenantRecord]], None]
# (envelope, request id, code, message): an error reply the arbiter never saw (Control.refuse)
Refuse = Callable[[list[bytes], int, str, str], None]


class FdSessions:
    """The fd-channel sessions accepted on ``listener``, recorded in ``book``, their
    descriptors watched on ``fdwatch``; ``cfg`` gives the bursts, timeouts and
    ``admin_gid`` who is an admin. Outbound data goes through ``fdsend``; a session that
    ends is ``drop``-ped (``Server.drop``); a parked Adopt is served with ``handle`` or
    refused with ``refuse``. Hellos name ``pool``'s backend and page size."""

    def __init__(self, listener: socket.socket, cfg: Config, book: SessionBook, pool: Pool,
                 fdwatch: FdWatch, fdsend: FdSender, drop: Drop, handle: Handle,
                 refuse: Refuse, admin_gid: int | None):
        self.listener = listener
        self.cfg = cfg
        self.book = book
        self.tenants = book.tenants
        self.pool = pool
        self.fdwatch = fdwatch
        self.fdsend = fdsend
        self.drop = drop
        self.handle = handle
        self.refuse = refuse
        self.admin_gid = admin_gid
        self.parked: dict[int, fdqueue.Parked] = {}  # tenant id -> Adopt awaiting its fds
        self._refusal_logged = -1e9  # when a refused session was last logged
        self._refusals_quiet = 0  # refused sessions not logged since

    # ---- accept ---------------------------------------------------------------------
    def accept(self, fd: int, ev: int = 0) -> None:
        for _ in range(self.cfg.accept_burst):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accept failed: %s", e)
                return
            self.open(conn)

    def _hello(self, token: str, error: str = "") -> bytes:
        b = self.pool.backend
        return p.encode(p.FdHello(p.VERSION, token, b.name, b.device,
                                  self.pool.page_size, error=error, devices=self.book.served,
                                  hold_ms=int(self.cfg.reclaim_timeout_s * 1000)))

    def open(self, conn: socket.socket) -> None:
        """A new fd-channel session: non-blocking from the start, hello sent at once (a
        fresh socket's buffer is empty, so that send cannot find it full)."""
        pidfd = None
        pid = uid = -1
        try:
            conn.setblocking(False)
            pid, uid, gid = fdchannel.peer_credentials(conn)
            if pid > 0:
                with contextlib.suppress(OSError, AttributeError):
                    pidfd = os.pidfd_open(pid)
            t = self.book.open_session(conn, pid, uid, gid, pidfd)
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
            t.admin = is_admin(uid, t.peer_gids or peer_groups(pid, gid), self.admin_gid)
            conn.send(self._hello(t.token))
        except Exception as e:  # (OSError, or a bug)
            log.warning("fd-channel handshake failed: %s: %s", type(e).__name__, e)
            self.book.drop(t, "handshake failed")
            close_session(conn, pidfd)
            return
        self.fdwatch.watch(conn.fileno(), self.on_event)
        if pidfd is not None:
            self.fdwatch.watch(pidfd, self.on_pid_exit)
        log.debug("session %d opened for pid %d uid %d", t.id, pid, uid)

    def _log_refusal(self, pid: int, uid: int, e: Exception) -> None:
        """Log a refused session, at most once per ``refusal_log_interval_s`` (a flood
        must not become a flood of log lines): the count not logged comes with the next."""
        now = time.monotonic()
        if now - self._refusal_logged < self.cfg.refusal_log_interval_s:
            self._refusals_quiet += 1
            return
        more = f" ({self._refusals_quiet} more refused since the last line)" \
            if self._refusals_quiet else ""
        log.warning("session of pid %d uid %d refused: %s%s", pid, uid, e, more)
        self._refusal_logged, self._refusals_quiet = now, 0

    # ---- events -------------------------------------------------------------------
    def on_event(self, fd: int, ev: int) -> None:
        t = self.tenants.by_fileno.get(fd)
        if t is None:
            self.fdwatch.unwatch(fd)
            return
        if ev & zmq.POLLOUT:
            self.fdsend.flush(t)
        if ev & ~zmq.POLLOUT and t.id in self.tenants.by_id:
            self.read(t)

    def read(self, t: TenantRecord) -> None:
        """Up to ``burst`` messages from ``t``'s fd channel, without blocking:
        descriptors headed by a request id are stashed for an Adopt (at most the budget's
        page count, all tenants together), anything else is closed at once."""
        for _ in range(self.cfg.burst):
            try:
                data, fds = fdchannel.recv_fds(t.conn, maxfds=fdchannel.MAX_FDS)
            except (BlockingIOError, InterruptedError):
                break
            except fdchannel.FdChannelError:
                continue  # oversized junk: ignored (descriptors already closed)
            except OSError as e:
                self.drop(t, f"fd channel error: {e}")
                return
            if not data and not fds:
                self.drop(t, "fd channel closed")
                return
            rid = header_id(data) if fds else None
            if rid is None or not t.registered:
                fdchannel.close_all(fds)  # tenants send nothing else here: never keep their fds
                continue
            stashed = sum(fdqueue.stash_size(x.stash) for x in self.tenants)
            if stashed + len(fds) > self.pool.budget_pages:  # (per tenant and in all)
                fdchannel.close_all(fds)
                self.drop(t, "sent descriptors ahead of Adopts past the budget's page count")
                return
            t.stash.append((rid, fds))  # descriptors sent ahead of an Adopt
        if t.id in self.parked:
            self.unpark(t)

    def on_pid_exit(self, fd: int, ev: int = 0) -> None:
        for t in self.tenants:
            if t.pidfd == fd:
                self.drop(t, f"process {t.pid} exited")
                return
        self.fdwatch.unwatch(fd)

    def check_liveness(self, now: float) -> None:
        for t in list(self.tenants):
            if t.pidfd is None and t.pid > 0 and not psutil.pid_exists(t.pid):
                self.drop(t, f"process {t.pid} is gone")
            elif not t.registered and now - t.since > self.cfg.register_timeout_s:
                self.drop(t, "never registered")

    # ---- Adopt: descriptors sent ahead --------------------------------------------------
    def park(self, identity: bytes, envelope: list[bytes], req: p.Adopt,
             t: TenantRecord) -> bool:
        """Park ``req`` when its announced descriptors are not all in yet (True)."""
        if fdqueue.stashed(t.stash, req.id) >= req.nfds:
            return False
        self.parked[t.id] = fdqueue.Parked(identity, envelope, req,
                                           time.monotonic() + self.cfg.adopt_wait_s)
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
            self.refuse(parked.envelope, req.id, p.BAD_REQUEST,
                        f"adopt announced {req.nfds} descriptors, {have} arrived in "
                        f"{self.cfg.adopt_wait_s:g} s")
            return
        self.handle(parked.identity, parked.envelope, req, t)

    def next_deadline(self) -> float | None:
        return min((x.deadline for x in self.parked.values()), default=None)

    def expire(self, now: float) -> None:
        """Refuse (or, their descriptors in, handle) Adopts parked past their deadline."""
        for tid, parked in list(self.parked.items()):
            t = self.tenants.by_id.get(tid)
            if t is not None and now >= parked.deadline:
                self.unpark(t)

    def forget(self, t: TenantRecord) -> None:
        self.parked.pop(t.id, None)
