"""What handling one request produces: an :class:`Outcome`, or a :class:`Fail`.

An outcome is the reply plus what must happen around it: the pfns whose descriptors go
to the tenant's fd channel *before* the reply (a grant's pages), whether the session
ends (``bye``), whether the reply comes later (*deferred*: a request waiting for
reclaim, answered by ``Arbiter.tick`` with the envelope it must go to), and whether an
admin asked the daemon to stop. A handler learns who sent the request from its
:class:`Sender` (the ZeroMQ identity, and the envelope a later answer must go to);
unsolicited messages for tenants (``Reclaim``, ``Settled``) go to the :class:`Outbox`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Union

from kvpool import protocol as p

if TYPE_CHECKING:
    from kvpool.daemon.tenants import TenantRecord


@dataclass(frozen=True)
class Sender:
    """Where a request came from: its ZeroMQ ``identity`` and the ``envelope`` its
    answer goes to (``[identity]``, plus a REQ socket's empty delimiter). A handler
    that defers its answer keeps the envelope."""

    identity: bytes
    envelope: list[bytes]


class Outbox:
    """Unsolicited messages for tenants, sent by the server on the ROUTER to each
    tenant's identity after the request or tick that queued them."""

    def __init__(self) -> None:
        self._queued: list[tuple[bytes, p.Reply]] = []

    def send(self, t: TenantRecord, msg: p.Reply) -> None:
        """Queue ``msg`` for ``t`` (dropped when ``t`` has not registered an identity)."""
        if t.identity is not None:
            self._queued.append((t.identity, msg))

    def take(self) -> list[tuple[bytes, p.Reply]]:
        """The queued messages, oldest first (the queue is left empty)."""
        out, self._queued = self._queued, []
        return out


class Fail(Exception):
    """A request refused with a stable wire error ``code`` (``p.BAD_REQUEST`` ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Outcome:
    reply: p.Reply | None
    pfns_to_send: list[int] = field(default_factory=list)  # descriptors that precede the reply
    tenant: TenantRecord | None = None
    end_session: bool = False
    deferred: bool = False  # no reply now: tick() answers it later
    envelope: list[bytes] | None = None  # where to answer (deferred outcomes from tick)
    stop: bool = False  # an admin asked the daemon to stop


# A request handler: (the session it acts as, who sent it, the request) -> the reply,
# or an Outcome when more than a reply must happen. ``Any`` for the session and the
# request: each handler takes its own request type (and a session, or None for the few
# ops open to anonymous peers); the dispatch table pairs them by type.
Handler = Callable[[Any, Sender, Any], Union[p.Reply, Outcome]]
