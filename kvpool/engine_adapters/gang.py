"""One tensor-parallel gang driver: how an adapter makes its engine's ranks grant and
release as one kvpool gang (docs/ARCHITECTURE.md, "Gangs").

A gang's grants and releases are collective: each rank sends the same part and the
daemon applies them all or none once every part arrived. The process that decides them
(the one that runs the :class:`~kvpool.client_lib.ElasticBlockAllocator`) drives the
other ranks through a :class:`GangDriver`: every grant, release and usage report becomes
one :class:`GangOp` that the engine's transport (a :class:`Collective`) carries to the
ranks, one operation at a time, and a refusal is raised as the daemon's error. The
contract, for both faces of the driver:

* a grant returns only once its units are mapped on every rank that uses the blocks
  (all or none: a refusal maps nothing anywhere), so the allocator hands out a granted
  chunk's blocks only after that;
* a release unmaps on every rank before the pages go back (each rank unmaps, then sends
  its part);
* one gang call at a time (:meth:`GangDriver.turn`): the allocator grants and releases
  from several threads (refill, engine, shrink) and the ranks take their parts in the
  order the transport carries them; two calls interleaved would leave each side
  waiting for the part the other sends second.

The two faces:

* :class:`CollectiveGroup`, for a driving process that holds no KV memory itself (vLLM's
  engine core): a :class:`~kvpool.client_lib.regions.BlockGroup` whose every operation
  is applied by each rank's :class:`Member` through the transport (vLLM:
  ``executor.collective_rpc``, :mod:`.vllm.tp`), which answers for every rank;
* :class:`GangSession`, for a driving process that is itself rank 0 (the bundled
  engine): the :class:`~kvpool.client_lib.regions.Session` of rank 0's own
  :class:`~kvpool.client_lib.RegionGroup`; its gang ``Grant``/``Release`` are carried to
  the other ranks first (bundled: posted on their pipes, :mod:`.bundled.gang_messages`),
  then sent to the daemon, whose reply comes once every rank's part is there.

Each engine supplies only its transport.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvpool import protocol as p
from kvpool.client_lib.errors import KvpoolError, NoMemory, from_reply
from kvpool.client_lib.regions import take_mapped

if TYPE_CHECKING:
    from collections.abc import Set as AbstractSet

    from kvpool.client_lib import RegionGroup, Tenant
    from kvpool.client_lib.handoff import Handoffs
    from kvpool.client_lib.regions import GroupAllocator, GroupStatus
    from kvpool.vmm.base import Backend

R = TypeVar("R", bound=p.Reply)
log = logging.getLogger("kvpool.engine_adapters.gang")


@dataclass(frozen=True)
class GrantOp:
    """Grant and map ``units`` (every rank's part of one gang grant)."""

    units: tuple[int, ...]
    in_use: int | None
    reserve: tuple[int, ...] | None
    populate: bool
    speculative: bool


@dataclass(frozen=True)
class ReleaseOp:
    """Unmap ``units``, then give their pages back (every rank's part of one release)."""

    units: tuple[int, ...]
    in_use: int | None
    reserve: tuple[int, ...] | None


@dataclass(frozen=True)
class UsageOp:
    """Report the bytes in use and the reserve units (each rank to its own device)."""

    in_use: int | None
    reserve: tuple[int, ...] | None


GangOp = GrantOp | ReleaseOp | UsageOp


class RankGone(RuntimeError):
    """Raised by a :class:`Collective` that cannot reach a rank (the gang is ending)."""


class Collective(Protocol):
    """An engine's transport: carries one op to the ranks.

    Obligations: the ranks take the ops in the order of the calls; a call returns the
    answer of each rank it applied the op on and waited for (None, or the daemon's
    refusal as one ``"CODE: message"`` line), in rank order, or ``[]`` when it only
    delivered the op (each rank then applies it in order, and the daemon's reply to
    the caller's own part answers for all); when every rank applies the op within the
    call, they apply it concurrently (a gang part waits until every rank sent it). A
    rank that cannot be reached makes the call raise :class:`RankGone` (any other
    exception is passed on as it is). The caller (:class:`GangDriver`) never calls it
    from two threads at once, and may call it with the engine's step lock held."""

    def __call__(self, op: GangOp) -> list[str | None]: ...


class GangDriver:
    """One gang call at a time over an engine's :class:`Collective` (see the module).

    Thread safety: :meth:`turn` is the gang's lock, held from an op's delivery to the
    end of what the caller does with it (its daemon call, its books)."""

    def __init__(self, collective: Collective) -> None:
        self._collective = collective
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the gang for one call (its :meth:`send` and what goes with it)."""
        with self._lock:
            yield

    def send(self, op: GangOp) -> None:
        """(inside :meth:`turn`) Carry ``op`` to the ranks. Raises the first rank's
        refusal (every rank gets the same: the daemon's gang grants are all or none;
        ranks that answered differently raise ``INTERNAL``). A grant that cannot reach
        a rank is refused as ``NoMemory`` (the allocator treats it as any refused
        grant); a release or report that cannot is only logged (the gang's end returns
        the pages)."""
        try:
            answers = self._collective(op)
        except RankGone as e:
            if isinstance(op, GrantOp):
                raise NoMemory(p.NO_MEMORY, f"gang grant not sent to every rank: {e}") \
                    from None
            log.warning("gang %s not sent to every rank: %s",
                        "release" if isinstance(op, ReleaseOp) else "report", e)
            return
        errors = [a for a in answers if a is not None]
        if errors:
            code, _, msg = errors[0].partition(": ")
            if len(errors) != len(answers):
                raise KvpoolError(p.INTERNAL, f"ranks disagree on a gang operation: {answers}")
            raise from_reply(p.Error(code=code, message=msg))


class Member:
    """One rank's side: its gang region group, driven only through :meth:`apply`."""

    def __init__(self, group: RegionGroup) -> None:
        self.group = group

    def apply(self, op: GangOp) -> str | None:
        """Apply ``op`` to this rank's group; None, or the daemon's refusal as one line."""
        g = self.group
        try:
            if isinstance(op, GrantOp):
                g.grant(op.units, in_use=op.in_use, reserve=op.reserve, populate=op.populate,
                        speculative=op.speculative)
            elif isinstance(op, ReleaseOp):
                g.release(op.units, in_use=op.in_use, reserve=op.reserve)
            else:
                g.set_usage(in_use=op.in_use, reserve=op.reserve)
        except KvpoolError as e:
            return str(e)  # "CODE: message"
        return None


@dataclass(frozen=True)
class GroupShape:
    """Rank 0's group as the daemon created it (every rank's is the same: the layout)."""

    id: int
    page_size: int
    npages: int
    capacity: int
    n_regions: int

    @classmethod
    def of(cls, group: RegionGroup) -> GroupShape:
        return cls(group.id, group.page_size, group.npages, group.capacity, group.n_regions)


def _tuple(units: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if units is None else tuple(units)


class CollectiveGroup:
    """A :class:`~kvpool.client_lib.regions.BlockGroup` whose memory lives in the ranks:
    ``grant``/``release``/``set_usage`` are one :meth:`GangDriver.send` each; ``mapped``
    is what every rank maps (updated after every rank returned). ``status`` says whether
    the gang's session is still up (rank 0's tenant, as seen by the process that drives
    this group)."""

    def __init__(self, collective: Collective, shape: GroupShape, status: GroupStatus) -> None:
        self._driver = GangDriver(collective)
        self._shape = shape
        self._status = status
        self._mapped: set[int] = set()
        self._closed = False
        self.allocator: GroupAllocator | None = None

    @property
    def id(self) -> int:
        return self._shape.id

    @property
    def page_size(self) -> int:
        return self._shape.page_size

    @property
    def npages(self) -> int:
        return self._shape.npages

    @property
    def capacity(self) -> int:
        return self._shape.capacity

    @property
    def n_regions(self) -> int:
        return self._shape.n_regions

    @property
    def closed(self) -> bool:
        return self._closed or self._status.closed

    @property
    def mapped(self) -> AbstractSet[int]:
        with self._driver.turn():
            return frozenset(self._mapped)

    @property
    def tenant(self) -> GroupStatus:
        return self._status

    def grant(self, units: Sequence[int], *, in_use: int | None = None,
              reserve: Sequence[int] | None = None, populate: bool = False,
              speculative: bool = False) -> None:
        units = sorted(units)
        if not units:
            return
        op = GrantOp(tuple(units), in_use, _tuple(reserve), populate, speculative)
        with self._driver.turn():
            self._driver.send(op)
            self._mapped.update(units)

    def release(self, units: Sequence[int], *, in_use: int | None = None,
                reserve: Sequence[int] | None = None) -> None:
        units = sorted(units)
        if not units:
            return
        with self._driver.turn():
            take_mapped(self._mapped, units, self.id)
            self._driver.send(ReleaseOp(tuple(units), in_use, _tuple(reserve)))

    def set_usage(self, *, in_use: int | None = None,
                  reserve: Sequence[int] | None = None) -> None:
        with self._driver.turn():
            self._driver.send(UsageOp(in_use, _tuple(reserve)))

    def close(self) -> None:
        """No more operations (the ranks close their own groups with their tenants)."""
        self._closed = True


class GangSession:
    """Rank 0's tenant as its own gang region group sees it: the group ``group_id``'s
    ``Grant`` and ``Release`` are carried to the other ranks first (one
    :meth:`GangDriver.send` each, inside the same :meth:`GangDriver.turn` as the daemon
    call, since rank 0's connection sends one request at a time), then sent to the
    daemon; everything else passes through. ``group_id`` is set once the group exists.

    Why a grant is mapped on every rank before the allocator uses it: the transport
    delivers in order and each rank applies a part completely (grant and mapping) before
    it takes the next, and a gang grant's reply reaches rank 0 only once every rank's
    part arrived; so every use of the blocks the engine issues after the grant
    returned reaches each rank after its mapping. A release is sent once rank 0's
    blocks are free; each rank unmaps before it sends its part."""

    def __init__(self, tenant: Tenant, driver: GangDriver) -> None:
        self.tenant = tenant
        self.driver = driver
        self.group_id: int | None = None

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
        """As the tenant's; a gang grant the transport cannot deliver is refused here
        (``NoMemory``, the daemon not asked), a release goes to the daemon anyway."""
        op: GangOp
        if isinstance(req, p.Grant) and req.group == self.group_id:
            op = GrantOp(tuple(req.units), req.in_use, _tuple(req.reserve), False,
                         req.speculative)
        elif isinstance(req, p.Release) and req.group == self.group_id:
            op = ReleaseOp(tuple(req.units), req.in_use, _tuple(req.reserve))
        else:
            return self.tenant.call(req, expect)
        with self.driver.turn():
            self.driver.send(op)
            return self.tenant.call(req, expect)

    def group_closed(self, group_id: int) -> None:
        self.tenant.group_closed(group_id)
