"""Elastic block allocator: engine KV blocks carved from daemon-granted units.

Blocks and units: a block is ``block_bytes`` of every region of the group at offset
``block * block_bytes``. Blocks are managed in *chunks* of ``lcm(page_size, block_bytes)``
bytes per region: a chunk is ``pages_per_chunk`` consecutive units and holds
``blocks_per_chunk`` whole blocks. So a unit may hold several blocks (small blocks) or a
block may span several units (big blocks); chunks are granted and released whole.

Three parts, one lock (``lock``) over the first two:

* :class:`~kvpool.client_lib.chunk_book.ChunkBook` (``book``): which chunk is unmapped,
  in flight, current, partial, full or in the reserve, and which block is held. The
  fast path (``alloc``/``free``) is the lock plus the book: list pops/appends and a
  bytearray; no system call, no message.
* this class: the slow path (one batched grant for the missing chunks, mapped before
  ``alloc`` returns), releases, whole chunks for one owner (``alloc_chunks``, and the
  claim/forget steps of a page handoff: request-aligned KV whose units hold nothing
  else), and views for engines and the region group;
* :class:`~kvpool.client_lib.refill.Refiller`: the background thread that keeps the
  reserve between ``low`` and ``high``, serves demand and reports to the daemon.

The tenant's own thread answers the daemon's reclaim requests (:meth:`release_reserve`,
then the shrink callback). While the daemon is away (restart) grants fail (``alloc`` of
unmapped memory returns None); mapped blocks keep working.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, overload

from kvpool import protocol as p
from kvpool.client_lib.chunk_book import ChunkBook
from kvpool.client_lib.errors import KvpoolError
from kvpool.client_lib.refill import Refiller
from kvpool.client_lib.regions import BlockGroup, RegionGroup

log = logging.getLogger("kvpool.client")


@dataclass(frozen=True)
class Holdings:
    """What an allocator holds, in bytes of physical memory (all regions together).

    ``mapped = in_use + free``; ``reserve`` is the part of ``free`` in wholly empty chunks
    (what :meth:`ElasticBlockAllocator.release_reserve` can give back without evicting);
    ``chunk`` is the bytes one chunk (the release granularity) is worth."""

    mapped: int
    in_use: int
    free: int
    reserve: int
    chunk: int
    mapped_chunks: int
    reserve_chunks: int


class _BookCount:
    """A read-only count of the allocator read from its chunk book without the lock (one
    read of the book, as a plain property would do)."""

    def __init__(self, read: Callable[[ChunkBook], int], doc: str) -> None:
        self.read, self.__doc__ = read, doc

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _BookCount: ...
    @overload
    def __get__(self, obj: ElasticBlockAllocator, owner: type | None = None) -> int: ...
    def __get__(
        self, obj: ElasticBlockAllocator | None, owner: type | None = None
    ) -> int | _BookCount:
        return self if obj is None else self.read(obj.book)


class ElasticBlockAllocator:
    """Block ids ``0 .. num_blocks-1`` over ``group``; thread-safe.

    Invariants: a block id is held by at most one caller between ``alloc`` and ``free``;
    every held block lies in a mapped chunk; chunks granted for an ``alloc`` go to that
    caller (never through the reserve, where a reclaim could release them first)."""

    def __init__(
        self,
        group: BlockGroup,
        block_bytes_per_region: int,
        *,
        low: int = 2,
        high: int = 8,
        idle_timeout_s: float = 30.0,
        tick_s: float = 0.005,
        report_interval_s: float = 1.0,
        populate: bool = False,
        max_blocks: int | None = None,
        background: bool = True,
        take_first: int = 0,
        first_wait_s: float = 0.0,
    ):
        """``take_first``: ``take_first`` blocks are allocated to the caller here, before
        the background thread can map any chunk, so they are blocks ``0, 1, ...`` (an
        engine's null block must be block 0): :attr:`first_blocks`, empty when the
        memory was not there (the caller checks; :attr:`last_refusal` says why). While
        the daemon answers ``NO_MEMORY`` that grant is asked again for up to
        ``first_wait_s`` seconds (others may shrink or leave meanwhile); any other
        refusal ends it at once."""
        if block_bytes_per_region <= 0:
            raise ValueError("block_bytes_per_region must be positive")
        if not 0 <= low <= high:
            raise ValueError(f"watermarks must satisfy 0 <= low <= high, got {low}, {high}")
        chunk = math.lcm(group.page_size, block_bytes_per_region)
        self.group = group
        self.block_bytes = block_bytes_per_region
        self.chunk_bytes = chunk
        self.pages_per_chunk = chunk // group.page_size
        self.blocks_per_chunk = chunk // block_bytes_per_region
        nchunks = group.npages // self.pages_per_chunk
        if max_blocks is not None:
            nchunks = min(nchunks, -(-max_blocks // self.blocks_per_chunk))
        if nchunks <= 0:
            raise ValueError(f"the group's capacity ({group.capacity} bytes per region) holds "
                             f"no chunk of {chunk} bytes")
        self.nchunks = nchunks
        self.num_blocks = nchunks * self.blocks_per_chunk
        self.low, self.high = low, high
        self.idle_timeout_s = idle_timeout_s
        self.tick_s = tick_s
        self.report_interval_s = report_interval_s
        self.populate = populate
        self.slow_allocs = self.grants = self.releases = 0
        #: asleep (:meth:`suspend`): nothing mapped, nothing granted until :meth:`resume`
        self.suspended = False
        #: guards ``book`` and the refiller's demand; shared with the refiller only
        self.lock = threading.Lock()
        self.book = ChunkBook(nchunks, self.blocks_per_chunk)
        group.allocator = self
        self._refill = Refiller(self, start=False)
        #: the daemon's last refusal of a grant (None: none yet)
        self.last_refusal: KvpoolError | None = None
        #: the blocks taken for the caller at construction (``take_first``)
        self.first_blocks: list[int] = []
        if take_first:
            self.first_blocks = self._take_first(take_first, first_wait_s)
        if background:
            self._refill.start()

    def _take_first(self, n: int, wait_s: float) -> list[int]:
        """(construction, before the refill thread runs) ``n`` blocks, asking again while
        the daemon answers NO_MEMORY, up to ``wait_s``; [] when they did not come."""
        deadline = time.monotonic() + wait_s
        pause = 0.05
        while True:
            got = self.alloc(n)
            if got is not None:
                return got
            why = self.last_refusal
            if why is None or why.code != p.NO_MEMORY or time.monotonic() >= deadline:
                return []
            if pause == 0.05:
                log.warning("no memory for the KV cache's first chunk yet (%s); waiting up "
                            "to %.0f s for others to shrink or leave", why.message, wait_s)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 1.0)

    # ---- fast path -------------------------------------------------------------------
    def alloc(self, n: int = 1, wait: bool = True) -> list[int] | None:
        """``n`` block ids, or None when the memory is not there (never raises for that).

        ``wait=False`` never blocks on arbitration: when free memory does not cover the
        slow path, the missing chunks become *demand* that the background thread asks
        for (a grant the daemon may hold while it reclaims from others) and this call
        returns None at once; a later call finds the chunks mapped. An engine's step
        loop uses this so one model's wait for memory never stalls its running
        requests."""
        if n <= 0:
            if n == 0:
                return []
            raise ValueError(f"cannot allocate {n} blocks")
        with self.lock:
            out = self.book.take(n)
            if out is not None:
                if self.book.reserve_size < self.low and self.book.unmapped_size:
                    self._refill.wake()  # only when a refill could grant something
                return out
        return self._alloc_slow(n, wait)

    def free(self, ids: Iterable[int]) -> None:
        """Give blocks back. Raises ValueError (changing nothing) if one is not held."""
        ids = list(ids)
        with self.lock:
            self.book.free(ids)
            if self.book.reserve_size > self.high:
                self._refill.wake()

    # ---- slow path -------------------------------------------------------------------
    def _alloc_slow(self, n: int, wait: bool = True, resuming: bool = False
                    ) -> list[int] | None:
        """Grant the chunks ``n`` blocks are missing and take the blocks in the same
        critical section that maps the chunks in: granted chunks go straight to this
        caller, so neither a reclaim nor the refill thread can release them first.
        Another thread may take free blocks while the grant is in flight; then more
        chunks are granted (each round grants at least one, so this ends)."""
        with self.lock:
            if self.suspended and not resuming:
                return None  # asleep: no memory until resume()
            self.slow_allocs += 1
        while True:
            with self.lock:
                out = self.book.take(n)
                if out is not None:
                    return out
                k = -(-(n - self.book.free_count) // self.blocks_per_chunk)
                if not wait and self._refill.has_demand():  # already asked in the background
                    self._refill.add_demand(k, self.high)
                    return None
                chunks = self.book.pick_unmapped(k)
                if chunks is None:
                    return None  # the virtual capacity is exhausted
            got = self._grow(chunks, into_reserve=False, speculative=not wait, take=n)
            if got is False:
                if not wait:  # ask for a burst's worth at once: one reclaim round, not many
                    with self.lock:
                        self._refill.add_demand(k, self.high)
                    self._refill.wake()
                return None
            if isinstance(got, list):  # else None: others took the free blocks; again
                if not resuming:  # requests outran the mapped chunks: refills run again
                    with self.lock:
                        self._refill.arm()
                self._refill.wake()
                return got

    def _grow(self, chunks: list[int], into_reserve: bool, speculative: bool | None = None,
              take: int = 0) -> bool | list[int] | None:
        """Grant and map ``chunks`` (in flight); on success they become mapped empty
        chunks. Speculative grants (reserve refills, by default) use free memory only.

        Without ``take``: True, or False when the daemon refused. With ``take``: the
        ``take`` blocks, taken under the lock that makes the chunks mapped (so no other
        thread ever sees them in the reserve first); None when other threads took free
        blocks meanwhile and ``take`` no longer fits (the chunks stay mapped); False
        when refused."""
        reserve = self.reserve_units(extra=chunks if into_reserve else ())
        if speculative is None:
            speculative = into_reserve
        try:
            self.group.grant(self._units(chunks), reserve=reserve, populate=self.populate,
                             in_use=self.in_use_bytes(), speculative=speculative)
        except KvpoolError as e:
            log.debug("grant of %d chunks failed: %s", len(chunks), e)
            self.last_refusal = e
            with self.lock:
                self.book.return_unmapped(chunks)
            return False
        with self.lock:
            self.grants += 1
            self.book.add_mapped(chunks)
            if take:
                return self.book.take(take)
        return True

    def grow_reserve(self, chunks: list[int], speculative: bool) -> bool:
        """(the refiller) Grant in-flight ``chunks`` into the reserve; False if refused."""
        return bool(self._grow(chunks, into_reserve=True, speculative=speculative))

    def release_reserve_chunks(self, k: int) -> int:
        """Release up to ``k`` reserve chunks (highest addresses first) in one request;
        returns how many were taken out of the reserve."""
        with self.lock:
            chunks = self.book.pop_reserve(k)
        if not chunks:
            return 0
        released = False
        try:
            self.group.release(self._units(chunks), reserve=self.reserve_units(),
                               in_use=self.in_use_bytes())
            released = True
        finally:
            with self.lock:
                self.book.return_unmapped(chunks)
                self.releases += released
        return len(chunks)

    def release_reserve(self, nbytes: int) -> int:
        """Give back empty chunks worth at least ``nbytes`` (or all of them) now; returns
        the bytes released. An empty current chunk counts. Refills pause for a while
        (the daemon wanted this memory elsewhere)."""
        per_chunk = self.chunk_bytes * self.group.n_regions
        k = -(-nbytes // per_chunk)
        if k <= 0:
            return 0
        with self.lock:
            self.book.demote_if_empty()
            self._refill.pause()
        return self.release_reserve_chunks(k) * per_chunk

    # ---- whole chunks for one owner (request-aligned KV, handoff) ---------------------
    def alloc_chunks(self, k: int, wait: bool = True) -> list[int] | None:
        """``k`` whole chunks for one owner, every block held (so their units hold
        nothing else: they can be handed to another tenant), or None when the memory is
        not there. Empty mapped chunks first; else ``k`` fresh chunks are granted
        (``wait=False``: free memory only, the rest becomes background demand)."""
        if k <= 0:
            return []
        with self.lock:
            if self.suspended:
                return None
            out = self.book.take_empty_chunks(k)
            if out is not None:
                if self.book.reserve_size < self.low and self.book.unmapped_size:
                    self._refill.wake()
                return out
            if not wait and self._refill.has_demand():
                self._refill.add_demand(k, self.high)
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
                    self._refill.add_demand(k, self.high)
            self._refill.wake()
            return None
        with self.lock:
            self.grants += 1
            self.book.adopt_chunks(chunks)
            self._refill.arm()
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

    # ---- sleep -----------------------------------------------------------------------
    def suspend(self) -> int:
        """Give every chunk back and grant nothing until :meth:`resume` (the engine
        sleeps): no refill, no demand, ``alloc`` returns None. The caller has freed every
        block first (ValueError, changing nothing, when one is still held). Waits for a
        refill step under way to end, so no grant lands afterwards. Returns the chunks
        released."""
        with self._refill.quiet():  # no refill step runs while this holds
            with self.lock:
                if self.book.in_use:
                    raise ValueError(f"suspend: {self.book.in_use} block(s) are still held")
                self.suspended = True
                self._refill.clear_demand()
                self._refill.disarm()  # the wake maps what its first requests take
                self.book.demote_if_empty()
                n = self.book.reserve_size
            return self.release_reserve_chunks(n) if n else 0

    def resume(self, take_first: int = 0) -> list[int] | None:
        """Grant again after :meth:`suspend`. With ``take_first``, that many blocks are
        allocated to the caller first (waiting for the grant like ``alloc``), before the
        refill can map any chunk, so they are blocks ``0, 1, ...`` as at construction.
        The reserve is not refilled until the engine's requests need a grant of their
        own (:meth:`Refiller.arm`): a wake maps what its first requests take. Returns
        them ([] without ``take_first``), or None when the memory did not come (still
        suspended; call again)."""
        with self._refill.quiet():
            with self.lock:
                if not self.suspended:
                    return []
            got = self._alloc_slow(take_first, wait=True, resuming=True) if take_first \
                else []
            if got is None:
                return None
            with self.lock:
                self.suspended = False
        self._refill.wake()
        return got

    # ---- background thread -----------------------------------------------------------
    def rebalance(self) -> None:
        """One refill/trim step (the background thread calls this; tests may too)."""
        self._refill.rebalance()

    def report(self) -> None:
        """Tell the daemon the current reserve and bytes in use (for ``ps``/``map``)."""
        self._refill.report()

    # ---- views -----------------------------------------------------------------------
    def _units(self, chunks: Iterable[int]) -> list[int]:
        per_chunk = self.pages_per_chunk
        return [c * per_chunk + i for c in chunks for i in range(per_chunk)]

    def reserve_units(self, extra: Iterable[int] = ()) -> list[int]:
        """Units of the empty mapped chunks (reserve and an empty current one), and of
        ``extra`` chunks: what the daemon may take back without eviction."""
        with self.lock:
            chunks = self.book.empty_chunks()
        return self._units([*chunks, *extra])

    def in_use_bytes(self) -> int:
        """Bytes of held blocks, all regions together."""
        return self.book.in_use * self.block_bytes * self.group.n_regions

    def holdings(self) -> Holdings:
        """What this allocator holds now (for an engine deciding what to evict)."""
        with self.lock:
            mapped_chunks = len(self.book.mapped_chunks())
            empty = len(self.book.empty_chunks())
            free, in_use = self.book.free_count, self.book.in_use
        per_block = self.block_bytes * self.group.n_regions
        per_chunk = self.chunk_bytes * self.group.n_regions
        return Holdings(mapped=mapped_chunks * per_chunk, in_use=in_use * per_block,
                        free=free * per_block, reserve=empty * per_chunk, chunk=per_chunk,
                        mapped_chunks=mapped_chunks, reserve_chunks=empty)

    def chunk_of(self, block: int) -> int:
        """The chunk (release granularity) ``block`` lives in."""
        return block // self.blocks_per_chunk

    def held_by_chunk(self) -> dict[int, int]:
        """Mapped chunks with held blocks -> how many blocks each holds. Freeing every
        held block of a chunk lets the library release it: evict chunks with the fewest
        held blocks first to free whole units."""
        with self.lock:
            return self.book.held_by_chunk()

    def is_held(self, block: int) -> bool:
        """Whether ``block`` is allocated (between ``alloc`` and ``free``)."""
        return self.book.is_held(block)

    ops = _BookCount(lambda b: b.ops, "alloc/free calls so far: unchanged means no activity.")
    unmapped_chunks = _BookCount(lambda b: b.unmapped_size, "Chunks with no memory behind them.")
    free_blocks = _BookCount(lambda b: b.free_count, "Blocks allocatable without a message.")
    used_blocks = _BookCount(lambda b: b.in_use, "Blocks held (between alloc and free).")
    reserve_chunks = _BookCount(lambda b: b.reserve_size, "Empty mapped chunks in reserve.")
    mapped_chunks = _BookCount(lambda b: len(b.mapped_chunks()), "Chunks with memory mapped.")

    def block_offset(self, block: int) -> int:
        """Byte offset of ``block`` inside each region."""
        return block * self.block_bytes

    @property
    def region_group(self) -> RegionGroup:
        """The group as a :class:`RegionGroup` (page handoffs need its descriptors);
        TypeError when the allocator drives a stand-in (:class:`BlockGroup`)."""
        g = self.group
        if not isinstance(g, RegionGroup):
            raise TypeError(f"this allocator drives a {type(g).__name__}, not a RegionGroup")
        return g

    def check_integrity(self) -> None:
        """Raise AssertionError unless the book is consistent and, with no chunk in flight,
        the group maps exactly the units of the mapped chunks."""
        with self.lock:
            self.book.check_integrity()
            if not self.book.in_flight:
                mapped_units = set(self._units(self.book.mapped_chunks()))
                assert mapped_units == self.group.mapped, "group mapping != mapped chunks"

    # ---- teardown --------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the background thread (the group's close unmaps and releases everything)."""
        self._refill.stop()

    def close(self) -> None:
        """Stop, then give every mapped chunk back (blocks still held are dropped)."""
        self.stop()
        with self.lock:
            chunks = self.book.drop_all()
        if chunks and not self.group.closed:
            self.group.release(self._units(chunks))
        self.group.allocator = None
