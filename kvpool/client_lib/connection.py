"""The client's two channels to the daemon, and request/reply matching.

* a ZeroMQ DEALER on ``control.sock`` carries requests and replies (and the daemon's
  unsolicited messages, ``id`` 0);
* the SOCK_SEQPACKET fd channel on ``pages.sock`` brings page descriptors.

:meth:`Connection.call` sends one request and waits for the reply with the same id;
replies of other ids (a request that timed out earlier) are dropped, unsolicited
messages are queued for :meth:`Connection.poll`.

Before anything is sent, the daemon is authenticated (``UntrustedDaemon`` otherwise):
the run directory must be owned by a trusted uid and writable by nobody else (so only
that uid can have created ``control.sock``), and the process behind ``pages.sock``
must run as a trusted uid (``SO_PEERCRED``): root, this process's uid, the ``kvpool``
system user, or ``$KVPOOL_DAEMON_UID`` (see :func:`kvpool.paths.trusted_daemon_uids`).
The listener behind ``control.sock`` is checked the same way with one plain connect,
which also tells a dead daemon (refused, missing) at once. One lock serialises calls, so any
thread may call; the daemon serialises requests anyway. For a grant, the daemon sends
the descriptors before the reply (see :mod:`kvpool.protocol`), so once ``Granted``
arrives the descriptors are read from the fd channel without waiting.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import socket
import stat
import threading
import time
from pathlib import Path
from typing import TypeVar, overload

import zmq

from kvpool import fdchannel, paths
from kvpool import protocol as p
from kvpool.client_lib.errors import DaemonUnavailable, KvpoolError, ProtocolError, from_reply

log = logging.getLogger("kvpool.client")

SLICE_S = 0.1  # while waiting for a reply, look for the daemon's death this often
MAX_HOLD_MS = 86_400_000  # a daemon's announced hold beyond a day is not believed
MAX_ABANDONED = 1024  # grants given up on that are remembered (their late replies)
R = TypeVar("R", bound=p.Reply)


class UntrustedDaemon(DaemonUnavailable):
    """Something other than a trusted daemon serves the run directory (``UNAUTHORIZED``)."""


def no_daemon(run_dir: Path, why: str = "") -> DaemonUnavailable:
    """No daemon serves ``run_dir``: one line that says so (``why``, when known) and what
    to do about it."""
    detail = f" ({why})" if why else ""
    return DaemonUnavailable(p.INTERNAL, f"no kvpool daemon at {run_dir}{detail}; start one "
                             f"with `kvpool daemon --run-dir {run_dir}`, or point "
                             f"--run-dir / KVPOOL_RUN_DIR at the one that runs")


def probe(run_dir: Path, timeout_s: float = 10.0) -> None:
    """Raise :class:`DaemonUnavailable` (:class:`UntrustedDaemon`) unless a trusted daemon
    listens at ``run_dir``; registers nothing (a command checks before it starts
    children that would each fail on their own)."""
    Connection._check_control_peer(run_dir, Connection._check_run_dir(run_dir), timeout_s)


class Connection:
    def __init__(self, run_dir: Path, timeout_s: float = 10.0, fd_channel: bool = True):
        self.run_dir = run_dir
        self.timeout_ms = int(timeout_s * 1000)
        self.hello: p.FdHello | None = None
        self.token = ""
        trusted = self._check_run_dir(run_dir)
        self._check_control_peer(run_dir, trusted, timeout_s)
        self.fdsock: socket.socket | None = None
        if fd_channel:
            self.fdsock = self._open_fd_channel(run_dir, trusted, timeout_s)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(paths.control_endpoint(run_dir))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._unsolicited: list[p.Reply] = []
        # grants this client stopped waiting for (an explicit timeout, a hung daemon):
        # should the daemon serve one after all, its units are given back (:meth:`_late`)
        self._abandoned: dict[int, p.Grant] = {}
        # What wait_message() sleeps on without the lock: the socket's ZMQ_FD (read only,
        # never a socket operation) and a pipe that says "look": written when a call()
        # queues an unsolicited message or leaves input behind, and by wake().
        self._zmq_fd = int(self.sock.getsockopt(zmq.FD))
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()  # wake() never writes to a closed pipe
        self.closed = False
        self.daemon_gone = False

    # ---- authenticating the daemon ------------------------------------------------------
    @staticmethod
    def _check_run_dir(run_dir: Path) -> set[int]:
        """The trusted uids, after checking the run directory and its control socket."""
        try:
            trusted = paths.trusted_daemon_uids()
        except ValueError as e:
            raise UntrustedDaemon(p.UNAUTHORIZED, str(e)) from None
        try:
            paths.check_daemon_dir(run_dir, trusted)
            control = os.lstat(paths.control_path(run_dir))
        except FileNotFoundError:
            raise no_daemon(run_dir) from None
        except paths.UnsafePath as e:
            raise UntrustedDaemon(p.UNAUTHORIZED, f"not trusting the daemon at {run_dir}: "
                                  f"{e} (set KVPOOL_DAEMON_UID to trust its owner)") from None
        except OSError as e:
            raise no_daemon(run_dir, e.strerror or str(e)) from None
        if not stat.S_ISSOCK(control.st_mode) or control.st_uid not in trusted:
            raise UntrustedDaemon(p.UNAUTHORIZED, f"not trusting the daemon at {run_dir}: "
                                  f"{paths.CONTROL_SOCKET} is not a socket of a trusted uid")
        return trusted

    @staticmethod
    def _check_control_peer(run_dir: Path, trusted: set[int], timeout_s: float) -> None:
        """Connect ``control.sock`` once as a plain stream socket: refused or missing means
        no daemon (said at once, not after a request timeout); otherwise the listening
        process's uid (``SO_PEERCRED``) must be trusted. ZeroMQ drops the probe silently."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.settimeout(timeout_s)
            probe.connect(str(paths.control_path(run_dir)))
            _, uid, _ = fdchannel.peer_credentials(probe)
        except (FileNotFoundError, ConnectionRefusedError):
            raise no_daemon(run_dir, f"nothing listens on {paths.CONTROL_SOCKET}") from None
        except OSError as e:
            raise no_daemon(run_dir, e.strerror or str(e)) from None
        finally:
            probe.close()
        if uid not in trusted:
            raise UntrustedDaemon(
                p.UNAUTHORIZED, f"not trusting the daemon at {run_dir}: the process serving "
                f"{paths.CONTROL_SOCKET} runs as uid {uid}, not "
                f"{', '.join(map(str, sorted(trusted)))} (set KVPOOL_DAEMON_UID to trust it)")

    def _open_fd_channel(self, run_dir: Path, trusted: set[int],
                         timeout_s: float) -> socket.socket:
        """Connect ``pages.sock``, check the peer's uid, read the daemon's hello."""
        try:
            sock = fdchannel.connect(str(paths.pages_path(run_dir)))
        except OSError as e:
            raise no_daemon(run_dir, e.strerror or str(e)) from None
        try:
            _, uid, _ = fdchannel.peer_credentials(sock)
            if uid not in trusted:
                raise UntrustedDaemon(
                    p.UNAUTHORIZED, f"not trusting the daemon at {run_dir}: the process "
                    f"serving {paths.PAGES_SOCKET} runs as uid {uid}, not "
                    f"{', '.join(map(str, sorted(trusted)))} (set KVPOOL_DAEMON_UID to "
                    f"trust it)")
            sock.settimeout(timeout_s)
            data = sock.recv(fdchannel.MAX_DATA)
            if not data:
                raise DaemonUnavailable(p.INTERNAL, "the daemon closed the fd channel")
            self.hello = p.decode_hello(data)
            if self.hello.version != p.VERSION:
                raise KvpoolError(p.VERSION_MISMATCH, f"daemon speaks protocol "
                                  f"{self.hello.version}, this client {p.VERSION}")
            if self.hello.error:  # refused (a session cap): the daemon says why
                raise KvpoolError(p.OVER_LIMIT, f"the daemon refused the session: "
                                                f"{self.hello.error}")
        except socket.timeout:
            sock.close()
            raise DaemonUnavailable(p.BUSY, f"the daemon at {run_dir} did not answer in "
                                    f"{timeout_s:g} s") from None
        except BaseException:
            sock.close()
            raise
        self.token = self.hello.token
        return sock

    # ---- requests -----------------------------------------------------------------
    @property
    def hold_ms(self) -> int:
        """How long the daemon may hold a request waiting for reclaim (its hello)."""
        if self.hello is None:
            return 0
        return min(max(self.hello.hold_ms, 0), MAX_HOLD_MS)

    @overload
    def call(self, req: p.Request, *, timeout_ms: int | None = None,
             fds_ahead: list[int] | None = None) -> tuple[p.Reply, list[int]]: ...

    @overload
    def call(self, req: p.Request, expect: type[R], *, timeout_ms: int | None = None,
             fds_ahead: list[int] | None = None) -> tuple[R, list[int]]: ...

    def call(self, req: p.Request, expect: type[p.Reply] = p.Reply, *,
             timeout_ms: int | None = None,
             fds_ahead: list[int] | None = None) -> tuple[p.Reply, list[int]]:
        """Send ``req``; returns ``(reply, fds)`` where ``reply`` is an ``expect``
        (``p.Reply``: any reply). ``fds`` (only for grants) belong to the caller.

        Raises :class:`KvpoolError` for error replies and :class:`ProtocolError` for a
        reply of another type (after closing any fds). ``fds_ahead`` (an Adopt's pages)
        go on the fd channel first, headed by the request id; the caller keeps (and
        closes) its descriptors.

        Without ``timeout_ms`` the wait is the connection's timeout plus the daemon's
        :attr:`hold_ms` (a grant it holds for reclaim is answered by then: never given
        up on while the daemon may still serve it). A grant given up on anyway is
        remembered: if it is served after all, its pages go back (:meth:`_late`)."""
        req.token = self.token
        with self._lock:
            req.id = next(self._ids)
            if fds_ahead:
                self._send_fds_ahead(req.id, fds_ahead)
            self.sock.send(p.encode(req), copy=True)
            wait_ms = self.timeout_ms + self.hold_ms if timeout_ms is None else timeout_ms
            try:
                reply = self._wait(req.id, wait_ms)
            except DaemonUnavailable:
                if isinstance(req, p.Grant) and not self.daemon_gone:
                    self._abandon(req)
                raise
            fds: list[int] = []
            if isinstance(reply, p.Granted) and reply.nfds:
                fds = self._recv_fds(reply.id, reply.nfds)
            elif isinstance(reply, p.Error) and self.fdsock is not None:
                self._drain_fds()
            if self._unsolicited or self.sock.poll(0):
                self.wake()  # poll() has something: ZMQ_FD may not say so again
        if isinstance(reply, p.Error):
            raise from_reply(reply)
        if not isinstance(reply, expect):
            fdchannel.close_all(fds)
            raise ProtocolError(p.INTERNAL, f"the daemon answered {type(req).__name__} with "
                                f"{type(reply).__name__}, expected {expect.__name__}")
        return reply, fds

    def _send_fds_ahead(self, id: int, fds: list[int]) -> None:
        if self.fdsock is None:
            raise KvpoolError(p.BAD_REQUEST, "no fd channel to send descriptors on")
        for first in range(0, len(fds), fdchannel.MAX_FDS):
            chunk = fds[first : first + fdchannel.MAX_FDS]
            header = p.encode(p.FdHeader(id, len(fds), first))
            fdchannel.send_fds(self.fdsock, header, chunk)

    def _wait(self, id: int, timeout_ms: int) -> p.Reply:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if self.daemon_gone:
                raise DaemonUnavailable(p.INTERNAL, "the daemon closed the fd channel (it exited)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise DaemonUnavailable(p.BUSY, f"no reply from the daemon in {timeout_ms} ms")
            if not self.sock.poll(max(1, int(min(left, SLICE_S) * 1000))):
                self._check_eof()
                continue
            msg = p.decode_reply(self.sock.recv())
            if msg.id == id:
                return msg
            if msg.id == 0:
                self._unsolicited.append(msg)
                self.wake()
            else:
                self._late(msg)

    def _abandon(self, req: p.Grant) -> None:
        """(lock held) Remember a grant whose reply this client stopped waiting for."""
        if len(self._abandoned) >= MAX_ABANDONED:
            self._abandoned.pop(next(iter(self._abandoned)))
        self._abandoned[req.id] = req

    def _late(self, msg: p.Reply) -> None:
        """(lock held) The reply of a request this client stopped waiting for. A grant
        served after all is given back at once: its descriptors are closed and its
        units released (the daemon would otherwise charge this tenant for pages it never
        mapped, and refuse those units as already granted). Anything else is dropped."""
        req = self._abandoned.pop(msg.id, None)
        if req is None or not isinstance(msg, p.Granted):
            return
        try:
            if msg.nfds and self.fdsock is not None:
                fdchannel.close_all(self._recv_fds(msg.id, msg.nfds))
        except (OSError, KvpoolError) as e:
            log.warning("the descriptors of a late grant did not arrive: %s", e)
        back = p.Release(group=msg.group, units=sorted(msg.units))
        back.token = self.token
        back.id = next(self._ids)  # its answer is a reply nobody waits for: dropped here
        self.sock.send(p.encode(back), copy=True)
        log.info("gave back %d unit(s) of group %d granted after the request timed out",
                 len(msg.units), msg.group)

    def _check_eof(self) -> None:
        """Notice a dead daemon: its end of the fd channel reads EOF."""
        if self.fdsock is None or self.daemon_gone:
            return
        poller = select.poll()  # poll: descriptors past 1024 are ordinary here
        poller.register(self.fdsock.fileno(), select.POLLIN)
        if not poller.poll(0):
            return  # nothing queued: the daemon is there
        try:
            if self.fdsock.recv(1, socket.MSG_PEEK) == b"":
                self.daemon_gone = True
        except (BlockingIOError, InterruptedError, socket.timeout):
            pass
        except OSError:
            self.daemon_gone = True

    def _recv_fds(self, id: int, total: int) -> list[int]:
        assert self.fdsock is not None
        out: list[int] = [-1] * total
        got = 0
        try:
            while got < total:
                data, fds = fdchannel.recv_fds(self.fdsock)
                if not data:
                    raise DaemonUnavailable(p.INTERNAL, "the daemon closed the fd channel")
                hdr = p.decode_header(data)
                if hdr.id != id or hdr.first + len(fds) > total:
                    fdchannel.close_all(fds)  # leftovers of an abandoned grant
                    continue
                out[hdr.first : hdr.first + len(fds)] = fds
                got += len(fds)
        except BaseException:
            fdchannel.close_all([fd for fd in out if fd >= 0])
            raise
        return out

    def _drain_fds(self) -> None:
        """Close descriptors already queued for a grant that ended in an error."""
        assert self.fdsock is not None
        timeout = self.fdsock.gettimeout()
        self.fdsock.setblocking(False)
        try:
            while True:
                try:
                    data, fds = socket.recv_fds(self.fdsock, fdchannel.MAX_DATA,
                                                fdchannel.MAX_FDS)[:2]
                except (BlockingIOError, InterruptedError):
                    return
                fdchannel.close_all(fds)
                if not data:
                    return
        finally:
            self.fdsock.settimeout(timeout)

    # ---- unsolicited messages ---------------------------------------------------------
    def daemon_alive(self) -> bool:
        """Whether the daemon still holds our fd channel (looks now; False once it is
        gone, and then for good: see ``daemon_gone``)."""
        if self._lock.acquire(blocking=False):
            try:
                if not self.closed:
                    self._check_eof()
            finally:
                self._lock.release()
        return not self.daemon_gone

    def wait_message(self, timeout_s: float) -> None:
        """Sleep until a message may be there for :meth:`poll`, :meth:`wake` is called
        or ``timeout_s`` passes (wakes may be spurious; none is lost). Takes no lock and
        does no socket operation: ZMQ_FD is edge-triggered, readable when the socket has
        news after its last operation, and every call() leaves pending input signalled."""
        if self.closed:
            time.sleep(timeout_s)
            return
        poller = select.poll()
        poller.register(self._zmq_fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        poller.poll(max(0, int(timeout_s * 1000)))
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 64):
                pass

    def wake(self) -> None:
        """End a :meth:`wait_message` now (or make the next one return at once)."""
        with self._wake_lock, contextlib.suppress(BlockingIOError):  # full: one is pending
            if self._wake_w >= 0:
                os.write(self._wake_w, b"\0")

    def poll(self) -> list[p.Reply]:
        """Unsolicited messages (``id`` 0) received so far, without blocking."""
        with self._lock:
            if self.closed:
                return []
            while self.sock.poll(0):
                msg = p.decode_reply(self.sock.recv())
                if msg.id == 0:
                    self._unsolicited.append(msg)
                else:
                    self._late(msg)
            out, self._unsolicited = self._unsolicited, []
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self._lock:
            self.sock.close(linger=0)
            if self.fdsock is not None:
                self._drain_fds_quietly()
                self.fdsock.close()
            with self._wake_lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = -1

    def _drain_fds_quietly(self) -> None:
        with contextlib.suppress(OSError):
            self._drain_fds()
