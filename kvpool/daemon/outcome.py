"""What handling one request produces: an :class:`Outcome`, or a :class:`Fail`.

An outcome is the reply plus what must happen around it: the pfns whose descriptors go
to the tenant's fd channel *before* the reply (a grant's pages), whether the session
ends (``bye``), whether the reply comes later (*deferred*: a request waiting for
reclaim, answered by ``Arbiter.tick`` with the envelope it must go to), and whether an
admin asked the daemon to stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Union

from kvpool import protocol as p

if TYPE_CHECKING:
    from kvpool.daemon.tenants import TenantRecord


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


# A request handler: (the session it acts as, its ZeroMQ identity, the request) -> the
# reply, or an Outcome when more than a reply must happen. ``Any`` for the request: each
# handler takes its own request type, the dispatch table pairs them by type.
Handler = Callable[[Any, bytes, Any], Union[p.Reply, Outcome]]
