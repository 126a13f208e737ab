"""Elastic block allocator: engine KV blocks carved from daemon-granted units.

Blocks and units: a block is ``block_bytes`` of every region of the group at offset
``block * block_bytes``. Blocks are managed in *chunks* of ``lcm(page_size, block_bytes)``
bytes per region: a chunk is ``pages_per_chunk`` consecutive units and holds
``blocks_per_chunk`` whole blocks. So a unit may hold several blocks (small blocks) or a
block may span several units (big blocks); chunks are granted and released whole.

Every chunk is in exactly one state:

* *unmapped*   — in ``_unmapped`` (a min-heap: low addresses are reused first);
* *in flight*  — being granted or released by some thread (``_inflight``);
* *current*    — ``_cur``: the mapped chunk blocks are taken from first;
* *partial*    — in ``_buckets[k]`` where ``k`` is its count of held blocks (0 < k <
  blocks_per_chunk): mapped, some blocks free and some held;
* *full*       — mapped, every block held (tracked by ``_used`` only);
* *reserve*    — in ``_reserve``: mapped, no block held (the local reserve).

Fast path (``alloc``/``free``): a lock, list pops/appends and a bytearray; no system
call, no message. Blocks come from the current chunk; when it runs out, or when frees
leave it emptier than some partial chunk, the fullest partial chunk (highest bucket)
becomes current, so emptier chunks drain into the reserve; then a reserve chunk. Slow
path: one batched grant for the missing chunks, mapped before ``alloc`` returns.

A background thread keeps ``len(_reserve)`` between ``low`` and ``high`` (growing to
``high`` in one *speculative* grant when below ``low`` — served from free memory only,
never making the daemon reclaim from others; releasing the surplus above ``high`` in one
release), shrinks the reserve to nothing after ``idle_timeout_s`` without alloc/free, and
reports the reserve to the daemon. The tenant's own background thread answers the
daemon's reclaim requests (:meth:`release_reserve`, then the shrink callback).
While the daemon is away (restart) the thread keeps going: grants fail (``alloc`` of
unmapped memory returns None), mapped blocks keep working.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Iterable

from kvpool.client_lib.errors import KvpoolError
from kvpool.client_lib.regions import RegionGroup

log = logging.getLogger("kvpool.client")

_EMPTY: list[int] = []


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


class ElasticBlockAllocator:
    def __init__(
        self,
        group: RegionGroup,
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
    ):
        if block_bytes_per_region <= 0:
            raise ValueError("block_bytes_per_region must be positive")
        if not 0 <= low <= high:
            raise ValueError(f"watermarks must satisfy 0 <= low <= high, got {low}, {high}")
        ps = group.page_size
        chunk = math.lcm(ps, block_bytes_per_region)
        self.group = group
        self.block_bytes = block_bytes_per_region
        self.chunk_bytes = chunk
        self.pages_per_chunk = chunk // ps
        self.blocks_per_chunk = bpc = chunk // block_bytes_per_region
        nchunks = group.npages // self.pages_per_chunk
        if max_blocks is not None:
            nchunks = min(nchunks, -(-max_blocks // bpc))
        if nchunks <= 0:
            raise ValueError(f"the group's capacity ({group.capacity} bytes per region) holds "
                             f"no chunk of {chunk} bytes")
        self.nchunks = nchunks
        self.num_blocks = nchunks * bpc
        self.low, self.high = low, high
        self.idle_timeout_s = idle_timeout_s
        self.tick_s = tick_s
        self.report_interval_s = report_interval_s
        self.populate = populate

        self._lock = threading.Lock()
        self._held = bytearray(self.num_blocks)
        self._used = [0] * nchunks
        self._free: list[list[int] | None] = [None] * nchunks
        self._cur = -1
        self._curfree: list[int] = _EMPTY
        self._buckets: list[set[int]] = [set() for _ in range(bpc)]  # by held count
        self._top = 0  # no bucket above this index is non-empty
        self._reserve: list[int] = []
        self._unmapped: list[int] = list(range(nchunks))  # a heap (sorted is a heap)
        self._inflight: set[int] = set()
        self._nfree = 0  # free blocks in mapped chunks (cur + partial + reserve)
        self._in_use = 0  # blocks held
        self._ops = 0  # alloc/free calls (the refill thread watches it for idleness)
        self.slow_allocs = 0
        self.grants = 0
        self.releases = 0

        self._wake = threading.Event()
        self._stopped = False
        self._last_ops = -1
        self._last_active = time.monotonic()
        self._last_report = 0.0
        self._reported: tuple | None = None
        self._backoff_until = 0.0
        self._reclaimed_at = 0.0
        self._demand = 0  # chunks a non-waiting alloc could not get (see alloc(wait=False))
        self._demand_after = 0.0
        group.allocator = self
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name=f"kvpool-refill-{group.id}",
                                            daemon=True)
            self._thread.start()

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
        with self._lock:
            self._ops += 1
            fl = self._curfree
            if n == 1 and fl:  # the common case, inlined
                b = fl.pop()
                self._held[b] = 1
                self._used[self._cur] += 1
                self._nfree -= 1
                self._in_use += 1
                out = [b]
            elif n <= self._nfree:
                out = self._take(n)
            else:
                out = None
            if out is not None:
                if len(self._reserve) < self.low and not self._wake.is_set():
                    self._wake.set()
                return out
        return self._alloc_slow(n, wait)

    def _take(self, n: int) -> list[int]:
        """Take ``n`` blocks from mapped chunks (lock held; ``n <= _nfree``)."""
        fl = self._curfree
        if len(fl) >= n:
            if n == 1:
                b = fl.pop()
                out = [b]
                self._held[b] = 1
            else:
                out = fl[-n:]
                del fl[-n:]
                held = self._held
                for b in out:
                    held[b] = 1
            self._used[self._cur] += n
        else:
            out = []
            held = self._held
            while len(out) < n:
                if not fl:
                    fl = self._next_chunk()
                k = min(len(fl), n - len(out))
                got = fl[-k:]
                del fl[-k:]
                for b in got:
                    held[b] = 1
                self._used[self._cur] += k
                out += got
        self._nfree -= n
        self._in_use += n
        return out

    def _next_chunk(self) -> list[int]:
        """Make the fullest partial chunk (else a reserve chunk) current."""
        buckets = self._buckets
        k = self._top
        while k > 0 and not buckets[k]:
            k -= 1
        self._top = k
        c = buckets[k].pop() if k > 0 else self._reserve.pop()
        self._cur = c
        self._curfree = self._free[c]  # type: ignore[assignment]
        return self._curfree

    def _demote(self) -> None:
        """(lock held) The current chunk goes back to its bucket (or the reserve)."""
        c, u = self._cur, self._used[self._cur]
        if u == 0:
            self._reserve.append(c)
        elif u < self.blocks_per_chunk:
            self._buckets[u].add(c)
            if u > self._top:
                self._top = u
        self._cur, self._curfree = -1, _EMPTY

    def free(self, ids: Iterable[int]) -> None:
        """Give blocks back. Raises ValueError (changing nothing) if one is not held."""
        ids = list(ids)
        bpc = self.blocks_per_chunk
        with self._lock:
            held = self._held
            i = 0
            try:
                for i, b in enumerate(ids):
                    if b < 0 or not held[b]:
                        raise ValueError(f"free: block {b!r} is not held")
                    held[b] = 0
            except (ValueError, IndexError, TypeError) as e:
                for b2 in ids[:i]:
                    held[b2] = 1
                if isinstance(e, ValueError):
                    raise
                raise ValueError(f"free: block {ids[i]!r} is not a block id") from None
            used, frees, buckets = self._used, self._free, self._buckets
            cur = self._cur
            for b in ids:
                c = b // bpc
                u = used[c] - 1
                used[c] = u
                frees[c].append(b)  # type: ignore[union-attr]
                if c == cur:
                    continue
                if u + 1 < bpc:
                    buckets[u + 1].discard(c)
                if u == 0:
                    self._reserve.append(c)
                else:
                    buckets[u].add(c)
                    if u > self._top:
                        self._top = u
            if cur >= 0 and used[cur] < self._top:
                self._demote()  # a fuller partial chunk exists: take blocks from it next
            n = len(ids)
            self._nfree += n
            self._in_use -= n
            self._ops += 1
            if len(self._reserve) > self.high and not self._wake.is_set():
                self._wake.set()

    # ---- slow path -------------------------------------------------------------------
    def _alloc_slow(self, n: int, wait: bool = True) -> list[int] | None:
        """Grant the chunks ``n`` blocks are missing and take the blocks in the same
        critical section that maps the chunks in: granted chunks go straight to this
        caller, so neither a reclaim nor the refill thread can release them first.
        Another thread may take free blocks while the grant is in flight; then more
        chunks are granted (each round grants at least one, so this ends)."""
        with self._lock:
            self.slow_allocs += 1
        while True:
            with self._lock:
                if n <= self._nfree:
                    return self._take(n)
                missing = n - self._nfree
                k = -(-missing // self.blocks_per_chunk)
                if not wait and self._demand:  # already asked in the background
                    self._demand = max(self._demand, k + self.high)
                    return None
                chunks = self._pick_unmapped(k)
                if chunks is None:
                    return None  # the virtual capacity is exhausted
            out = self._grow(chunks, into_reserve=False, speculative=not wait, take=n)
            if out is False:
                if not wait:  # ask for a burst's worth at once: one reclaim round, not many
                    with self._lock:
                        self._demand = max(self._demand, k + self.high)
                    self._wake.set()
                return None
            if out is not None:
                self._wake.set()
                return out

    def _pick_unmapped(self, k: int) -> list[int] | None:
        """(lock held) ``k`` unmapped chunks, lowest first, now in flight; None if fewer."""
        if k > len(self._unmapped):
            return None
        chunks = [heapq.heappop(self._unmapped) for _ in range(k)]
        self._inflight.update(chunks)
        return chunks

    def _units(self, chunks: Iterable[int]) -> list[int]:
        ppc = self.pages_per_chunk
        return [c * ppc + i for c in chunks for i in range(ppc)]

    def _grow(self, chunks: list[int], into_reserve: bool, speculative: bool | None = None,
              take: int = 0) -> bool | list[int] | None:
        """Grant and map ``chunks`` (in flight); on success they become mapped empty
        chunks. Speculative grants (reserve refills, by default) use free memory only.

        Without ``take``: True, or False when the daemon refused. With ``take``: the
        ``take`` blocks, taken under the lock that makes the chunks mapped (so no other
        thread ever sees them in the reserve first); None when other threads took free
        blocks meanwhile and ``take`` no longer fits (the chunks stay mapped); False
        when refused."""
        reserve = self._reserve_units(extra=chunks if into_reserve else ())
        if speculative is None:
            speculative = into_reserve
        try:
            self.group.grant(self._units(chunks), reserve=reserve, populate=self.populate,
                             in_use=self._in_use_bytes(), speculative=speculative)
        except KvpoolError as e:
            log.debug("grant of %d chunks failed: %s", len(chunks), e)
            with self._lock:
                self._inflight.difference_update(chunks)
                for c in chunks:
                    heapq.heappush(self._unmapped, c)
            return False
        bpc = self.blocks_per_chunk
        with self._lock:
            self.grants += 1
            for c in chunks:
                self._inflight.discard(c)
                self._free[c] = list(range((c + 1) * bpc - 1, c * bpc - 1, -1))
                self._used[c] = 0
                self._reserve.append(c)
            self._nfree += bpc * len(chunks)
            if take:
                return self._take(take) if take <= self._nfree else None
        return True

    def _shrink(self, k: int) -> int:
        """Release up to ``k`` reserve chunks (highest addresses first) in one request."""
        with self._lock:
            if not self._reserve:
                return 0
            self._reserve.sort()
            chunks = self._reserve[-k:]
            del self._reserve[-k:]
            for c in chunks:
                self._free[c] = None
            self._inflight.update(chunks)
            self._nfree -= self.blocks_per_chunk * len(chunks)
        released = False
        try:
            self.group.release(self._units(chunks), reserve=self._reserve_units(),
                               in_use=self._in_use_bytes())
            released = True
        finally:
            with self._lock:
                self._inflight.difference_update(chunks)
                for c in chunks:
                    heapq.heappush(self._unmapped, c)
                self.releases += released
        return len(chunks)

    def release_reserve(self, nbytes: int) -> int:
        """Give back empty chunks worth at least ``nbytes`` (or all of them) now; returns
        the bytes released. An empty current chunk counts. Refills pause for a second
        (the daemon wanted this memory elsewhere)."""
        per_chunk = self.chunk_bytes * self.group.n_regions
        k = -(-nbytes // per_chunk)
        if k <= 0:
            return 0
        with self._lock:
            if self._cur >= 0 and self._used[self._cur] == 0:
                self._demote()
            self._reclaimed_at = time.monotonic()
            self._backoff_until = max(self._backoff_until, self._reclaimed_at + 1.0)
        return self._shrink(k) * per_chunk

    # ---- background thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self.tick_s)
            self._wake.clear()
            if self._stopped:
                break
            tenant = self.group.tenant
            if tenant.closed:
                break
            if not tenant.connected:  # the daemon is away: the tenant thread reconnects
                self._wake.wait(0.05)
                continue
            try:
                self.rebalance()
                self._maybe_report()
            except Exception as e:
                if self._stopped or tenant.closed:
                    break
                if tenant.connected:
                    log.warning("refill thread: %s", e)
                self._backoff_until = time.monotonic() + 0.5

    def rebalance(self) -> None:
        """One refill/trim step (the background thread calls this; tests may too)."""
        if self._demand and time.monotonic() >= self._demand_after:
            self._serve_demand()
        now = time.monotonic()
        with self._lock:
            if self._ops != self._last_ops:
                self._last_ops = self._ops
                self._last_active = now
            idle = now - self._last_active >= self.idle_timeout_s
            low, high = (0, 0) if idle else (self.low, self.high)
            if idle and self._cur >= 0 and self._used[self._cur] == 0:
                self._demote()  # an empty current chunk drains too
            r = len(self._reserve)
            grow = high - r if r < low and now >= self._backoff_until else 0
            chunks = self._pick_unmapped(min(grow, len(self._unmapped))) if grow else None
        if chunks:
            if not self._grow(chunks, into_reserve=True):
                self._backoff_until = time.monotonic() + 0.2  # NO_MEMORY / OVER_LIMIT
        elif r > high:
            self._shrink(r - high)

    def _serve_demand(self) -> None:
        """Ask for the chunks a non-waiting ``alloc`` missed, waiting as long as the daemon
        holds the grant for reclaim; they land in the reserve for the next ``alloc``."""
        with self._lock:
            k, self._demand = self._demand, 0
            chunks = self._pick_unmapped(min(k, len(self._unmapped)))
        if chunks and not self._grow(chunks, into_reserve=True, speculative=False):
            self._demand_after = time.monotonic() + 0.02  # refused: do not hammer

    def _reserve_units(self, extra: Iterable[int] = ()) -> list[int]:
        with self._lock:
            chunks = list(self._reserve)
            if self._cur >= 0 and self._used[self._cur] == 0 and self._free[self._cur] is not None:
                chunks.append(self._cur)
        return self._units([*chunks, *extra])

    def _in_use_bytes(self) -> int:
        return self._in_use * self.block_bytes * self.group.n_regions

    def report(self) -> None:
        """Tell the daemon the current reserve and bytes in use (for ``ps``/``map``)."""
        state = (tuple(self._reserve_units()), self._in_use_bytes())
        self.group.report(in_use=state[1], reserve=list(state[0]))
        self._reported = state
        self._last_report = time.monotonic()

    def _maybe_report(self) -> None:
        if time.monotonic() - self._last_report < self.report_interval_s:
            return
        state = (tuple(self._reserve_units()), self._in_use_bytes())
        if state != self._reported:
            self.report()
        else:
            self._last_report = time.monotonic()

    # ---- introspection ---------------------------------------------------------------------
    def holdings(self) -> Holdings:
        """What this allocator holds now (for an engine deciding what to evict)."""
        with self._lock:
            mapped_chunks = sum(1 for f in self._free if f is not None)
            empty = len(self._reserve) + (
                1 if self._cur >= 0 and self._used[self._cur] == 0 else 0)
            nfree, in_use = self._nfree, self._in_use
        per_block = self.block_bytes * self.group.n_regions
        per_chunk = self.chunk_bytes * self.group.n_regions
        return Holdings(mapped=mapped_chunks * per_chunk, in_use=in_use * per_block,
                        free=nfree * per_block, reserve=empty * per_chunk, chunk=per_chunk,
                        mapped_chunks=mapped_chunks, reserve_chunks=empty)

    def chunk_of(self, block: int) -> int:
        """The chunk (release granularity) ``block`` lives in."""
        return block // self.blocks_per_chunk

    def held_by_chunk(self) -> dict[int, int]:
        """Mapped chunks with held blocks -> how many blocks each holds. Freeing every
        held block of a chunk lets the library release it: evict chunks with the fewest
        held blocks first to free whole units."""
        with self._lock:
            return {c: u for c, u in enumerate(self._used) if u and self._free[c] is not None}

    @property
    def unmapped_chunks(self) -> int:
        """Chunks of the virtual capacity with no memory behind them now."""
        return len(self._unmapped)

    @property
    def free_blocks(self) -> int:
        """Blocks allocatable without a message (mapped and free)."""
        return self._nfree

    @property
    def used_blocks(self) -> int:
        return self._in_use

    @property
    def reserve_chunks(self) -> int:
        return len(self._reserve)

    @property
    def mapped_chunks(self) -> int:
        return sum(1 for f in self._free if f is not None)

    def block_offset(self, block: int) -> int:
        """Byte offset of ``block`` inside each region."""
        return block * self.block_bytes

    def check_integrity(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent (see module doc)."""
        with self._lock:
            bpc = self.blocks_per_chunk
            unmapped = set(self._unmapped)
            assert len(unmapped) == len(self._unmapped), "a chunk is unmapped twice"
            reserve = set(self._reserve)
            assert len(reserve) == len(self._reserve), "a chunk is in the reserve twice"
            partial = set().union(*self._buckets)
            assert sum(map(len, self._buckets)) == len(partial), "a chunk is in two buckets"
            assert not self._buckets[0], "bucket 0 is not used"
            states = [unmapped, self._inflight, reserve, partial,
                      {self._cur} if self._cur >= 0 else set()]
            for i, a in enumerate(states):
                for b in states[i + 1:]:
                    assert not a & b, f"chunk states overlap: {sorted(a & b)[:8]}"
            nfree = in_use = 0
            for c in range(self.nchunks):
                fl = self._free[c]
                blocks = range(c * bpc, (c + 1) * bpc)
                held = sum(self._held[b] for b in blocks)
                if fl is None:
                    assert held == 0, f"unmapped chunk {c} has held blocks"
                    assert c in unmapped or c in self._inflight, f"chunk {c} is lost"
                    continue
                assert c not in unmapped, f"mapped chunk {c} is also unmapped"
                assert len(set(fl)) == len(fl), f"chunk {c} lists a free block twice"
                assert all(b in blocks and not self._held[b] for b in fl), f"chunk {c} free list"
                assert held + len(fl) == bpc, f"chunk {c}: {held} held + {len(fl)} free != {bpc}"
                assert self._used[c] == held, f"chunk {c}: used {self._used[c]} != held {held}"
                if c == self._cur:
                    assert self._curfree is fl, "current free list is stale"
                elif held == 0:
                    assert c in reserve, f"empty chunk {c} not in reserve"
                elif held < bpc:
                    assert c in self._buckets[held], f"partial chunk {c} not in bucket {held}"
                    assert held <= self._top, f"top {self._top} below a non-empty bucket"
                else:
                    assert c not in partial and c not in reserve, f"full chunk {c} listed"
                nfree += len(fl)
                in_use += held
            assert nfree == self._nfree, f"free count {self._nfree} != {nfree}"
            assert in_use == self._in_use, f"in-use count {self._in_use} != {in_use}"
            if not self._inflight:
                mapped_units = set(self._units(c for c in range(self.nchunks)
                                               if self._free[c] is not None))
                assert mapped_units == self.group.mapped, "group mapping != mapped chunks"

    # ---- teardown -----------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the background thread (the group's close unmaps and releases everything)."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop, then give every mapped chunk back (blocks still held are dropped)."""
        self.stop()
        with self._lock:
            chunks = [c for c in range(self.nchunks) if self._free[c] is not None]
            for c in chunks:
                self._free[c] = None
                self._used[c] = 0
                heapq.heappush(self._unmapped, c)
            self._held = bytearray(self.num_blocks)
            self._reserve.clear()
            for bucket in self._buckets:
                bucket.clear()
            self._cur, self._curfree = -1, _EMPTY
            self._nfree = self._in_use = 0
        if chunks and not self.group.closed:
            self.group.release(self._units(chunks))
        self.group.allocator = None
