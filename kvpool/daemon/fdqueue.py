"""Per-tenant descriptor traffic the event loop keeps without ever blocking on a peer.

* :class:`Outbound` — what still has to go to one tenant, in order: fd messages of a
  grant (pfns, turned into descriptors only when sent) and the replies that must follow
  them (the ordering rule: a grant's descriptors are in the tenant's socket before its
  reply leaves). The server sends from the head while the socket takes it and waits
  for ``POLLOUT`` otherwise. The queue is bounded (:data:`MAX_QUEUED_FDS`) and a tenant
  whose socket stays full for ``send_timeout_s`` is dropped.
* :class:`Parked` — an ``Adopt`` whose announced descriptors have not all arrived yet:
  it is handled once they have, or refused at its deadline.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_QUEUED_FDS = 1 << 17  # descriptors queued for one tenant (two of the largest grants)
ADOPT_WAIT_S = 1.0  # how long an Adopt waits for descriptors it announced


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

    items: deque = field(default_factory=deque)
    fds: int = 0  # descriptors in ``items``
    stuck_since: float | None = None  # when the socket last refused a message

    def push_fds(self, header: bytes, pfns: list[int]) -> None:
        self.items.append(FdMessage(header, pfns))
        self.fds += len(pfns)

    def push_reply(self, envelope: list[bytes], frame: bytes, end_session: bool = False) -> None:
        self.items.append(QueuedReply(envelope, frame, end_session))

    def pop(self):
        item = self.items.popleft()
        if isinstance(item, FdMessage):
            self.fds -= len(item.pfns)
        self.stuck_since = None
        return item

    @property
    def overflowing(self) -> bool:
        return self.fds > MAX_QUEUED_FDS

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass
class Parked:
    """An Adopt waiting for its descriptors (sent ahead on the fd channel)."""

    identity: bytes
    envelope: list[bytes]
    req: object  # p.Adopt
    deadline: float


def stashed(stash: list[tuple[int, list[int]]], rid: int) -> int:
    """Descriptors stashed for request ``rid``."""
    return sum(len(fds) for r, fds in stash if r == rid)


def stash_size(stash: list[tuple[int, list[int]]]) -> int:
    return sum(len(fds) for _, fds in stash)
