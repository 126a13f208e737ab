"""The client's two channels to the daemon, and request/reply matching.

* a ZeroMQ DEALER on ``control.sock`` carries requests and replies (and the daemon's
  unsolicited messages, ``id`` 0);
* the SOCK_SEQPACKET fd channel on ``pages.sock`` brings page descriptors.

:meth:`Connection.call` sends one request and waits for the reply with the same id;
replies of other ids (a request that timed out earlier) are dropped, unsolicited
messages are queued for :meth:`Connection.poll`. One lock serialises calls, so any
thread may call; the daemon serialises requests anyway. For a grant, the daemon sends
the descriptors before the reply (see :mod:`kvpool.protocol`), so once ``Granted``
arrives the descriptors are read from the fd channel without waiting.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import threading
import time
from pathlib import Path

import zmq

from kvpool import fdchannel, paths
from kvpool import protocol as p
from kvpool.client_lib.errors import DaemonUnavailable, KvpoolError, from_reply

SLICE_S = 0.1  # while waiting for a reply, look for the daemon's death this often


class Connection:
    def __init__(self, run_dir: Path, timeout_s: float = 10.0, fd_channel: bool = True):
        self.run_dir = run_dir
        self.timeout_ms = int(timeout_s * 1000)
        self.hello: p.FdHello | None = None
        self.token = ""
        self.fdsock: socket.socket | None = None
        if fd_channel:
            try:
                self.fdsock = fdchannel.connect(str(paths.pages_path(run_dir)))
            except OSError as e:
                raise DaemonUnavailable(
                    p.INTERNAL, f"no kvpool daemon at {run_dir} ({e.strerror or e}); "
                    f"start one with `kvpool daemon --run-dir {run_dir}`"
                ) from None
            self.fdsock.settimeout(timeout_s)
            data = self.fdsock.recv(fdchannel.MAX_DATA)
            if not data:
                raise DaemonUnavailable(p.INTERNAL, "the daemon closed the fd channel")
            self.hello = p.decode_hello(data)
            if self.hello.version != p.VERSION:
                raise KvpoolError(p.VERSION_MISMATCH, f"daemon speaks protocol "
                                  f"{self.hello.version}, this client {p.VERSION}")
            self.token = self.hello.token
        if not paths.control_path(run_dir).exists():
            if self.fdsock is not None:
                self.fdsock.close()
            raise DaemonUnavailable(p.INTERNAL, f"no kvpool daemon at {run_dir} (no "
                                    f"{paths.CONTROL_SOCKET})")
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(paths.control_endpoint(run_dir))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._unsolicited: list[p.Reply] = []
        self.closed = False
        self.daemon_gone = False

    # ---- requests -----------------------------------------------------------------
    def call(self, req: p.Request, timeout_ms: int | None = None,
             fds_ahead: list[int] | None = None) -> tuple[p.Reply, list[int]]:
        """Send ``req``; returns ``(reply, fds)``. ``fds`` (only for grants) belong to the
        caller. Raises :class:`KvpoolError` for error replies (after closing any fds).
        ``fds_ahead`` (an Adopt's pages) go on the fd channel first, headed by the request
        id; the caller keeps (and closes) its descriptors."""
        req.token = self.token
        with self._lock:
            req.id = next(self._ids)
            if fds_ahead:
                if self.fdsock is None:
                    raise KvpoolError(p.BAD_REQUEST, "no fd channel to send descriptors on")
                for first in range(0, len(fds_ahead), fdchannel.MAX_FDS):
                    chunk = fds_ahead[first : first + fdchannel.MAX_FDS]
                    header = p.encode(p.FdHeader(req.id, len(fds_ahead), first))
                    fdchannel.send_fds(self.fdsock, header, chunk)
            self.sock.send(p.encode(req), copy=True)
            reply = self._wait(req.id, self.timeout_ms if timeout_ms is None else timeout_ms)
            fds: list[int] = []
            if isinstance(reply, p.Granted) and reply.nfds:
                fds = self._recv_fds(reply.id, reply.nfds)
            elif isinstance(reply, p.Error) and self.fdsock is not None:
                self._drain_fds()
        if isinstance(reply, p.Error):
            raise from_reply(reply)
        return reply, fds

    def _wait(self, id: int, timeout_ms: int) -> p.Reply:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if self.daemon_gone:
                raise DaemonUnavailable(p.INTERNAL, "the daemon closed the fd channel (it exited)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise DaemonUnavailable(p.BUSY, f"no reply from the daemon in {timeout_ms} ms")
            if not self.sock.poll(min(left, SLICE_S) * 1000):
                self._check_eof()
                continue
            msg = p.decode_reply(self.sock.recv())
            if msg.id == id:
                return msg
            if msg.id == 0:
                self._unsolicited.append(msg)
            # else: the late reply of a request that timed out; dropped

    def _check_eof(self) -> None:
        """Notice a dead daemon: its end of the fd channel reads EOF."""
        if self.fdsock is None or self.daemon_gone:
            return
        readable, _, _ = select.select([self.fdsock], [], [], 0)
        if readable:
            try:
                with contextlib.suppress(BlockingIOError):
                    self.fdsock.setblocking(False)
                    if self.fdsock.recv(1, socket.MSG_PEEK) == b"":
                        self.daemon_gone = True
            except OSError:
                self.daemon_gone = True
            finally:
                self.fdsock.settimeout(self.timeout_ms / 1000)

    def _recv_fds(self, id: int, total: int) -> list[int]:
        assert self.fdsock is not None
        out: list[int | None] = [None] * total
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
            fdchannel.close_all([fd for fd in out if fd is not None])
            raise
        return out  # type: ignore[return-value]

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
    def probe(self) -> bool:
        """Whether the daemon still holds our fd channel (False once it is gone)."""
        if self._lock.acquire(blocking=False):
            try:
                if not self.closed:
                    self._check_eof()
            finally:
                self._lock.release()
        return not self.daemon_gone

    def poll(self) -> list[p.Reply]:
        """Unsolicited messages (``id`` 0) received so far, without blocking."""
        with self._lock:
            if self.closed:
                return []
            while self.sock.poll(0):
                msg = p.decode_reply(self.sock.recv())
                if msg.id == 0:
                    self._unsolicited.append(msg)
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

    def _drain_fds_quietly(self) -> None:
        with contextlib.suppress(OSError):
            self._drain_fds()
