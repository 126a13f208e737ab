"""A minimal sd_notify(3): readiness, status and watchdog pings for ``Type=notify``.

Sends datagrams to ``$NOTIFY_SOCKET`` (a path, or an abstract name written ``@name``).
Without that variable every call is a no-op, so the daemon runs the same outside
systemd. ``WATCHDOG_USEC`` (honoured only when ``WATCHDOG_PID`` is unset or ours) gives
the interval; the daemon pings at half of it.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping


class Notifier:
    def __init__(self, address: str | None = None, watchdog_usec: int | None = None):
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Notifier":
        env = os.environ if environ is None else environ
        usec = None
        raw = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if raw and (not pid or pid == str(os.getpid())):
            try:
                usec = int(raw) or None
            except ValueError:
                usec = None
        return cls(env.get("NOTIFY_SOCKET") or None, usec)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between ``WATCHDOG=1`` pings (half the configured timeout), or None."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def _target(self) -> str | bytes:
        assert self.address
        if self.address.startswith("@"):
            return b"\0" + self.address[1:].encode()
        return self.address

    def send(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; False when not under systemd or the
        send failed (notification is best effort and never stops the daemon)."""
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self._target())
            return True
        except OSError:
            return False

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *( [f"STATUS={status}"] if status else [] ), f"MAINPID={os.getpid()}")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
