"""The event loop's poller: which descriptor is watched by whom.

One ``zmq.Poller`` (poll(2): no descriptor-number limit) over plain descriptors, each
with the handler the loop calls when it is ready (``handler(fd, poll events)``), plus
the ZeroMQ sockets the loop reads itself (the control ROUTER). Parts of the daemon that
own descriptors (fd-channel sessions, pidfds, the observer's wake pipe) watch and
unwatch them here; the loop (``Server.turn``) polls and dispatches.
"""

from __future__ import annotations

from typing import Any, Callable

import zmq

FdHandler = Callable[[int, int], None]  # (fd, poll events)


class FdWatch:
    def __init__(self) -> None:
        self.poller = zmq.Poller()
        self._handlers: dict[int, FdHandler] = {}  # fileno -> handler(fileno, events)

    def watch(self, fd: int, handler: FdHandler) -> None:
        """Call ``handler(fd, events)`` when ``fd`` is readable."""
        self._handlers[fd] = handler
        self.poller.register(fd, zmq.POLLIN)

    def unwatch(self, fd: int) -> None:
        if self._handlers.pop(fd, None) is not None:
            self.poller.unregister(fd)

    def want_write(self, fd: int, on: bool) -> None:
        """Also wake when ``fd`` is writable (``on``), or no longer (a watched fd only)."""
        if fd >= 0 and fd in self._handlers:
            self.poller.register(fd, zmq.POLLIN | (zmq.POLLOUT if on else 0))

    def handler(self, fd: int) -> FdHandler | None:
        return self._handlers.get(fd)

    def add_socket(self, sock: zmq.Socket[bytes]) -> None:
        """Poll a ZeroMQ socket the loop reads itself (no handler)."""
        self.poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock: zmq.Socket[bytes]) -> None:
        self.poller.unregister(sock)

    def poll(self, timeout_ms: int) -> list[tuple[Any, int]]:
        """Ready items: ``(fd or socket, events)``."""
        return self.poller.poll(timeout_ms)
