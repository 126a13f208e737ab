"""Region groups and their page tables (daemon side).

A group is ``n_regions`` equal virtual ranges of one tenant (one per layer and K/V, or a
single block-major buffer). The tenant reserves and maps them at its own addresses; the
daemon keeps only the table. An allocation *unit* is one virtual page index: granting
unit ``u`` backs page ``u`` of every region of the group, so one unit is ``n_regions``
pages.

Invariant: ``units[u]`` lists ``n_regions`` distinct pfns, each owned by the group's
tenant in the pool, and no pfn appears in two slots anywhere.

:class:`GroupIndex` is every live group of every tenant, by id, and the allocator of
new ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, MutableMapping

from kvpool import protocol as p


@dataclass(eq=False)
class GroupRecord:
    """The daemon's page table of one region group (the client maps the group's
    regions: ``kvpool.client_lib.RegionGroup``)."""

    id: int
    tenant: int
    n_regions: int
    npages: int  # virtual pages per region
    bases: list[int] = field(default_factory=list)
    label: str = ""
    units: dict[int, list[int]] = field(default_factory=dict)  # unit -> pfn per region
    reserve: set[int] = field(default_factory=set)  # units the client reports idle
    in_use: int | None = None  # bytes the client reports in use (None: not reported)
    chunk_units: int = 1  # units the client grants and releases together (its chunk)

    @property
    def pages(self) -> int:
        """Pages granted to this group."""
        return len(self.units) * self.n_regions

    def grant(self, units: list[int], pfns: list[int]) -> None:
        r = self.n_regions
        for i, u in enumerate(units):
            self.units[u] = pfns[i * r : (i + 1) * r]

    def release(self, units: list[int]) -> list[int]:
        """Drop ``units`` from the table; returns their pfns."""
        out: list[int] = []
        for u in units:
            out.extend(self.units.pop(u))
            self.reserve.discard(u)
        return out

    def release_all(self) -> list[int]:
        return self.release(list(self.units))

    def record_usage(self, in_use: int | None, reserve: list[int] | None) -> None:
        """Store what the client reports: bytes in use, units held as idle reserve
        (only units the table holds; ``None`` leaves a value as it is)."""
        if in_use is not None:
            self.in_use = in_use
        if reserve is not None:
            self.reserve = {u for u in reserve if u in self.units}
        else:
            self.reserve &= self.units.keys()

    @property
    def virtual_pages(self) -> int:
        """Virtual pages the group spans (what the per-tenant cap counts)."""
        return self.npages * self.n_regions

    def runs(self) -> list[tuple[int, int, bool]]:
        """The table run-length encoded: ``(start, length, reserve)`` for each stretch
        of consecutive mapped units of one state; unmapped stretches are left out.
        O(mapped units), whatever the group's virtual size."""
        out: list[list[int]] = []  # [start, length, reserve (0/1)]
        for u in sorted(self.units):
            res = u in self.reserve
            if out and out[-1][0] + out[-1][1] == u and out[-1][2] == int(res):
                out[-1][1] += 1
            else:
                out.append([u, 1, int(res)])
        return [(a, b, bool(c)) for a, b, c in out]


class GroupIndex(MutableMapping[int, GroupRecord]):
    """Every live group (all tenants), by id, and the next id to hand out.

    Invariant (the callers keep it; ``check_integrity`` checks it): the index holds
    exactly the groups in the tenants' own ``groups`` tables."""

    def __init__(self) -> None:
        self._by_id: dict[int, GroupRecord] = {}
        self.next_id = 1  # the next group id to try (see new_id)

    def new_id(self) -> int:
        """The next free group id, in ``1..MAX_GROUP_ID`` (wrapping around, skipping live
        ones): ids never grow past what clients, the wire and ``state.json`` carry."""
        gid = self.next_id
        for _ in range(len(self._by_id) + 2):
            if not 1 <= gid <= p.MAX_GROUP_ID:
                gid = 1
            if gid not in self._by_id:
                break
            gid += 1
        self.next_id = gid + 1
        return gid

    def continue_from(self, next_id: int) -> None:
        """Ids continue from ``next_id`` (a previous daemon's), never going back."""
        self.next_id = max(self.next_id, next_id)

    def __getitem__(self, gid: int) -> GroupRecord:
        return self._by_id[gid]

    def __setitem__(self, gid: int, g: GroupRecord) -> None:
        self._by_id[gid] = g

    def __delitem__(self, gid: int) -> None:
        del self._by_id[gid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, gid: object) -> bool:
        return gid in self._by_id
