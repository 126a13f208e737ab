"""The KV allocation unit: the bytes one grant maps, and the block padding that keeps it small.

An elastic allocator (:class:`~kvpool.client_lib.ElasticBlockAllocator`) grants and
releases *chunks* of ``lcm(page size, block stride)`` bytes in every region of its group:
the smallest run of pages that holds whole blocks. With the engine's own block as the
stride, a block that shares few factors with the page makes that run huge: SmolLM2-135M's
720 KiB block (30 layers x K/V x 16 tokens x 3 heads x 64 x float32) on 2 MiB pages gives
``lcm = 90 MiB`` (128 blocks), so an idle server keeps 90 MiB for one null block and a
wake maps 90 MiB for a one-line request. Padding each block a little changes that: a
768 KiB stride gives 6 MiB chunks of 8 blocks for 1/16 of each block unused.

:func:`plan` picks the stride for one group of ``n_regions`` regions (a layout):

* the engine's own block (``stride == block``, no padding) when that unit is already
  *small*: at most :data:`SMALL` times the larger of a page and a block in every region;
* else, among strides up to :data:`MAX_PAD` larger than the block (multiples of
  :data:`ALIGN`) whose unit is smaller than the unpadded one: the least padding among
  the small ones, else the smallest unit (then the least padding);
* the unpadded block when nothing beats it (``pad=False``: always; ``KVPOOL_KV_UNIT=exact``).

:func:`plan_layers` also picks the arrangement of an engine whose KV is one tensor per
layer (vLLM): the layers' own regions when that unit is small, else every layer of a block
side by side in one region (one block stride apart), when that unit is smaller.

A unit is what ``kvpool ps`` shows as a tenant's ``chunk`` (docs/ARCHITECTURE.md, "KV
layouts"). Pure arithmetic: no torch, no daemon.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

#: a block is padded by at most ``block // MAX_PAD`` bytes (an eighth)
MAX_PAD = 8
#: a unit is small when it maps at most this many times max(page, a block in every region)
SMALL = 4
#: strides are multiples of this many bytes (any element size, a cache line)
ALIGN = 64
#: how far :func:`plan` looks: chunks of up to this many blocks, or of pages
SEARCH = 32
#: ``KVPOOL_KV_UNIT``: ``small`` pads blocks (and, for vLLM, interleaves layers) so the
#: unit is small; ``exact`` keeps the engine's own block and layout (lcm of page and block)
KvUnitMode = Literal["small", "exact"]
KV_UNIT_MODES: tuple[KvUnitMode, ...] = ("small", "exact")


def kv_unit_mode(text: str) -> KvUnitMode:
    """``small`` or ``exact`` (any case); ValueError otherwise."""
    t = text.strip().lower()
    for mode in KV_UNIT_MODES:
        if t == mode:
            return mode
    raise ValueError("expected small or exact")


@dataclass(frozen=True)
class UnitPlan:
    """One group's block geometry: ``stride`` bytes per block in each of ``n_regions``
    regions (the engine's ``block`` bytes, then padding), on ``page_size`` pages."""

    block: int
    stride: int
    page_size: int
    n_regions: int = 1

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk in each region: ``lcm(page, stride)``."""
        return math.lcm(self.page_size, self.stride)

    @property
    def pages_per_chunk(self) -> int:
        """Units (one page in every region) per chunk."""
        return self.chunk_bytes // self.page_size

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_bytes // self.stride

    @property
    def unit_bytes(self) -> int:
        """What one chunk maps in all regions: the allocation unit (``ps``'s chunk)."""
        return self.chunk_bytes * self.n_regions

    @property
    def pad(self) -> int:
        """Bytes of padding per block in each region."""
        return self.stride - self.block

    @property
    def waste(self) -> float:
        """The fraction of mapped KV memory that is padding."""
        return self.pad / self.stride

    @property
    def small(self) -> bool:
        return self.unit_bytes <= SMALL * max(self.page_size, self.stride * self.n_regions)

    def describe(self) -> str:
        """One line: the unit, its blocks, the padding."""
        pad = (f"block {self.block} B padded to {self.stride} B ({self.waste:.1%} unused)"
               if self.pad else f"block {self.block} B, unpadded")
        return (f"allocation unit {self.unit_bytes} B = {self.pages_per_chunk} page(s) x "
                f"{self.n_regions} region(s) of {self.page_size} B, {self.blocks_per_chunk} "
                f"block(s); {pad}")


def plan(block: int, page_size: int, n_regions: int = 1, pad: bool = True) -> UnitPlan:
    """The stride for ``block`` bytes per region in ``n_regions`` regions (see the
    module). ValueError for a block or page that is not positive."""
    if block <= 0 or page_size <= 0 or n_regions <= 0:
        raise ValueError(f"block {block}, page {page_size} and regions {n_regions} must be "
                         "positive")
    exact = UnitPlan(block, block, page_size, n_regions)
    if not pad or exact.small:
        return exact
    best = exact
    for stride in _strides(block, page_size, exact.pages_per_chunk):
        p = UnitPlan(block, stride, page_size, n_regions)
        if _better(p, best):
            best = p
    return best


def _better(a: UnitPlan, b: UnitPlan) -> bool:
    """Whether ``a`` beats ``b``: small beats not small; among small ones the least
    padding; among the rest the smaller unit, then the least padding."""
    if a.small != b.small:
        return a.small
    if a.small:
        return (a.stride, a.unit_bytes) < (b.stride, b.unit_bytes)
    return (a.unit_bytes, a.stride) < (b.unit_bytes, b.stride)


def _strides(block: int, page: int, below_pages: int) -> set[int]:
    """Strides in ``[block, block + block // MAX_PAD]``, multiples of :data:`ALIGN`, that
    cut a run of ``m`` pages (fewer than ``below_pages``) into ``k`` whole blocks
    (``stride = m * page / k``), for runs of a few blocks (``k <= SEARCH``) and runs of a
    few pages (``m <= SEARCH``): bounded work whatever the sizes."""
    top = block + block // MAX_PAD
    out: set[int] = set()

    def take(m: int, k: int) -> None:
        span = m * page
        if 0 < m < below_pages and span % k == 0 and block <= span // k <= top \
                and (span // k) % ALIGN == 0:
            out.add(span // k)

    for k in range(1, SEARCH + 1):  # a few blocks per chunk (blocks of a page or more)
        take(-(-k * block // page), k)
    for m in range(1, min(below_pages, SEARCH + 1)):  # a few pages per chunk
        for d in (d for d in range(1, m + 1) if m % d == 0):
            k = d  # k = d * 2**a: the counts of blocks that can cut m pages evenly
            while k * block <= m * page:
                take(m, k)
                k *= 2
    return out


def plan_layers(layer_block: int, layers: int, page_size: int, pad: bool = True) -> UnitPlan:
    """An engine whose KV is one tensor per layer (``layer_block`` bytes per block in
    each): its layers' own regions (``n_regions == layers``) when that unit is small (or
    ``pad`` is off), else one region whose blocks hold every layer side by side
    (``n_regions == 1``, the block ``layers * layer_block``, padded) when that unit is
    smaller."""
    apart = plan(layer_block, page_size, layers, pad)
    if apart.small or not pad:
        return apart
    together = plan(layers * layer_block, page_size, 1, pad)
    return together if together.unit_bytes < apart.unit_bytes else apart
