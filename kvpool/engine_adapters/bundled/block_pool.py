"""The bundled engine's block pool with elastic memory behind it.

:class:`BundledElasticPool` keeps the engine's own prefix-cache bookkeeping (it subclasses
:class:`FixedBlockPool`); free blocks come from and go back to the client library's
:class:`~kvpool.client_lib.ElasticBlockAllocator`. It is the bundled engine's side of the
adapter contract (:mod:`kvpool.engine_adapters.elastic`): it implements
:class:`~kvpool.engine_adapters.elastic.ElasticHooks` (evictable blocks, preempting the
newest request through ``Engine.preempt_until_free``, the engine's ``step_lock``) and the
shared :class:`~kvpool.engine_adapters.elastic.ElasticPolicy` does the shrink (whole
chunks of cache fewest-held first, then all of it, then preempt newest) and the idle
release. The engine binds itself (``BlockPool.bind_engine``) and closes the pool
(``Engine.close`` -> :meth:`BundledElasticPool.close`, which ends the adapter's tenant).

Invariants: block ids equal allocator block ids, block 0 (the engine's null block) is
allocated at start and never freed, and every block the engine references or caches is
held in the allocator (``check_integrity`` verifies both sides).

Request-aligned mode (:meth:`BundledElasticPool.align_requests`, ``KVPOOL_REQUEST_ALIGNED``):
each request's blocks come from whole chunks only it uses (:class:`~.aligned.RequestChunks`
keeps those books), so its KV is whole units that can change hands (:mod:`.handoff`);
the prefix cache is off then. The daemon calls of that mode run without ``lock`` (a
shrink of this tenant never waits behind them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvpool.engine.block_pool import NULL_BLOCK, FixedBlockPool, PoolUser
from kvpool.engine.errors import PoolExhausted
from kvpool.engine_adapters.bundled.aligned import RequestChunks
from kvpool.engine_adapters.bundled.settings import AdapterError
from kvpool.engine_adapters.elastic import ElasticPolicy

if TYPE_CHECKING:
    from kvpool.client_lib import ElasticBlockAllocator
    from kvpool.engine.engine import Engine


class BundledElasticPool(FixedBlockPool):
    """The engine's block pool with elastic memory behind it.

    Capacity is the *virtual* block count; free blocks are whatever the allocator can hand
    out (mapped blocks on the fast path, more pages from the daemon on the slow path).
    Thread safety: every method runs under ``lock`` (an RLock) so the daemon-driven
    :meth:`shrink` (on the client library's thread) can evict between engine calls;
    preemption additionally takes ``step_lock`` (the bound engine's, held per step).
    Lifetime: built with a provisional capacity, :meth:`bind` adopts the allocator (from
    then on ``allocator`` and ``policy`` are set), the engine binds itself, and
    :meth:`close` (the engine's ``close``) stops the idle watcher and calls ``on_close``.
    """

    def __init__(self, provisional_capacity: int,
                 on_close: Callable[[], None] | None = None) -> None:
        self._null_kept = True  # block 0 not handed over (warm restart) (sleep: policy)
        self._allocator: ElasticBlockAllocator | None = None
        self._policy: ElasticPolicy | None = None
        self.engine: PoolUser | None = None
        self._provisional = provisional_capacity
        self._on_close = on_close
        self.lock = threading.RLock()
        self._unbound_step_lock = threading.RLock()  # until an engine is bound
        self.aligned: RequestChunks | None = None  # request-aligned mode when set

    # ---- binding ------------------------------------------------------------------
    def bind(self, allocator: ElasticBlockAllocator) -> None:
        """Adopt ``allocator`` (its block ids become ours); block 0 is the null block,
        which the allocator took for us before its background thread started
        (``ElasticBlockAllocator(..., take_first=1)``)."""
        super().__init__(allocator.num_blocks)
        self._free.clear()  # free blocks live in the allocator, not here
        self._allocator = allocator
        self._policy = ElasticPolicy(self, allocator)
        null = allocator.first_blocks
        if not null:
            raise AdapterError(f"no memory for the KV cache's first chunk: "
                               f"{allocator.last_refusal or 'the daemon refused the grant'}")
        if null != [NULL_BLOCK]:
            raise AdapterError(f"expected the allocator's first block to be 0, got {null}")
        self._null_kept = True

    def null_given_away(self) -> None:
        """(``lock`` held) The null block's chunk went to another engine with a handover
        (warm restart, :func:`~.handoff_cache.settle_cache`): this pool no longer holds
        block 0, its books say so, and it hands out no block again (a later mapping of
        that chunk must never give block 0 to a request): the engine is retired."""
        self._null_kept = False

    def bind_engine(self, engine: PoolUser) -> None:
        """Preempt through ``engine`` and serialize with its steps (its ``step_lock``)."""
        self.engine = engine

    @property
    def allocator(self) -> ElasticBlockAllocator:
        if self._allocator is None:
            raise AdapterError("the elastic pool has no allocator yet (not bound)")
        return self._allocator

    @property
    def policy(self) -> ElasticPolicy:
        """The shared shrink and idle-release policy (and its counters), once bound."""
        if self._policy is None:
            raise AdapterError("the elastic pool has no allocator yet (not bound)")
        return self._policy

    @property
    def step_lock(self) -> threading.RLock:
        """The bound engine's ``step_lock`` (a lock of the pool's own before that)."""
        engine = self.engine
        return self._unbound_step_lock if engine is None else engine.step_lock

    def start_idle_release(self, idle_timeout_s: float) -> None:
        """Once the bound engine has had no request and taken no step for
        ``idle_timeout_s``, evict its prefix cache so the allocator's own idle trim gives
        the emptied chunks back (:meth:`ElasticPolicy.start_idle_release`)."""
        self.policy.start_idle_release(idle_timeout_s)

    def shrink(self, nbytes: int, urgent: bool) -> None:
        """The tenant's shrink callback (:meth:`ElasticPolicy.shrink`)."""
        self.policy.shrink(nbytes, urgent)

    def stop(self) -> None:
        """End the idle watcher (joined unless called from it)."""
        if self._policy is not None:
            self._policy.stop()

    def close(self) -> None:
        """The engine closes: stop the idle watcher and end what ``on_close`` ends (the
        bridge's tenant: the memory goes back). Idempotent."""
        self.stop()
        if self._on_close is not None:
            self._on_close()

    # ---- sleep (the shared policy's; :mod:`.sleep`) -------------------------------------
    @property
    def asleep(self) -> bool:
        """Every block given back (:meth:`ElasticPolicy.sleep`), until its wake."""
        return self._policy is not None and self._policy.asleep

    @property
    def _null_held(self) -> bool:
        """Block 0 is ours: not given away with a handover, not given back asleep."""
        return self._null_kept and not self.asleep

    @property
    def capacity(self) -> int:
        return self._provisional if self._allocator is None else self._capacity

    # ---- the hooks of the shared policy (ElasticHooks; both locks held) -------------
    def evictable_blocks(self) -> Iterable[int]:
        return self._evictable

    def evict_listed(self, blocks: list[int]) -> None:
        for b in blocks:
            del self._evictable[b]
            self._uncache(b)
        self._release(blocks, recent=False)

    def evict_cached(self) -> int:
        return len(self.evict_cached_blocks(None))

    def has_cache(self) -> bool:
        return bool(self._evictable)

    def release_stash(self) -> None:
        """(no stash: blocks are taken from the allocator only when handed out)"""

    def preempt_newest(self) -> int:
        """Preempt the newest running request, and more only while a preemption frees no
        block (shared prefix blocks); 0 when nothing runs. Goes through
        ``Engine.preempt_until_free``, the method ``check_engine`` verifies."""
        engine = self.engine
        if engine is None:
            return 0
        return engine.preempt_until_free(self.get_num_free_blocks() + 1)

    def activity(self) -> int | None:
        engine = self.engine
        if engine is None or engine.has_unfinished():
            return None
        return engine.num_steps

    def empty_for_sleep(self) -> None:
        """Evict the prefix cache; refused (AdapterError) for a retired engine, a block
        in use, or a request-aligned pool with spare chunks."""
        if not self._null_kept:
            raise AdapterError("this engine handed its cache over (retired): it "
                               "cannot sleep")
        self.evict_cached_blocks(None)
        spare = self.aligned.num_spare if self.aligned is not None else 0
        if self.allocator.used_blocks != 1 + spare or spare:
            raise AdapterError(f"cannot sleep: {self.allocator.used_blocks - 1} KV "
                               "block(s) are in use")

    def sleep_error(self, message: str) -> Exception:
        return AdapterError(message)

    def publish_removals(self) -> None:
        """(the engine's KV-events publisher sends what the pool reported by itself,
        within :data:`kvpool.engine.kv_events.FLUSH_S`)"""

    # ---- allocation ---------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[int]:
        # Cheapest first: mapped free blocks, then our own evictable cache (local, keeps
        # the tenant's footprint), then free memory from the daemon. Memory that needs
        # reclaiming from others is asked for by the allocator's thread (wait=False):
        # the step loop never waits on arbitration, it keeps its running requests
        # going and admits the waiting ones once the memory lands. ``lock`` is not held
        # across the daemon call, so a shrink of this tenant never waits behind it.
        # Fast path (every decode step calls this, mostly with n == 0): no pool lock
        # unless the cache must be evicted. The free count and the evictable set read
        # without the lock are only a hint; eviction rechecks under it.
        if n <= 0:
            return []
        if not self._null_held:
            raise AdapterError("this engine is asleep: it allocates no blocks until it "
                               "wakes" if self.asleep else "this engine handed its null "
                               "block over with its cache (warm restart): it allocates no "
                               "more blocks")
        alloc = self.allocator
        if n > alloc.free_blocks and self._evictable:
            with self.lock:
                short = n - alloc.free_blocks
                if short > 0 and self._evictable:
                    self.evict_cached_blocks(min(short, len(self._evictable)))
        out = alloc.alloc(n, wait=False)
        if out is None:
            with self.lock:
                evicted = self.evict_cached_blocks(None)
            out = alloc.alloc(n, wait=False) if evicted else None
        if out is None:
            raise PoolExhausted(f"kvpool has no memory for {n} more KV block(s) now")
        # No lock needed: the blocks are new (not evictable, so a shrink cannot touch
        # them) and shrink's preemption excludes the engine step through ``step_lock``.
        ref = self._ref
        for b in out:
            ref[b] = 1
        return out

    def _release(self, blocks: list[int], recent: bool) -> None:
        if self.aligned is not None:
            loose, whole = self.aligned.release(blocks)
            blocks = loose + whole
        if blocks:
            self.allocator.free(blocks)

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        with self.lock:
            super().free_blocks(block_ids)

    def touch(self, block_ids: Iterable[int]) -> None:
        with self.lock:
            super().touch(block_ids)

    def get_cached_block(self, block_hash: int, tokens: Sequence[int], parent: int
                         ) -> int | None:
        with self.lock:
            return super().get_cached_block(block_hash, tokens, parent)

    def cache_full_blocks(self, block_ids: Sequence[int], hashes: Sequence[int],
                          tokens: Sequence[Sequence[int]], parent: int) -> None:
        with self.lock:
            super().cache_full_blocks(block_ids, hashes, tokens, parent)

    def evict_cached_blocks(self, n: int | None = None) -> list[int]:
        with self.lock:
            return super().evict_cached_blocks(n)

    def get_num_free_blocks(self) -> int:
        """Blocks this pool could hand out: mapped free, evictable, and the virtual
        capacity not mapped yet. Optimistic on purpose: whether the daemon grants the
        unmapped part is decided at allocation, which fails fast (and asks the daemon in
        the background) when it cannot; counting only mapped blocks would cap admission
        at the local reserve and never ask the daemon for more."""
        alloc = self.allocator
        with self.lock:
            return (alloc.free_blocks + len(self._evictable)
                    + alloc.unmapped_chunks * alloc.blocks_per_chunk)

    @property
    def num_used_blocks(self) -> int:
        with self.lock:
            spare = self.aligned.num_spare if self.aligned is not None else 0
            null = 1 if self._null_held else 0
            return self.allocator.used_blocks - len(self._evictable) - spare - null

    def held_bytes(self, block_bytes: int) -> int:
        return self.allocator.holdings().mapped

    # ---- request-aligned mode ---------------------------------------------------------
    def align_requests(self) -> None:
        """Give each request its own chunks from now on (before any request runs)."""
        self.aligned = RequestChunks(self.allocator.blocks_per_chunk)

    def get_blocks_for(self, owner: str, n: int) -> list[int]:
        aligned = self.aligned
        if aligned is None:
            return self.get_new_blocks(n)
        if n <= 0:
            return []
        # Only the engine's thread allocates for ``owner``, so its spares cannot change
        # between the count and the take; the daemon call runs without ``lock``.
        with self.lock:
            k = aligned.chunks_needed(owner, n)
        fresh = self.allocator.alloc_chunks(k, wait=False) if k else []
        if fresh is None:
            raise PoolExhausted(f"kvpool has no memory for {k} more KV chunk(s) now")
        with self.lock:
            out = aligned.take(owner, n, fresh)
            for b in out:
                self._ref[b] = 1
            return out

    def _aligned_books(self) -> RequestChunks:
        if self.aligned is None:
            raise AdapterError("the pool is not request-aligned")
        return self.aligned

    def request_chunks(self, rid: str) -> list[int]:
        """The chunks request ``rid`` owns, in the order its blocks fill them."""
        with self.lock:
            return list(self._aligned_books().chunks.get(rid, []))

    def forget_request(self, rid: str, block_ids: list[int]) -> list[int]:
        """Another tenant claimed ``rid``'s chunks (the group unmapped them): its blocks
        lose their reference, the chunks leave the books unmapped. Returns them."""
        with self.lock:
            for b in block_ids:
                assert self._ref[b] == 1, f"handed-over block {b} is shared"
            self.forget_blocks(block_ids)
            chunks = self._aligned_books().forget(rid)
            self.allocator.forget_chunks(chunks)
            return chunks

    def adopt_request(self, rid: str, chunks: list[int], block_ids: list[int]) -> None:
        """``chunks`` (adopted by the allocator, wholly held) now belong to ``rid``,
        which uses ``block_ids`` of them (ref 1 each)."""
        with self.lock:
            self._aligned_books().adopt(rid, chunks, block_ids)
            self.adopt_blocks({b: 1 for b in block_ids})

    def check_integrity(self) -> None:
        with self.lock:
            alloc = self.allocator
            alloc.check_integrity()
            assert self._ref[NULL_BLOCK] == 0, "null block referenced"
            assert not self._free, "elastic pool keeps no free list of its own"
            used = 0
            for b in range(1, self._capacity):
                r = self._ref[b]
                assert r >= 0, f"negative ref count on block {b}"
                if r > 0 or b in self._evictable:
                    assert alloc.is_held(b), f"block {b} in use or cached but not held"
                    assert (b in self._evictable) == (r == 0), f"block {b} state mixed up"
                    used += 1
                else:
                    assert b not in self._entry, f"free block {b} still cached"
            spare = 0
            if self.aligned is not None:
                self.aligned.check()
                spare = self.aligned.num_spare
                for c, blocks in self.aligned.spare.items():
                    for b in blocks:
                        assert self._ref[b] == 0 and alloc.is_held(b), f"spare block {b}"
            null = 1 if self._null_held else 0
            assert alloc.used_blocks == used + spare + null, (
                f"allocator holds {alloc.used_blocks} blocks, pool accounts for {used} + "
                f"{spare} spare + {null} null")
            for h, dups in self._by_hash.items():
                for b in dups:
                    assert self._entry[b].block_hash == h, f"hash index wrong for block {b}"


def elastic_pool(engine: Engine) -> BundledElasticPool:
    """``engine``'s pool, which must be this adapter's (AdapterError otherwise)."""
    pool = engine.pool
    if not isinstance(pool, BundledElasticPool):
        raise AdapterError("the engine does not allocate through kvpool (not enabled)")
    return pool
