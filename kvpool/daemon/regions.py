"""Region groups and their page tables (daemon side).

A group is ``n_regions`` equal virtual ranges of one tenant (one per layer and K/V, or a
single block-major buffer). The tenant reserves and maps them at its own addresses; the
daemon keeps only the table. An allocation *unit* is one virtual page index: granting
unit ``u`` backs page ``u`` of every region of the group, so one unit is ``n_regions``
pages.

Invariant: ``units[u]`` lists ``n_regions`` distinct pfns, each owned by the group's
tenant in the pool, and no pfn appears in two slots anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Group:
    id: int
    tenant: int
    n_regions: int
    npages: int  # virtual pages per region
    bases: list[int] = field(default_factory=list)
    label: str = ""
    units: dict[int, list[int]] = field(default_factory=dict)  # unit -> pfn per region
    reserve: set[int] = field(default_factory=set)  # units the client reports idle
    in_use: int | None = None  # bytes the client reports in use (None: not reported)

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

    def report(self, in_use: int | None, reserve: list[int] | None) -> None:
        if in_use is not None:
            self.in_use = in_use
        if reserve is not None:
            self.reserve = {u for u in reserve if u in self.units}
        else:
            self.reserve &= self.units.keys()

    def table(self) -> str:
        """One char per virtual page: ``#`` in use, ``+`` mapped reserve, ``.`` unmapped."""
        cells = bytearray(b"." * self.npages)
        for u in self.units:
            cells[u] = ord("+") if u in self.reserve else ord("#")
        return cells.decode()
