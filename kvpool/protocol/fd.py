"""Messages of the fd channel (``$RUN_DIR/pages.sock``): the hello the daemon sends on
accept, and the header of each descriptor message."""

from __future__ import annotations

from msgspec import Struct


class FdHello(Struct, array_like=True):
    """First message on a new fd-channel connection (no descriptors): the session token,
    the first device's backend and page size, the devices served, how long it may hold a
    request (``hold_ms``). A refused session (too many sessions) gets an empty ``token``
    and the reason in ``error``, then EOF."""

    version: int
    token: str
    backend: str
    device: int
    page_size: int
    error: str = ""
    devices: list[int] = []  # every device the daemon serves (``device`` is the first)
    # the longest the daemon holds a request waiting for reclaim (its reclaim deadline):
    # a client waits that long beyond its own timeout rather than abandon a grant the
    # daemon may still serve (0: an older daemon that does not say)
    hold_ms: int = 0


class FdHeader(Struct, array_like=True):
    """Heads each descriptor message of a grant: ``first`` is the index of this
    message's first fd among the grant's ``total``."""

    id: int
    total: int
    first: int
