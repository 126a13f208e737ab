"""The scheduler's stand-in for a tensor-parallel gang's region groups (issue 26, scope 4).

In a vLLM server with tensor parallelism the scheduler (engine core) holds no KV memory:
each worker is a gang rank with its own :class:`~kvpool.client_lib.RegionGroup` on its
own device. The scheduler's :class:`~kvpool.client_lib.ElasticBlockAllocator` drives a
:class:`CollectiveGroup` instead (a :class:`~kvpool.client_lib.regions.BlockGroup`):
each grant, release and usage report becomes one :class:`GangOp` that a
:class:`Collective` applies on every rank's :class:`Member` (in vLLM:
``executor.collective_rpc``), and it returns only once every rank's call returned. So a
grant is mapped in every worker before the allocator hands out its blocks, and a
release is unmapped in every worker before the pages go back (each rank's release
unmaps, then sends its part; the daemon returns the pages once every part arrived).

The daemon makes a gang grant all or none; a refusal reaches every rank as the same
error, which each :class:`Member` returns as one line and the :class:`CollectiveGroup`
raises as a :class:`~kvpool.client_lib.errors.KvpoolError` (the allocator then keeps
those chunks unmapped). :mod:`.tp` wires it into vLLM (docs/VLLM-ADAPTER.md, "Tensor
parallelism").
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpool import protocol as p
from kvpool.client_lib.errors import KvpoolError, from_reply

if TYPE_CHECKING:
    from collections.abc import Set as AbstractSet

    from kvpool.client_lib import RegionGroup
    from kvpool.client_lib.regions import GroupAllocator, GroupStatus


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


class Collective(Protocol):
    """Applies one op on every rank's :class:`Member`; returns each rank's answer (None,
    or the error line), in rank order.

    Obligations: every rank's ``Member.apply`` runs concurrently with the others' (a gang
    part waits until every rank sent it) and the call returns only after every rank's
    ``apply`` returned; a rank that cannot be reached makes the call raise. The caller
    (:class:`CollectiveGroup`) never calls it from two threads at once."""

    def __call__(self, op: GangOp) -> list[str | None]: ...


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


class CollectiveGroup:
    """A :class:`~kvpool.client_lib.regions.BlockGroup` whose memory lives in the ranks:
    ``grant``/``release``/``set_usage`` are one :class:`Collective` call each, serialized
    by a lock; ``mapped`` is what every rank maps (updated after every rank returned).
    ``status`` says whether the gang's session is still up (rank 0's tenant, as seen by
    the process that drives this group)."""

    def __init__(self, collective: Collective, shape: GroupShape, status: GroupStatus) -> None:
        self._collective = collective
        self._shape = shape
        self._status = status
        self._lock = threading.Lock()
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
        with self._lock:
            return frozenset(self._mapped)

    @property
    def tenant(self) -> GroupStatus:
        return self._status

    def _run(self, op: GangOp) -> None:
        """(lock held) One collective call; raises the first rank's refusal. A rank that
        answered differently from another (one granted, one refused) cannot happen with
        the daemon's all-or-none gang grants; it is raised as an error too."""
        answers = self._collective(op)
        errors = [a for a in answers if a is not None]
        if errors:
            code, _, msg = errors[0].partition(": ")
            if len(errors) != len(answers):
                raise KvpoolError(p.INTERNAL, f"ranks disagree on a gang operation: {answers}")
            raise from_reply(p.Error(code=code, message=msg))

    def grant(self, units: Sequence[int], *, in_use: int | None = None,
              reserve: Sequence[int] | None = None, populate: bool = False,
              speculative: bool = False) -> None:
        units = sorted(units)
        if not units:
            return
        op = GrantOp(tuple(units), in_use, None if reserve is None else tuple(reserve),
                     populate, speculative)
        with self._lock:
            self._run(op)
            self._mapped.update(units)

    def release(self, units: Sequence[int], *, in_use: int | None = None,
                reserve: Sequence[int] | None = None) -> None:
        units = sorted(units)
        if not units:
            return
        with self._lock:
            missing = [u for u in units if u not in self._mapped]
            if missing:
                raise ValueError(f"unit {missing[0]} of group {self.id} is not mapped")
            self._mapped.difference_update(units)
            self._run(ReleaseOp(tuple(units), in_use,
                                None if reserve is None else tuple(reserve)))

    def set_usage(self, *, in_use: int | None = None,
                  reserve: Sequence[int] | None = None) -> None:
        with self._lock:
            self._run(UsageOp(in_use, None if reserve is None else tuple(reserve)))

    def close(self) -> None:
        """No more operations (the ranks close their own groups with their tenants)."""
        self._closed = True
