"""Region groups (client side): virtual ranges this process reserved, backed by units
the daemon grants.

A group is ``n_regions`` ranges of ``capacity`` bytes each, reserved with this process's
own backend and registered with the daemon (which keeps the page table). Unit ``u`` is
virtual page ``u`` of every region: :meth:`RegionGroup.grant` maps the daemon's pages
there, :meth:`RegionGroup.release` unmaps them everywhere and then gives them back.

Invariant: ``mapped`` is exactly the set of units mapped in every region (and granted to
this tenant by the daemon). On the host backend ``handles[u]`` keeps one page descriptor
per region of every mapped unit, so the tenant can hand its pages to a restarted daemon
(:meth:`adopt_state`, inside :meth:`RegionGroup.frozen`); on CUDA the handles are retained
from the mappings instead.

A group knows its tenant and its allocator only through the two small interfaces below
(:class:`Session`, :class:`GroupAllocator`): :class:`~kvpool.client_lib.tenant.Tenant` and
:class:`~kvpool.client_lib.allocator.ElasticBlockAllocator` import this module, not the
other way round.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence, TypeVar

from kvpool import fdchannel
from kvpool import protocol as p
from kvpool.vmm import Backend, Page, Range

if TYPE_CHECKING:
    from collections.abc import Set as AbstractSet

    import torch

    from kvpool.client_lib.handoff import Handoffs

log = logging.getLogger("kvpool.client")

R = TypeVar("R", bound=p.Reply)


class Session(Protocol):
    """What a region group needs from the tenant it belongs to (a
    :class:`~kvpool.client_lib.tenant.Tenant`).

    Obligations: ``call`` sends one request on the live session and returns the typed reply
    with the descriptors that came with it (raising ``KvpoolError`` for an error reply);
    ``backend`` and ``page_size`` are the tenant's own vmm backend and the daemon's page
    size, fixed for the session's life; ``closed``/``connected`` say whether requests can
    still be made; :meth:`group_closed` is called once by :meth:`RegionGroup.close` so the
    tenant stops listing the group. ``handoffs`` (for :mod:`kvpool.client_lib.handoff`,
    which reaches a group's offers through ``group.tenant``) is the tenant's offers."""

    @property
    def backend(self) -> Backend: ...
    @property
    def page_size(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def connected(self) -> bool: ...
    @property
    def handoffs(self) -> Handoffs: ...

    def call(self, req: p.Request, expect: type[R]) -> tuple[R, list[int]]: ...
    def group_closed(self, group_id: int) -> None: ...


class GroupAllocator(Protocol):
    """What manages a group's units on top of it and registers itself as
    ``group.allocator`` (an :class:`~kvpool.client_lib.allocator.ElasticBlockAllocator`).

    Obligations: each method is thread-safe and takes its own lock; none calls back into
    the group while :meth:`RegionGroup.frozen` is held by the caller (``in_use_bytes`` and
    ``reserve_units`` are read inside it during a daemon restart); ``stop`` ends any
    background thread before the group unmaps everything; ``release_reserve`` gives empty
    chunks worth at least ``nbytes`` back to the daemon (a reclaim) and returns the bytes
    released."""

    def in_use_bytes(self) -> int: ...
    def reserve_units(self) -> list[int]: ...
    def release_reserve(self, nbytes: int) -> int: ...
    def stop(self) -> None: ...


class GroupStatus(Protocol):
    """Whether requests can still be made for a group (its tenant's session)."""

    @property
    def closed(self) -> bool: ...
    @property
    def connected(self) -> bool: ...


class BlockGroup(Protocol):
    """What an :class:`~kvpool.client_lib.allocator.ElasticBlockAllocator` drives: a
    :class:`RegionGroup`, or a stand-in that applies each grant and release to groups in
    other processes (a tensor-parallel engine whose scheduler holds no KV memory).

    Obligations: ``grant`` returns only once ``units`` are mapped wherever the blocks are
    used (all or nothing; a refusal raises ``KvpoolError`` and maps nothing);
    ``release`` unmaps ``units`` everywhere before their pages go back to the daemon;
    ``mapped`` is the set of units mapped (after the last grant/release returned);
    ``set_usage`` reports in-use bytes and reserve units (what ``ps`` shows); the shape
    (``id``, ``page_size``, ``npages``, ``capacity`` per region, ``n_regions``) is fixed;
    ``allocator`` is set by the allocator that drives the group (at most one)."""

    allocator: GroupAllocator | None

    @property
    def id(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def npages(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def n_regions(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def mapped(self) -> AbstractSet[int]: ...
    @property
    def tenant(self) -> GroupStatus: ...

    def grant(self, units: Sequence[int], *, in_use: int | None = None,
              reserve: Sequence[int] | None = None, populate: bool = False,
              speculative: bool = False) -> None: ...
    def release(self, units: Sequence[int], *, in_use: int | None = None,
                reserve: Sequence[int] | None = None) -> None: ...
    def set_usage(self, *, in_use: int | None = None,
                  reserve: Sequence[int] | None = None) -> None: ...


def unit_runs(units: Sequence[int]) -> list[tuple[int, int, int]]:
    """Sorted ``units`` as runs ``(first unit, index into the sorted list, length)``."""
    runs: list[tuple[int, int, int]] = []
    for i, u in enumerate(units):
        if runs and runs[-1][0] + runs[-1][2] == u:
            first, idx, n = runs[-1]
            runs[-1] = (first, idx, n + 1)
        else:
            runs.append((u, i, 1))
    return runs


def take_mapped(mapped: set[int], units: Sequence[int], group: int) -> None:
    """The release bookkeeping of a group's ``mapped`` set (a :class:`RegionGroup`'s, a
    :class:`BlockGroup` stand-in's): take ``units`` out of it; ValueError, changing
    nothing, when one of them is not mapped (the caller holds its lock)."""
    missing = [u for u in units if u not in mapped]
    if missing:
        raise ValueError(f"unit {missing[0]} of group {group} is not mapped")
    mapped.difference_update(units)


class RegionGroup:
    """``n_regions`` ranges of ``capacity`` bytes (rounded up to pages) registered with the
    daemon (see the module). ``chunk_units``: the units its allocator grants and releases
    together (told to the daemon: ``ps`` shows that many units' bytes as the tenant's
    ``chunk``)."""

    def __init__(self, tenant: Session, n_regions: int, capacity: int, label: str = "",
                 chunk_units: int = 1):
        self.tenant = tenant
        self.backend = tenant.backend
        self.page_size = tenant.page_size
        ps = self.page_size
        self.capacity = -(-capacity // ps) * ps
        self.n_regions = n_regions
        self.ranges: list[Range] = []
        try:
            for _ in range(n_regions):
                self.ranges.append(self.backend.reserve(self.capacity))
            reply, _ = tenant.call(p.CreateGroup(
                n_regions=n_regions, capacity=self.capacity, label=label,
                bases=[r.base for r in self.ranges], chunk_units=chunk_units), p.GroupCreated)
        except BaseException:
            for r in self.ranges:
                self.backend.free_range(r)
            raise
        self.id: int = reply.group
        self.npages: int = reply.npages
        self.mapped: set[int] = set()
        self.keep_handles = self.backend.caps.handles_are_fds
        self.handles: dict[int, list[Page]] = {}  # unit -> Page per region (host backend)
        self.label = label
        self.chunk_units = chunk_units
        #: an ElasticBlockAllocator registers itself here
        self.allocator: GroupAllocator | None = None
        self._lock = threading.Lock()  # guards mapped/handles (held by frozen())
        self.closed = False

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Hold the group still for the block: no unit is mapped, unmapped or forgotten
        (grants, releases, claims and handoff settlements wait) until it ends. The tenant
        holds every group frozen while it hands their pages to a restarted daemon
        (:meth:`adopt_state`). Do not grant, release or claim on this group inside it."""
        with self._lock:
            yield

    @property
    def bases(self) -> list[int]:
        return [r.base for r in self.ranges]

    @property
    def unit_bytes(self) -> int:
        """Physical bytes of one unit (one page in every region)."""
        return self.page_size * self.n_regions

    # ---- grant / release ----------------------------------------------------------------
    def grant(self, units: Sequence[int], *, in_use: int | None = None,
              reserve: Sequence[int] | None = None, populate: bool = False,
              speculative: bool = False) -> None:
        """Get pages for ``units`` (unmapped) and map them in every region. All or nothing;
        raises :class:`~kvpool.client_lib.errors.KvpoolError` (``NoMemory``, ...). The
        daemon may hold the request while it reclaims from other tenants (up to its
        reclaim deadline); ``speculative`` grants (reserve refills) never wait."""
        units = sorted(units)
        if not units:
            return
        req = p.Grant(group=self.id, units=units, in_use=in_use,
                      reserve=None if reserve is None else list(reserve), speculative=speculative)
        _, fds = self.tenant.call(req, p.Granted)
        self.map_granted(units, fds, populate)

    def map_granted(self, units: list[int], fds: list[int], populate: bool = False) -> None:
        """Map the page descriptors the daemon just sent for ``units`` (a grant or a
        claim: unit-major, in the order of ``units``) in every region and record them;
        takes ``fds`` over (each becomes a page's handle or is closed; entries taken are
        set to -1). All or nothing: on failure the units go back (``Release``)."""
        try:
            kept = self._map(units, fds, populate)
        except BaseException:
            log.exception("mapping granted units failed; giving them back")
            self.tenant.call(p.Release(group=self.id, units=sorted(units)), p.Done)
            raise
        finally:
            fdchannel.close_all([fd for fd in fds if fd >= 0])  # none taken over
        with self._lock:
            self.mapped.update(units)
            self.handles.update(kept)

    def _map(self, units: list[int], fds: list[int], populate: bool) -> dict[int, list[Page]]:
        """Map the granted pages; returns the page handles kept per unit (host only).
        Each fd imported is taken over (``import_owned``) and its entry set to -1."""
        backend, ps, nr = self.backend, self.page_size, self.n_regions
        runs = unit_runs(units)
        done: list[tuple[Range, int, int]] = []
        kept: dict[int, list[Page]] = {u: [] for u in units} if self.keep_handles else {}
        try:
            for r, rng in enumerate(self.ranges):
                for first, idx, n in runs:
                    pages: list[Page] = []
                    try:
                        for i in range(idx * nr + r, (idx + n) * nr + r, nr):
                            pages.append(backend.import_owned(fds[i]))
                            fds[i] = -1
                        backend.map_pages(rng, first * ps, pages, populate)
                    finally:
                        for k, page in enumerate(pages):
                            if self.keep_handles:
                                kept[first + k].append(page)
                            else:
                                backend.release(page)
                    done.append((rng, first * ps, n))
        except BaseException:
            for rng, off, n in done:
                backend.unmap(rng, off, n)
            self._drop_handles(kept)
            raise
        return kept

    def _drop_handles(self, handles: dict[int, list[Page]]) -> None:
        for pages in handles.values():
            for page in pages:
                self.backend.release(page)

    def release(self, units: Sequence[int], *, in_use: int | None = None,
                reserve: Sequence[int] | None = None) -> None:
        """Unmap ``units`` in every region, then give their pages back to the daemon."""
        units = sorted(units)
        if not units:
            return
        with self._lock:
            take_mapped(self.mapped, units, self.id)
            handles = {u: self.handles.pop(u) for u in units if u in self.handles}
        self._unmap(units, handles)
        self.tenant.call(p.Release(group=self.id, units=units, in_use=in_use,
                                   reserve=None if reserve is None else list(reserve)), p.Done)

    def forget(self, units: Sequence[int]) -> list[int]:
        """Unmap those of ``units`` this group maps, in every region, and drop their page
        handles *without* telling the daemon (it moved the pages to another tenant: a
        claimed handoff); returns them, sorted."""
        with self._lock:
            gone = sorted(u for u in units if u in self.mapped)
            self.mapped.difference_update(gone)
            handles = {u: self.handles.pop(u) for u in gone if u in self.handles}
        self._unmap(gone, handles)
        return gone

    def _unmap(self, units: list[int], handles: dict[int, list[Page]]) -> None:
        """Unmap sorted ``units`` in every region, then release their kept handles."""
        for rng in self.ranges:
            for first, _, n in unit_runs(units):
                self.backend.unmap(rng, first * self.page_size, n)
        self._drop_handles(handles)

    def set_usage(self, *, in_use: int | None = None,
                  reserve: Sequence[int] | None = None) -> None:
        """Tell the daemon this group's bytes in use and its reserve units (what it may
        take back without eviction), shown by ``ps``/``map``; None leaves one as is."""
        self.tenant.call(p.Report(group=self.id, in_use=in_use,
                                  reserve=None if reserve is None else list(reserve)), p.Done)

    # ---- daemon restart ----------------------------------------------------------------
    def adopt_state(self) -> tuple[p.AdoptGroup, list[int], list[int]]:
        """(caller holds the group :meth:`frozen`) This group as an Adopt entry, the page
        descriptors to send (unit-major), and those of them the caller must close after
        sending."""
        units = sorted(self.mapped)
        fds: list[int] = []
        owned: list[int] = []
        for u in units:
            if self.keep_handles:
                fds.extend(page.handle for page in self.handles[u])
                continue
            for r in range(self.n_regions):  # CUDA: re-export what the mapping holds
                page = self.backend.retain_handle(self.unit_address(r, u))
                try:
                    fd = self.backend.export(page)
                finally:
                    self.backend.release(page)
                fds.append(fd)
                owned.append(fd)
        a = self.allocator
        entry = p.AdoptGroup(
            id=self.id, n_regions=self.n_regions, capacity=self.capacity, bases=self.bases,
            label=self.label, units=units, chunk_units=self.chunk_units,
            in_use=a.in_use_bytes() if a is not None else None,
            reserve=[u for u in a.reserve_units() if u in self.mapped] if a is not None else None)
        return entry, fds, owned

    # ---- views ----------------------------------------------------------------------------
    def tensor(self, i: int, dtype: torch.dtype | None = None,
               shape: Sequence[int] | None = None, offset: int = 0,
               nbytes: int | None = None) -> torch.Tensor:
        """A zero-copy torch tensor over region ``i`` (touch only mapped units!). Needs
        torch (imported here, on the first call, not with this module)."""
        import torch

        from kvpool.client_lib.tensors import tensor_view

        rng = self.ranges[i]
        return tensor_view(self.backend, rng, dtype or torch.uint8, shape, offset, nbytes)

    def unit_address(self, region: int, unit: int) -> int:
        """Virtual address of ``unit`` in region ``region``."""
        return self.ranges[region].base + unit * self.page_size

    # ---- teardown ---------------------------------------------------------------------------
    def close(self, tell_daemon: bool = True) -> None:
        """Stop the allocator, unmap everything, forget the group, free the ranges.
        ``tell_daemon=False``: do not destroy the group in the daemon (a gang rank's
        groups end with its session, ``bye``)."""
        if self.closed:
            return
        self.closed = True
        if self.allocator is not None:
            self.allocator.stop()
        with self._lock:
            units = sorted(self.mapped)
            self.mapped.clear()
            handles, self.handles = self.handles, {}
        self._unmap(units, handles)
        try:
            if tell_daemon and not self.tenant.closed:
                self.tenant.call(p.DestroyGroup(group=self.id), p.Done)
        finally:
            for rng in self.ranges:
                self.backend.free_range(rng)
            self.tenant.group_closed(self.id)
