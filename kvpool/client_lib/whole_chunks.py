"""Whole chunks for one owner: request-aligned KV and page handoff between tenants.

Chunks whose every block one owner holds, so their units hold nothing else and can be
handed to another tenant (:mod:`kvpool.client_lib.handoff`) or taken from one. Two
mixins, one per layer: :class:`WholeChunkBook` is part of
:class:`~kvpool.client_lib.chunk_book.ChunkBook` (pure state, the book's invariants) and
:class:`WholeChunks` part of :class:`~kvpool.client_lib.allocator.ElasticBlockAllocator`
(same lock, the grants). ``alloc_chunks`` grants or takes them; a claim maps chunks
picked with ``pick_unmapped_chunks`` and then adopts (or returns) them;
``forget_chunks`` drops chunks another tenant claimed.
"""

from __future__ import annotations

import heapq
import logging
import threading
from typing import TYPE_CHECKING, Iterable

from kvpool.client_lib.errors import KvpoolError

if TYPE_CHECKING:
    from kvpool.client_lib.chunk_book import ChunkBook
    from kvpool.client_lib.refill import Refiller
    from kvpool.client_lib.regions import RegionGroup

log = logging.getLogger("kvpool.client")


class WholeChunkBook:
    """The chunk book's whole-chunk moves; :class:`ChunkBook` provides the state."""

    if TYPE_CHECKING:
        nchunks: int
        blocks_per_chunk: int
        free_count: int
        in_use: int
        ops: int
        _held: bytearray
        _used: list[int]
        _free_lists: list[list[int] | None]
        _current: int
        _current_free: list[int]
        _partial: list[set[int]]
        _reserve: list[int]
        _unmapped: list[int]
        _in_flight: set[int]

        def demote_if_empty(self) -> None: ...

    def take_empty_chunks(self, k: int) -> list[int] | None:
        """``k >= 1`` mapped empty chunks (an empty current one joins the reserve first),
        every block of them now held: whole units for one owner. None (no change) if
        fewer are empty."""
        self.demote_if_empty()
        if k > len(self._reserve):
            return None
        chunks = self._reserve[len(self._reserve) - k:]
        del self._reserve[len(self._reserve) - k:]
        for c in chunks:
            fl = self._free_lists[c]
            assert fl is not None and len(fl) == self.blocks_per_chunk, "reserve chunks are empty"
            fl.clear()
            self._hold_whole(c)
        self.free_count -= k * self.blocks_per_chunk
        return chunks

    def adopt_chunks(self, chunks: Iterable[int]) -> None:
        """In-flight chunks just mapped for one owner (a claim, a whole-chunk grant):
        mapped, every block held."""
        for c in chunks:
            assert c in self._in_flight, f"adopt: chunk {c} is not in flight"
            self._in_flight.discard(c)
            self._free_lists[c] = []
            self._hold_whole(c)

    def forget_chunks(self, chunks: Iterable[int]) -> None:
        """Mapped chunks whose pages went to another tenant: unmapped, nothing held (their
        held blocks are dropped, as the owner no longer has them). Raises ValueError
        (changing nothing) if one is not mapped or is listed twice."""
        chunks = list(chunks)
        per = self.blocks_per_chunk
        if len(set(chunks)) != len(chunks):
            raise ValueError("forget: a chunk is listed twice")
        for c in chunks:
            if not (isinstance(c, int) and 0 <= c < self.nchunks) or \
                    self._free_lists[c] is None:
                raise ValueError(f"forget: chunk {c!r} is not mapped")
        for c in chunks:
            fl, u = self._free_lists[c], self._used[c]
            assert fl is not None
            if c == self._current:
                self._current, self._current_free = -1, []
            elif u == 0:
                self._reserve.remove(c)
            elif u < per:
                self._partial[u].discard(c)
            self.free_count -= len(fl)
            self.in_use -= u
            self._free_lists[c] = None
            self._used[c] = 0
            self._held[c * per:(c + 1) * per] = bytes(per)
            heapq.heappush(self._unmapped, c)
        self.ops += 1

    def _hold_whole(self, c: int) -> None:
        per = self.blocks_per_chunk
        self._held[c * per:(c + 1) * per] = b"\x01" * per
        self._used[c] = per
        self.in_use += per
        self.ops += 1


class WholeChunks:
    """The whole-chunk operations; the allocator provides the state below."""

    if TYPE_CHECKING:
        lock: threading.Lock
        book: ChunkBook
        group: RegionGroup
        low: int
        high: int
        populate: bool
        slow_allocs: int
        grants: int
        _refill: Refiller

        def _units(self, chunks: Iterable[int]) -> list[int]: ...
        def reserve_units(self, extra: Iterable[int] = ()) -> list[int]: ...
        def in_use_bytes(self) -> int: ...

    def alloc_chunks(self, k: int, wait: bool = True) -> list[int] | None:
        """``k`` whole chunks for one owner, every block held (so their units hold
        nothing else: they can be handed to another tenant), or None when the memory is
        not there. Empty mapped chunks first; else ``k`` fresh chunks are granted
        (``wait=False``: free memory only, the rest becomes background demand)."""
        if k <= 0:
            return []
        with self.lock:
            out = self.book.take_empty_chunks(k)
            if out is not None:
                if self.book.reserve_size < self.low and self.book.unmapped_size:
                    self._refill.wake()
                return out
            if not wait and self._refill.has_demand():
                self._refill.add_demand(k + self.high)
                return None
            chunks = self.book.pick_unmapped(k)
            if chunks is None:
                return None
            self.slow_allocs += 1
        try:
            self.group.grant(self._units(chunks), reserve=self.reserve_units(),
                             populate=self.populate, in_use=self.in_use_bytes(),
                             speculative=not wait)
        except KvpoolError as e:
            log.debug("grant of %d whole chunks failed: %s", k, e)
            with self.lock:
                self.book.return_unmapped(chunks)
                if not wait:
                    self._refill.add_demand(k + self.high)
            self._refill.wake()
            return None
        with self.lock:
            self.grants += 1
            self.book.adopt_chunks(chunks)
        return chunks

    def pick_unmapped_chunks(self, k: int) -> list[int] | None:
        """``k`` unmapped chunks, now in flight, for a claim to map (then
        :meth:`adopt_chunks`, or :meth:`return_chunks` if the claim failed)."""
        with self.lock:
            return self.book.pick_unmapped(k)

    def adopt_chunks(self, chunks: list[int]) -> None:
        """Picked chunks a claim mapped: ours now, every block held."""
        with self.lock:
            self.book.adopt_chunks(chunks)

    def return_chunks(self, chunks: list[int]) -> None:
        """Picked chunks no claim mapped: unmapped again."""
        with self.lock:
            self.book.return_unmapped(chunks)

    def forget_chunks(self, chunks: list[int]) -> None:
        """Mapped chunks another tenant claimed (the group unmapped them already): out of
        the books, unmapped, their held blocks dropped; nothing goes to the daemon."""
        with self.lock:
            self.book.forget_chunks(chunks)

    def units_of(self, chunks: Iterable[int]) -> list[int]:
        """The units of ``chunks``, in order (chunk ``c``: ``c * pages_per_chunk ..``)."""
        return self._units(chunks)
