"""Block pools: who owns which KV block, and the prefix cache of full blocks.

A block id is an opaque int in ``[0, capacity)``; id 0 is the null block (never handed
out, padding for block tables). Every other block is in exactly one state:

    free       ref_cnt == 0, not cached        -> handed out first
    evictable  ref_cnt == 0, cached (has hash) -> reusable by a prefix hit, evicted LRU
    used       ref_cnt  > 0 (cached or not)

The scheduler side depends only on the :class:`BlockPool` ABC, so an elastic pool (memory
granted by the kvpool daemon, shrinking at run time) can replace :class:`FixedBlockPool`.
``get_new_blocks`` is the only call that can fail for lack of memory; callers must not
assume an earlier ``get_num_free_blocks()`` guarantees it succeeds.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpool.engine.errors import PoolExhausted

if TYPE_CHECKING:
    from kvpool.engine.kv_events import KVEventSink

NULL_BLOCK = 0


@dataclass(frozen=True)
class CachedBlock:
    """What a cached block must hold for a lookup to hit: its chained hash, its own
    tokens, and the block (and that block's cache epoch) that precedes it. Comparing tokens
    and the parent makes a hit exact: equal hashes alone are never trusted."""

    block_hash: int
    tokens: tuple[int, ...]
    parent: int  # block id of the previous block, NULL_BLOCK for the first
    parent_epoch: int


class PoolUser(Protocol):
    """The engine as the pool it allocates from sees it (:meth:`BlockPool.bind_engine`):
    a pool whose memory can be taken back at run time (an elastic pool) acts between the
    engine's steps and may preempt its requests."""

    @property
    def step_lock(self) -> threading.RLock:
        """Held by the engine for each whole step, admission and abort; hold it to act
        between steps (never while waiting on something that waits for a step)."""

    @property
    def num_steps(self) -> int:
        """Steps taken so far (changes whenever the engine did work)."""

    def has_unfinished(self) -> bool:
        """Whether a request is running or waiting."""

    def preempt_until_free(self, num_blocks: int) -> int:
        """(``step_lock`` held) Preempt the newest running requests until the pool reports
        ``num_blocks`` free or nothing runs; returns how many were preempted."""


class BlockPool(ABC):
    """The allocation interface the KV manager uses (vLLM's BlockPool, narrowed).

    Ids are ints in ``[0, capacity)``, 0 reserved. Counts may change between calls (an
    elastic pool gains and loses memory at run time): never cache them.
    """

    null_block: int = NULL_BLOCK

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Upper bound (exclusive) of any block id this pool will ever return. Fixed for the
        pool's lifetime: the KV storage must hold this many blocks."""

    @abstractmethod
    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks (all or none), evicting LRU cached blocks if needed; each
        returned block has ref_cnt 1 and no cache entry.

        Raises:
            PoolExhausted: fewer than ``n`` blocks are available now; nothing was taken.
        """

    def get_blocks_for(self, owner: str, n: int) -> list[int]:
        """:meth:`get_new_blocks` on behalf of request ``owner``: a pool that keeps each
        request's KV in its own allocation units (request-aligned, so the units can
        change hands whole) uses the owner; others ignore it. Same contract otherwise."""
        return self.get_new_blocks(n)

    @abstractmethod
    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block. A block reaching 0 becomes free (uncached)
        or evictable (cached); evictable blocks are evicted in the order they were freed,
        so pass a request's blocks tail first. Raises AssertionError on a double free."""

    @abstractmethod
    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix hit); an evictable block becomes used."""

    @abstractmethod
    def get_cached_block(self, block_hash: int, tokens: Sequence[int], parent: int
                         ) -> int | None:
        """The id of a cached block holding exactly ``tokens`` after block ``parent``
        (NULL_BLOCK for the first block of a sequence) and the same chained hash, or None.
        Does not change reference counts (call :meth:`touch`)."""

    @abstractmethod
    def cache_full_blocks(self, block_ids: Sequence[int], hashes: Sequence[int],
                          tokens: Sequence[Sequence[int]], parent: int) -> None:
        """Register full, computed blocks for prefix reuse. ``block_ids[i]`` follows
        ``block_ids[i-1]`` (the first follows ``parent``). Blocks must be in use (ref_cnt
        > 0); already cached blocks are left as they are."""

    @abstractmethod
    def evict_cached_blocks(self, n: int | None = None) -> list[int]:
        """Evict up to ``n`` (all when None) evictable blocks, LRU first, making them free.
        Returns their ids. Used blocks are never touched."""

    @abstractmethod
    def get_num_free_blocks(self) -> int:
        """Blocks :meth:`get_new_blocks` could hand out right now (free + evictable)."""

    @property
    @abstractmethod
    def num_used_blocks(self) -> int:
        """Blocks with ref_cnt > 0."""

    @abstractmethod
    def ref_count(self, block_id: int) -> int:
        """Current references to ``block_id``."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a prefix-cache entry (used or evictable). 0 if not tracked."""
        return 0

    def get_usage(self) -> float:
        """Fraction of the currently available blocks that is in use."""
        used = self.num_used_blocks
        total = used + self.get_num_free_blocks()
        return used / total if total else 0.0

    def held_bytes(self, block_bytes: int) -> int:
        """Physical KV memory this pool holds now: all of it for a preallocated pool
        (elastic pools override this with what is actually mapped)."""
        return self.capacity * block_bytes

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cache entry; returns how many."""
        return len(self.evict_cached_blocks(None))

    def bind_events(self, sink: KVEventSink, block_size: int) -> None:
        """Report the prefix cache's changes to ``sink`` from now on (KV events,
        :mod:`kvpool.engine.kv_events`): a hash stored when its first cached block
        appears, removed when its last one goes. Called once, before the first
        allocation; a pool without a prefix cache ignores it."""

    def bind_engine(self, engine: PoolUser) -> None:
        """Called once by the engine that allocates from this pool, at the end of its
        construction. A pool that gives memory back at run time keeps ``engine`` (to act
        between its steps, to preempt); others ignore it."""

    def close(self) -> None:
        """The engine is closing (``Engine.close``): give back what the pool holds beyond
        the process (an elastic pool's memory and session). The engine does not allocate
        from it again. Idempotent; nothing for a preallocated pool."""


class FixedBlockPool(BlockPool):
    """A pool of ``num_blocks`` preallocated blocks (ids 1..num_blocks-1 usable).

    O(1) per block: a deque of free ids, an LRU OrderedDict of evictable ids and a hash map
    ``block_hash -> {block_id: None}`` (duplicates allowed so block tables stay append-only).
    """

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 2, "need the null block plus at least one usable block"
        self._capacity = num_blocks
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._entry: dict[int, CachedBlock] = {}  # cached block id -> its key
        self._by_hash: dict[int, dict[int, None]] = {}
        self._epoch = [0] * num_blocks  # bumped when a block's cache entry goes away
        self._events: KVEventSink | None = None
        self._block_size = 0

    def bind_events(self, sink: KVEventSink, block_size: int) -> None:
        self._events, self._block_size = sink, block_size

    @property
    def capacity(self) -> int:
        return self._capacity

    def get_new_blocks(self, n: int) -> list[int]:
        if n > len(self._free) + len(self._evictable):
            raise PoolExhausted(f"need {n} KV blocks, {self.get_num_free_blocks()} free")
        out: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._uncache(b)
            self._ref[b] = 1
            out.append(b)
        return out

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        released = []
        for b in block_ids:
            assert b != NULL_BLOCK and self._ref[b] > 0, f"double free of block {b}"
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._entry:
                    self._evictable[b] = None
                else:
                    released.append(b)
        if released:
            self._release(released, recent=True)

    def _release(self, blocks: list[int], recent: bool) -> None:
        """Blocks that are neither used nor cached any more go back to the free store;
        ``recent`` ones (just used) are reused first, evicted ones last. Subclasses whose
        memory comes from elsewhere (an elastic allocator) override this."""
        if recent:
            self._free.extendleft(blocks)  # reuse recently touched memory first
        else:
            self._free.extend(blocks)

    def touch(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if self._ref[b] == 0:
                del self._evictable[b]  # KeyError here would mean a hit on a free block
            self._ref[b] += 1

    def get_cached_block(self, block_hash: int, tokens: Sequence[int], parent: int
                         ) -> int | None:
        tokens = tuple(tokens)
        for b in self._by_hash.get(block_hash, ()):
            e = self._entry[b]
            if (e.tokens == tokens and e.parent == parent
                    and e.parent_epoch == self._epoch[parent]):
                return b
        return None

    def cache_full_blocks(self, block_ids: Sequence[int], hashes: Sequence[int],
                          tokens: Sequence[Sequence[int]], parent: int) -> None:
        run: list[tuple[int, Sequence[int]]] = []  # new hashes in a row, for one event
        run_parent: int | None = None
        for b, h, toks in zip(block_ids, hashes, tokens, strict=True):
            assert self._ref[b] > 0, f"caching unused block {b}"
            if b not in self._entry:
                self._entry[b] = CachedBlock(h, tuple(toks), parent, self._epoch[parent])
                dups = self._by_hash.setdefault(h, {})
                dups[b] = None
                if self._events is not None and len(dups) == 1:
                    if not run:
                        run_parent = self._hash_of(parent)
                    run.append((h, toks))
                elif run:
                    self._stored(run, run_parent)
                    run = []
            elif run:
                self._stored(run, run_parent)
                run = []
            parent = b
        if run:
            self._stored(run, run_parent)

    def _hash_of(self, block: int) -> int | None:
        e = self._entry.get(block) if block != NULL_BLOCK else None
        return e.block_hash if e is not None else None

    def _stored(self, run: list[tuple[int, Sequence[int]]], parent: int | None) -> None:
        assert self._events is not None
        self._events.stored([h for h, _ in run], parent,
                            [t for _, toks in run for t in toks], self._block_size)

    def evict_cached_blocks(self, n: int | None = None) -> list[int]:
        out: list[int] = []
        while self._evictable and (n is None or len(out) < n):
            b, _ = self._evictable.popitem(last=False)
            self._uncache(b)
            out.append(b)
        if out:
            self._release(out, recent=False)
        return out

    def get_num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self._capacity - 1 - self.get_num_free_blocks()

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entry)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` has a prefix-cache entry (used or evictable)."""
        return block_id in self._entry

    # --- blocks changing hands (handoff between engines) ----------------------------

    def cache_entries(self) -> list[tuple[int, CachedBlock]]:
        """Every cache entry whose whole parent chain is valid, as (block, entry):
        evictable ones first (LRU first), then those in use: what a warm restart hands to
        the next engine (its pool registers them with :meth:`adopt_blocks`)."""
        evictable = self._evictable
        order = [*evictable, *(b for b in self._entry if b not in evictable)]
        rank = {b: i for i, b in enumerate(order)}
        valid: set[int] = set()
        out: list[tuple[int, CachedBlock]] = []
        pending = [(b, self._entry[b]) for b in order]
        while pending:
            rest = []
            for b, e in pending:
                if e.parent == NULL_BLOCK or (e.parent in valid
                                              and e.parent_epoch == self._epoch[e.parent]):
                    valid.add(b)
                    out.append((b, e))
                elif e.parent in self._entry and e.parent not in valid:
                    rest.append((b, e))
            if len(rest) == len(pending):
                break
            pending = rest
        return sorted(out, key=lambda be: rank[be[0]])

    def forget_blocks(self, block_ids: Iterable[int]) -> None:
        """The memory of ``block_ids`` now belongs to another engine: their cache entries
        and references go, and they are *not* released (neither free nor evictable
        here). Only for a pool whose store can lose memory (an elastic one: its store
        no longer holds them either); a preallocated pool would count them leaked."""
        for b in block_ids:
            if b in self._entry:
                self._evictable.pop(b, None)
                self._uncache(b)
            self._ref[b] = 0

    def adopt_blocks(self, refs: Mapping[int, int],
                     entries: Iterable[tuple[int, int, Sequence[int], int]] = ()) -> None:
        """Blocks that arrived with their memory (the store holds them; they are in no
        free list here): block ``b`` takes ``refs[b]`` references, and each entry
        ``(block, hash, tokens, parent)`` is registered in the prefix cache, in LRU
        order (an entry's parent is an earlier entry or NULL_BLOCK); an entry block
        without references becomes evictable."""
        for b, n in refs.items():
            self._ref[b] = n
        for b, h, tokens, parent in entries:
            self._entry[b] = CachedBlock(h, tuple(tokens), parent, self._epoch[parent])
            dups = self._by_hash.setdefault(h, {})
            dups[b] = None
            if self._events is not None and len(dups) == 1:
                self._stored([(h, tokens)], self._hash_of(parent))
            if not refs.get(b):
                self._evictable[b] = None

    def _uncache(self, b: int) -> None:
        e = self._entry.pop(b)
        dups = self._by_hash[e.block_hash]
        del dups[b]
        if not dups:
            del self._by_hash[e.block_hash]
            if self._events is not None:
                self._events.removed([e.block_hash])
        self._epoch[b] += 1  # children cached after this entry no longer match

    def check_integrity(self) -> None:
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "duplicate id in free list"
        assert NULL_BLOCK not in free and NULL_BLOCK not in evictable, "null block handed out"
        assert self._ref[NULL_BLOCK] == 0, "null block referenced"
        assert not free & evictable, "block both free and evictable"
        for b in range(1, self._capacity):
            r = self._ref[b]
            assert r >= 0, f"negative ref count on block {b}"
            if b in free:
                assert r == 0 and b not in self._entry, f"free block {b} is used or cached"
            elif b in evictable:
                assert r == 0 and b in self._entry, f"evictable block {b} is used or uncached"
            else:
                assert r > 0, f"block {b} leaked: ref 0 but neither free nor evictable"
        n_hashed = 0
        for h, dups in self._by_hash.items():
            for b in dups:
                assert self._entry[b].block_hash == h, f"hash index wrong for block {b}"
                n_hashed += 1
        assert n_hashed == len(self._entry), "cache entries missing from the hash index"
        assert len(free) + len(evictable) + sum(1 for r in self._ref if r > 0) == \
            self._capacity - 1, "block states do not add up to the pool size"
