"""The bundled engine's block pool with elastic memory behind it.

:class:`ElasticBlockPool` keeps the engine's own prefix-cache bookkeeping (it subclasses
:class:`FixedBlockPool`); free blocks come from and go back to the client library's
:class:`~kvpool.client_lib.ElasticBlockAllocator`.

When the daemon asks this tenant to shrink, :meth:`ElasticBlockPool.shrink` evicts cached
prefix blocks page-aware (chunks whose every held block is evictable first, so whole
units empty), and when that is not enough preempts running requests, newest first,
through ``Engine.preempt_until_free`` (the daemon only asks for memory above the
tenant's ``max(min, fair share)``); the library then releases the emptied units.

Invariants: block ids equal allocator block ids, block 0 (the engine's null block) is
allocated at start and never freed, and every block the engine references or caches is
held in the allocator (``check_integrity`` verifies both sides).

Request-aligned mode (:meth:`ElasticBlockPool.align_requests`, ``KVPOOL_REQUEST_ALIGNED``):
each request's blocks come from whole chunks only it uses (:mod:`.aligned`), so its KV is
whole units that can change hands (:mod:`.handoff`); the prefix cache is off then. That
part of the pool is :class:`~.aligned_pool.AlignedPoolMixin`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict

from kvpool.engine.block_pool import NULL_BLOCK, FixedBlockPool
from kvpool.engine.errors import PoolExhausted
from kvpool.engine_adapters.bundled.aligned import RequestChunks
from kvpool.engine_adapters.bundled.aligned_pool import AlignedPoolMixin
from kvpool.engine_adapters.bundled.settings import AdapterError

log = logging.getLogger("kvpool.adapter")

SHRINK_STEP_WAIT_S = 0.3  # a shrink waits this long for the engine's step (x3 when urgent)


class ElasticBlockPool(AlignedPoolMixin, FixedBlockPool):
    """The engine's block pool with elastic memory behind it.

    Capacity is the *virtual* block count; free blocks are whatever the allocator can hand
    out (mapped blocks on the fast path, more pages from the daemon on the slow path).
    Thread safety: every method runs under ``lock`` (an RLock) so the daemon-driven
    :meth:`shrink` (on the client library's thread) can evict between engine calls;
    preemption additionally takes ``step_lock``, which the bound engine holds per step.
    """

    def __init__(self, provisional_capacity: int) -> None:
        self.allocator = None
        self.engine = None
        self._provisional = provisional_capacity
        self.lock = threading.RLock()
        self.step_lock = threading.RLock()
        self.shrinks = self.shrink_preemptions = self.shrink_evictions = 0
        self.idle_evictions = 0
        self._stopped = threading.Event()
        self._idle_thread: threading.Thread | None = None
        self.aligned: RequestChunks | None = None  # request-aligned mode when set

    # ---- binding ------------------------------------------------------------------
    def bind(self, allocator) -> None:
        """Adopt ``allocator`` (its block ids become ours) and take block 0 as null."""
        super().__init__(allocator.num_blocks)
        self._free.clear()  # free blocks live in the allocator, not here
        self.allocator = allocator
        null = allocator.alloc(1)
        if null != [NULL_BLOCK]:
            raise AdapterError(f"expected the allocator's first block to be 0, got {null}")

    def bind_engine(self, engine) -> None:
        """Serialize the engine's steps with preemption requested by :meth:`shrink`."""
        if self.engine is engine:
            return
        self.engine = engine
        for name in ("step", "add_request", "abort"):
            method = getattr(engine, name)
            setattr(engine, name, self._locked(method))

    def start_idle_release(self, idle_timeout_s: float) -> None:
        """Once the bound engine has had no request and taken no step for
        ``idle_timeout_s``, evict its prefix cache so the allocator's own idle trim gives
        the emptied chunks back: an idle engine keeps one unit (the null block's), the
        rest flows to tenants that need it. Without this an idle engine's cache counts
        as held memory and fair share protects it (an idle tenant could keep half the
        budget). Eviction runs under ``step_lock`` with no request in the engine, so it
        cannot race a prefix hit being taken."""
        if self._idle_thread is not None or idle_timeout_s <= 0:
            return
        self._idle_thread = threading.Thread(
            target=self._idle_loop, args=(idle_timeout_s,), name="kvpool-idle-cache",
            daemon=True)
        self._idle_thread.start()

    def stop(self) -> None:
        """End the idle watcher (joined unless called from it)."""
        self._stopped.set()
        t = self._idle_thread
        if t is not None and t is not threading.current_thread():
            t.join()
            self._idle_thread = None

    def _idle_loop(self, timeout_s: float) -> None:
        tick = min(max(timeout_s / 4, 0.01), 0.5)
        last_steps, since = -1, time.monotonic()
        while not self._stopped.wait(tick):
            engine, alloc = self.engine, self.allocator
            if engine is None or alloc is None:
                continue
            if alloc.group.tenant.closed:
                return
            now = time.monotonic()
            steps = engine.counters["steps"]
            if steps != last_steps or engine.has_unfinished():
                last_steps, since = steps, now
                continue
            if now - since < timeout_s or not self._evictable:
                continue
            if not self.step_lock.acquire(blocking=False):
                continue  # a step or an add_request is under way: not idle
            try:
                if engine.has_unfinished():
                    continue
                with self.lock:
                    self.idle_evictions += len(self.evict_cached_blocks(None))
            except Exception:  # never let the watcher die on a transient error
                log.exception("idle cache release failed")
            finally:
                self.step_lock.release()

    def _locked(self, method):
        def call(*args, **kwargs):
            with self.step_lock:
                return method(*args, **kwargs)

        call.__wrapped__ = method
        return call

    @property
    def capacity(self) -> int:
        return self._provisional if self.allocator is None else self._capacity

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

    def free_blocks(self, block_ids) -> None:
        with self.lock:
            super().free_blocks(block_ids)

    def touch(self, block_ids) -> None:
        with self.lock:
            super().touch(block_ids)

    def get_cached_block(self, block_hash, tokens, parent):
        with self.lock:
            return super().get_cached_block(block_hash, tokens, parent)

    def cache_full_blocks(self, block_ids, hashes, tokens, parent) -> None:
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
            return self.allocator.used_blocks - len(self._evictable) - spare - 1  # minus null

    def held_bytes(self, block_bytes: int) -> int:
        return self.allocator.holdings().mapped

    # ---- giving memory back --------------------------------------------------------
    def shrink(self, nbytes: int, urgent: bool) -> None:
        """Free blocks worth ``nbytes`` so the library can release whole chunks.

        Page-aware: first the chunks whose held blocks are all evictable (fewest first),
        then any evictable block (LRU); then, since the daemon asks only for memory above
        this tenant's ``max(min, fair share)``, running requests (newest first: they
        requeue and recompute) and their freshly cached blocks. ``urgent`` (deadline
        near) only lets it wait longer for the engine's current step.
        """
        self.shrinks += 1
        want = max(1, math.ceil(nbytes / self.allocator.holdings().chunk))
        # Everything here runs between engine steps (``step_lock``): an eviction in the
        # middle of a step could take a prefix hit the scheduler found but has not yet
        # touched. Steps never wait on the daemon, so the wait is one step at most.
        if not self.step_lock.acquire(timeout=SHRINK_STEP_WAIT_S * (3 if urgent else 1)):
            return  # the library asks again if it is still short
        try:
            with self.lock:
                before = self._held_chunks()
                self._evict_whole_chunks(want)
                if before - self._held_chunks() < want and self._evictable:
                    self.evict_cached_blocks(None)
                # The daemon only asks for memory above max(min, fair share): what the
                # cache could not cover comes from running requests, newest first.
                target = before - want
                while self.engine is not None and self._held_chunks() > max(target, 1):
                    if not self._preempt_newest():
                        break
                    self.evict_cached_blocks(None)
        finally:
            self.step_lock.release()

    def _preempt_newest(self) -> int:
        """(both locks held) Preempt the newest running request, and more only while a
        preemption frees no block (shared prefix blocks); 0 when nothing runs. Goes
        through ``Engine.preempt_until_free``, the method ``check_engine`` verifies."""
        n = self.engine.preempt_until_free(self.get_num_free_blocks() + 1)
        self.shrink_preemptions += n
        return n

    def _evict_whole_chunks(self, want: int) -> int:
        held = self.allocator.held_by_chunk()
        evictable_in: dict[int, list[int]] = defaultdict(list)
        for b in self._evictable:
            evictable_in[self.allocator.chunk_of(b)].append(b)
        null_chunk = self.allocator.chunk_of(NULL_BLOCK)
        whole = sorted(
            (held[c], c) for c, blocks in evictable_in.items()
            if c != null_chunk and len(blocks) == held.get(c, -1)
        )
        emptied = 0
        for _, c in whole[:want]:
            for b in evictable_in[c]:
                del self._evictable[b]
                self._uncache(b)
            self._release(evictable_in[c], recent=False)
            self.shrink_evictions += len(evictable_in[c])
            emptied += 1
        return emptied

    def _held_chunks(self) -> int:
        return len(self.allocator.held_by_chunk())

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
            assert alloc.used_blocks == used + spare + 1, (
                f"allocator holds {alloc.used_blocks} blocks, pool accounts for {used} + "
                f"{spare} spare + null")
            for h, dups in self._by_hash.items():
                for b in dups:
                    assert self._entry[b].block_hash == h, f"hash index wrong for block {b}"
