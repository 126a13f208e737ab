"""Passing page file descriptors over a ``SOCK_SEQPACKET`` Unix socket (``SCM_RIGHTS``).

Message boundaries are kept by the socket type, so one message carries a small header
(``data``) plus up to :data:`MAX_FDS` descriptors. Received descriptors belong to the
receiver, which must close each one once used (an open page fd pins memory):
:func:`closing` makes that hard to forget.

On a non-blocking socket (the daemon's side is always one) :func:`send_fds` either
queues the whole message or raises ``BlockingIOError`` (a SEQPACKET record is sent
atomically), and :func:`recv_fds` raises ``BlockingIOError`` when nothing is waiting.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from typing import Iterator, Sequence

MAX_FDS = 253  # SCM_MAX_FD: the kernel refuses more descriptors in one message
MAX_DATA = 64 * 1024


class FdChannelError(OSError):
    """A message was malformed, truncated, or carried too many descriptors."""


def listen(path: str, mode: int = 0o660, backlog: int = 128) -> socket.socket:
    """Listen on a fresh SOCK_SEQPACKET socket at ``path`` (replacing a stale one).

    The socket is bound under a temporary name and renamed into place once it listens
    with its final mode, so whoever sees ``path`` can connect (no ECONNREFUSED window)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(tmp)
        os.chmod(tmp, mode)
        sock.listen(backlog)
        os.replace(tmp, path)
    except OSError:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return sock


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer as the kernel saw it at connect time (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def send_fds(sock: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    """Send ``data`` with ``fds`` as one message. The caller keeps (and closes) its fds."""
    if len(fds) > MAX_FDS:
        raise FdChannelError(f"send_fds: {len(fds)} descriptors exceed the limit of {MAX_FDS}")
    if len(data) > MAX_DATA:
        raise FdChannelError(f"send_fds: {len(data)} bytes of data exceed {MAX_DATA}")
    socket.send_fds(sock, [data or b"\0"], list(fds))


def send_fds_batched(sock: socket.socket, header: bytes, fds: Sequence[int]) -> int:
    """Send ``fds`` in as many messages as needed, each with ``header``; returns the count."""
    chunks = [fds[i : i + MAX_FDS] for i in range(0, len(fds), MAX_FDS)] or [[]]
    for chunk in chunks:
        send_fds(sock, header, chunk)
    return len(chunks)


def recv_fds(sock: socket.socket, maxfds: int = MAX_FDS) -> tuple[bytes, list[int]]:
    """Receive one message. Returns ``(b"", [])`` at EOF.

    Raises :class:`FdChannelError` (after closing whatever did arrive) when the kernel
    truncated the descriptors or the data (``MSG_CTRUNC`` / ``MSG_TRUNC``).
    """
    data, fds, flags, _ = socket.recv_fds(sock, MAX_DATA, maxfds)
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        close_all(fds)
        what = "descriptors" if flags & socket.MSG_CTRUNC else "data"
        raise FdChannelError(f"recv_fds: message {what} truncated (maxfds={maxfds})")
    return data, fds


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@contextlib.contextmanager
def closing(fds: Sequence[int]) -> Iterator[Sequence[int]]:
    """Close every fd in ``fds`` on exit, whatever happens inside."""
    try:
        yield fds
    finally:
        close_all(fds)
