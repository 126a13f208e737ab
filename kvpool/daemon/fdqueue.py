"""Per-tenant descriptor traffic the event loop keeps without ever blocking on a peer.

* :class:`Outbound` — what still has to go to one tenant, in order: fd messages of a
  grant (pfns, turned into descriptors only when sent) and the replies that must follow
  them (the ordering rule: a grant's descriptors are in the tenant's socket before its
  reply leaves). The server sends from the head while the socket takes it and waits
  for ``POLLOUT`` otherwise. The queue is bounded (``max_queued_fds``) and a tenant
  whose socket stays full for ``send_timeout_s`` is dropped.
* :class:`Parked` — an ``Adopt`` whose announced descriptors have not all arrived yet:
  it is handled once they have, or refused at its deadline (``adopt_wait_s``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Union

from kvpool import protocol as p

MAX_QUEUED_FDS = 1 << 17  # the default of Config.max_queued_fds


@dataclass
class FdMessage:
    header: bytes
    pfns: list[int]


@dataclass
class QueuedReply:
    envelope: list[bytes]
    frame: bytes
    end_session: bool = False


@dataclass
class Outbound:
    """Messages for one tenant's fd channel and the replies ordered behind them."""

    items: deque[Union[FdMessage, QueuedReply]] = field(default_factory=deque)
    fds: int = 0  # descriptors in ``items``
    stuck_since: float | None = None  # when the socket last refused a message
    limit: int = MAX_QUEUED_FDS  # more descriptors queued than this: the tenant is dropped

    def push_fds(self, header: bytes, pfns: list[int]) -> None:
        self.items.append(FdMessage(header, pfns))
        self.fds += len(pfns)

    def push_reply(self, envelope: list[bytes], frame: bytes, end_session: bool = False) -> None:
        self.items.append(QueuedReply(envelope, frame, end_session))

    def pop(self) -> Union[FdMessage, QueuedReply]:
        item = self.items.popleft()
        if isinstance(item, FdMessage):
            self.fds -= len(item.pfns)
        self.stuck_since = None
        return item

    @property
    def overflowing(self) -> bool:
        return self.fds > self.limit

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass
class Parked:
    """An Adopt waiting for its descriptors (sent ahead on the fd channel)."""

    identity: bytes
    envelope: list[bytes]
    req: p.Adopt
    deadline: float


def stashed(stash: list[tuple[int, list[int]]], rid: int) -> int:
    """Descriptors stashed for request ``rid``."""
    return sum(len(fds) for r, fds in stash if r == rid)


def stash_size(stash: list[tuple[int, list[int]]]) -> int:
    return sum(len(fds) for _, fds in stash)
