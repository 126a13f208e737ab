"""GangSession: rank 0's tenant as its gang's region group sees it: every grant and
release of the group is told to the other ranks first.

A gang's grants and releases are collective (docs/ARCHITECTURE.md, "Gangs"): each rank
sends the same part and the daemon applies them all or none once every part arrived.
Rank 0's :class:`~kvpool.client_lib.ElasticBlockAllocator` decides them all (its slow
path, its refill and trim, the reclaim and shrink paths); the other ranks run no
allocator. This :class:`~kvpool.client_lib.regions.Session` stands between rank 0's
region group and its tenant: a ``Grant`` or ``Release`` of the group is first posted to
every rank (:meth:`kvpool.engine.tp_workers.TPWorkers.post`: ``gang_messages.Grant`` /
``Release``), then sent to the daemon, whose reply comes once every rank's part is
there. Everything else passes through.

Why a grant is mapped on every rank before the scheduler uses it: the engine's pipe to
each rank is ordered, and each rank handles an adapter message completely (its own
grant *and* mapping, :mod:`.gang_rank`) before it reads the next frame. The allocator
hands a granted chunk's blocks out only after rank 0's grant returned, so every step
that can use them is written after the Grant, and each rank maps before it runs that
step. A release is posted once rank 0's blocks are free (no later step uses them); each
rank unmaps before it sends its part.

One gang call at a time (``_order``, held from the post to the daemon's reply): rank 0's
allocator grants and releases from several threads (refill, engine, shrink), its
connection sends one request at a time, and each rank takes its parts in pipe order; a
post and its request made in different orders by two threads would leave each side
waiting for the part the other sends second.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvpool import protocol as p
from kvpool.client_lib.errors import NoMemory
from kvpool.engine_adapters.bundled import gang_messages

if TYPE_CHECKING:
    from kvpool.client_lib import Tenant
    from kvpool.client_lib.handoff import Handoffs
    from kvpool.vmm.base import Backend

R = TypeVar("R", bound=p.Reply)
log = logging.getLogger("kvpool.engine_adapters.bundled")


class Ranks(Protocol):
    """The other ranks (``TPWorkers``): ``post(payload)`` delivers to every one, in
    order with the engine's steps; raises RuntimeError when a rank is gone."""

    def post(self, payload: bytes) -> None: ...


class GangSession:
    """Rank 0's tenant, with the group ``group_id``'s grants and releases posted to the
    other ranks first (see the module). ``group_id`` is set once the group exists."""

    def __init__(self, tenant: Tenant, ranks: Ranks) -> None:
        self.tenant = tenant
        self.ranks = ranks
        self.group_id: int | None = None
        self._order = threading.Lock()  # pipe order == request order (see the module)

    @property
    def backend(self) -> Backend:
        return self.tenant.backend

    @property
    def page_size(self) -> int:
        return self.tenant.page_size

    @property
    def closed(self) -> bool:
        return self.tenant.closed

    @property
    def connected(self) -> bool:
        return self.tenant.connected

    @property
    def handoffs(self) -> Handoffs:
        return self.tenant.handoffs

    def call(self, req: p.Request, expect: type[R]) -> tuple[R, list[int]]:
        """As the tenant's; a grant whose part cannot reach a rank (it is gone: the gang
        is ending) is refused here as ``NoMemory``, so the allocator treats it as any
        refused grant; a release goes to the daemon anyway (the gang's end returns the
        pages)."""
        if isinstance(req, p.Grant) and req.group == self.group_id:
            with self._order:
                try:
                    self.ranks.post(gang_messages.encode(gang_messages.Grant(list(req.units))))
                except RuntimeError as e:
                    raise NoMemory("NO_MEMORY",
                                   f"gang grant not sent to every rank: {e}") from None
                return self.tenant.call(req, expect)
        if isinstance(req, p.Release) and req.group == self.group_id:
            with self._order:
                try:
                    self.ranks.post(gang_messages.encode(gang_messages.Release(list(req.units))))
                except RuntimeError as e:
                    log.warning("gang release not sent to every rank: %s", e)
                return self.tenant.call(req, expect)
        return self.tenant.call(req, expect)

    def group_closed(self, group_id: int) -> None:
        self.tenant.group_closed(group_id)
