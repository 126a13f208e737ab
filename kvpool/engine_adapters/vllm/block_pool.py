"""vLLM's ``BlockPool`` with kvpool memory behind it (the scheduler seam).

vLLM keeps every free block in one queue (LRU), cached or not, and its scheduler asks
``get_num_free_blocks()`` before ``get_new_blocks()``. Here:

* the queue holds only blocks whose memory is mapped and which still carry a prefix-cache
  hash (evictable); a block freed without a hash goes straight back to the client
  library's :class:`~kvpool.client_lib.ElasticBlockAllocator` (so whole chunks can empty);
* ``get_num_free_blocks()`` is honest: mapped free blocks + evictable + a small stash, so
  vLLM's own checks stay exact and ``get_new_blocks`` never fails;
* when ``KVCacheManager.allocate_slots`` comes back empty-handed, :func:`allocate_slots`
  asks the allocator for the shortfall without waiting (free memory now, else a
  background request the daemon may serve by reclaiming from other tenants) and retries
  once; if the memory is not there yet it returns None, which vLLM's scheduler already
  treats as "keep the request waiting" (or preempts, for a running one). Nothing raises.

Shrink (the daemon asks for memory back) and idle release are the shared
:class:`~kvpool.engine_adapters.elastic.ElasticPolicy` (between engine steps: cached
blocks of chunks whose every held block is evictable, then any cached block, then
running requests newest first); this pool is its :class:`~kvpool.engine_adapters.elastic.
ElasticHooks`: vLLM's free queue is the evictable set, preemption is vLLM's own
``_preempt_request`` (the path ``reset_prefix_cache(reset_running_requests=True)``
uses), the step lock is the bridge's (held by the engine core's loop per step).

Invariant: a block is in exactly one of {allocator free, stash, queue (ref 0, hashed),
in use (ref > 0)}; block 0 is vLLM's null block and stays held, except asleep (the
policy's :meth:`~kvpool.engine_adapters.elastic.ElasticPolicy.sleep`: every page given
back; :mod:`.sleep`).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import AllBlocksCleared
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvpool.engine_adapters.elastic import ElasticPolicy
from kvpool.engine_adapters.vllm.settings import AdapterError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

    from kvpool.client_lib import ElasticBlockAllocator
    from kvpool.engine_adapters.vllm.bridge import VllmBridge

AllocateSlots = Callable[..., "KVCacheBlocks | None"]

log = logging.getLogger("kvpool.vllm")


# without the vllm extra BlockPool is Any (pyproject.toml's mypy overrides): both
# configurations type-check, hence the unused-ignore codes in this module
class VllmElasticPool(BlockPool):  # type: ignore[misc, unused-ignore]
    """vLLM's block pool over kvpool memory (see the module); the adapter contract's
    :class:`~kvpool.engine_adapters.elastic.ElasticHooks` for vLLM."""

    def __init__(self, num_gpu_blocks: int, *args: Any, bridge: VllmBridge, **kwargs: Any
                 ) -> None:
        """vLLM's arguments, and ``bridge``: this process's adapter (the patched
        coordinator passes it)."""
        super().__init__(num_gpu_blocks, *args, **kwargs)
        b = bridge
        allocator: ElasticBlockAllocator | None = b.allocator
        if allocator is None:
            raise AdapterError("kvpool: vLLM's scheduler runs in a process without the KV "
                               "cache (a multi-process executor); kvpool needs one rank")
        if allocator.num_blocks != num_gpu_blocks:
            raise AdapterError(f"kvpool: scheduler has {num_gpu_blocks} blocks, the KV cache "
                               f"{allocator.num_blocks}")
        self.bridge: VllmBridge = b
        self.allocator: ElasticBlockAllocator = allocator
        self.free_block_queue = FreeKVCacheBlockQueue([])  # only evictable blocks live here
        self._stash: list[int] = []
        self.lock: threading.RLock = threading.RLock()
        self.policy: ElasticPolicy = ElasticPolicy(self, allocator)
        b.pool = self

    # ---- allocation -----------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        cached: int = self.free_block_queue.num_free_blocks
        return self.allocator.free_blocks + cached + len(self._stash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks <= 0:
            return []
        with self.lock:
            if num_blocks > self.get_num_free_blocks():
                raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
            ids = self._stash[:num_blocks]
            del self._stash[:num_blocks]
            short = num_blocks - len(ids)
            mapped = min(short, self.allocator.free_blocks)
            if mapped:
                got = self.allocator.alloc(mapped, wait=False)
                if got is None:  # cannot happen: free_blocks are mapped
                    raise ValueError(f"Cannot get {mapped} mapped blocks")
                ids += got
            ret = [self.blocks[i] for i in ids]
            rest = num_blocks - len(ret)
            if rest:  # evict the least recently used cached blocks (they stay held)
                evicted = self.free_block_queue.popleft_n(rest)
                if self._reuse_watchers:
                    self._notify_reuse(evicted)
                for block in evicted:
                    self._maybe_evict_cached_block(block)
                ret += evicted
        caching = self.enable_caching
        for block in ret:
            assert block.ref_cnt == 0
            if caching:  # as vLLM does for every block it hands out
                self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
            if self.metrics_collector:
                self.metrics_collector.on_block_allocated(block)
        return ret

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        with self.lock:
            cached: list[KVCacheBlock] = []
            plain: list[int] = []
            other: dict[BlockPool, list[KVCacheBlock]] = {}
            for block in ordered_blocks:
                if block.pool is not None and block.pool is not self:
                    other.setdefault(block.pool, []).append(block)
                    continue
                block.ref_cnt -= 1
                if block.ref_cnt == 0 and not block.is_null:
                    if not self.enable_caching or (
                            block.block_hash is None
                            and block.block_id not in self.cached_block_hashes_by_block):
                        plain.append(block.block_id)
                    else:
                        cached.append(block)
            if plain:
                self.allocator.free(plain)
            self.free_block_queue.append_n(cached)
        for pool, blocks in other.items():
            pool.free_blocks(blocks)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        with self.lock:
            super().touch(blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        with self.lock:
            super().evict_blocks(block_ids)
            self._drop_unhashed()

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset (every hash gone) when no block is in use; the cached blocks go
        back to the allocator. (vLLM's own check counts unmapped blocks as used, so its
        body is done here: the hash maps, the blocks' hashes, metrics, the event.)"""
        with self.lock:
            null = 0 if self.asleep else 1
            if self.allocator.used_blocks - self.free_block_queue.num_free_blocks - len(
                    self._stash) != null:
                log.warning("Failed to reset prefix cache because some blocks are in use")
                return False
            self.evict_cached(None)
            self.stash_free()
            self.cached_block_hash_to_block = (
                BlockHashToBlockMap())  # type: ignore[no-untyped-call, unused-ignore]
            self.cached_block_hashes_by_block.clear()
            if self._reuse_watchers:
                self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
            for block in self.blocks:
                block.reset_hash()  # type: ignore[no-untyped-call, unused-ignore]
            if self.metrics_collector:
                self.metrics_collector.reset()
            if self.enable_kv_cache_events:
                self.kv_event_queue.append(AllBlocksCleared())
            log.info("kvpool: prefix cache reset")
            return True

    def get_usage(self) -> float:
        """Fraction of the mapped memory in use (of the virtual capacity it would be ~0)."""
        h = self.allocator
        mapped = h.used_blocks + h.free_blocks
        return 0.0 if mapped <= 1 else 1.0 - self.get_num_free_blocks() / (mapped - 1)

    def stash_free(self) -> None:
        """Give stashed blocks back to the allocator."""
        with self.lock:
            if self._stash:
                self.allocator.free(self._stash)
                self._stash = []

    def grow(self, n: int) -> bool:
        """Try to have ``n`` more free blocks than now (no waiting); True if they are here.

        The allocator's free blocks already count as free here: they are taken into the
        stash with the ``n`` new ones (asking the allocator for ``n`` alone would take
        free blocks first and gain nothing, and a request needing more than the
        allocator's reserve would wait for ever on an idle engine)."""
        if n <= 0:
            return True
        got = self.allocator.alloc(self.allocator.free_blocks + n, wait=False)
        if got is None:
            return False
        with self.lock:
            self._stash += got
        return True

    # ---- eviction -------------------------------------------------------------------
    def _drop_unhashed(self) -> None:
        """(lock held) Queue blocks that lost their hash go back to the allocator."""
        q = self.free_block_queue
        gone = [b for b in q.get_all_free_blocks() if b.block_hash is None]
        for b in gone:
            q.remove(b)
        if gone:
            self.allocator.free([b.block_id for b in gone])

    def evict_cached(self, n: int | None = None) -> int:
        """Evict up to ``n`` (None: all) cached blocks, LRU first, into the allocator."""
        with self.lock:
            q = self.free_block_queue
            k: int = q.num_free_blocks if n is None else min(n, q.num_free_blocks)
            if k <= 0:
                return 0
            blocks = q.popleft_n(k)
            if self._reuse_watchers:
                self._notify_reuse(blocks)
            for b in blocks:
                self._maybe_evict_cached_block(b)
            self.allocator.free([b.block_id for b in blocks])
            return k

    # ---- the hooks of the shared policy (ElasticHooks) -------------------------------
    @property
    def step_lock(self) -> threading.RLock:
        return self.bridge.step_lock

    def evictable_blocks(self) -> Iterable[int]:
        return [b.block_id for b in self.free_block_queue.get_all_free_blocks()]

    def evict_listed(self, blocks: list[int]) -> None:
        with self.lock:
            gone = [self.blocks[i] for i in blocks]
            for b in gone:
                self.free_block_queue.remove(b)
                self._reuse_watchers.pop(b.block_id, None)
                self._maybe_evict_cached_block(b)
            self.allocator.free(blocks)

    def has_cache(self) -> bool:
        return bool(self.free_block_queue.num_free_blocks or self._stash)

    def release_stash(self) -> None:
        self.stash_free()

    def preempt_newest(self) -> int:
        sched = self.bridge.scheduler
        if sched is None or not sched.running:
            return 0
        req = sched.running.pop()
        sched._preempt_request(req, time.monotonic(), drop_stale_output=True)
        sched.prev_step_scheduled_req_ids.discard(req.request_id)
        return 1

    def activity(self) -> int | None:
        sched = self.bridge.scheduler
        if (sched is None or self.allocator.group.tenant.closed
                or sched.has_unfinished_requests()):
            return None
        return self.allocator.ops

    # ---- giving memory back -----------------------------------------------------------
    def shrink(self, nbytes: int, urgent: bool) -> None:
        """The tenant's shrink callback (:meth:`ElasticPolicy.shrink`), said on stderr."""
        done = self.policy.shrink(nbytes, urgent)
        if done is not None:
            print(f"kvpool: shrink of {nbytes} B: evicted {done.evicted} cached block(s), "
                  f"preempted {done.preempted} request(s)", file=sys.stderr, flush=True)

    def start_idle_release(self, idle_timeout_s: float) -> None:
        """After ``idle_timeout_s`` with no request in the engine, evict the prefix cache so
        the allocator's idle trim returns the emptied chunks (an idle server keeps only
        the null block's chunk)."""
        self.policy.start_idle_release(idle_timeout_s)

    def stop(self) -> None:
        self.policy.stop()

    # ---- sleep (the shared policy's sleep and wake; :mod:`.sleep`) -------------------------
    @property
    def asleep(self) -> bool:
        """Every KV page given back (:meth:`ElasticPolicy.sleep`), until its wake."""
        return self.policy.asleep

    def empty_for_sleep(self) -> None:
        """Reset the prefix cache (cached blocks and stash back to the allocator);
        AdapterError (nothing given back) while a block is in use."""
        if not self.reset_prefix_cache():
            raise self.sleep_error("cannot sleep: KV blocks are in use")

    def sleep_error(self, message: str) -> Exception:
        return AdapterError(f"kvpool: {message}")

    def publish_removals(self) -> None:
        """What this shrink, idle release or sleep removed, on vLLM's KV-events stream
        now (:func:`.kv_events.publish_pending`: vLLM itself would send it only after
        the next step)."""
        from kvpool.engine_adapters.vllm.kv_events import publish_pending

        publish_pending(self.bridge.scheduler)

    def check_integrity(self) -> None:
        with self.lock:
            a = self.allocator
            a.check_integrity()
            queued = {b.block_id for b in self.free_block_queue.get_all_free_blocks()}
            used = sum(1 for blk in self.blocks[1:] if blk.ref_cnt > 0)
            null = 0 if self.asleep else 1
            assert a.used_blocks == null + used + len(queued) + len(self._stash), (
                f"allocator holds {a.used_blocks}, pool accounts for {null} + {used} + "
                f"{len(queued)} + {len(self._stash)}")
            for i in queued | set(self._stash):
                assert a.is_held(i), f"free block {i} not held"
            for blk in self.blocks[1:]:
                if not a.is_held(blk.block_id):
                    assert blk.block_hash is None, f"block {blk.block_id} free but hashed"


def allocate_slots(original: AllocateSlots) -> AllocateSlots:
    """Wrap ``KVCacheManager.allocate_slots``: on a shortfall ask kvpool (without waiting)
    for the missing blocks and try once more; None still means "not now".

    The success path is one extra call frame: nothing is counted or locked. Only when vLLM
    says no is the call repeated with the coordinator's block count recorded (a refused
    ``allocate_slots`` has changed nothing but idempotent skipped-block frees), so the
    shortfall asked of kvpool is exact."""

    @functools.wraps(original)
    def allocate_slots(self: KVCacheManager, request: Request, num_new_tokens: int,
                       *args: Any, **kwargs: Any) -> KVCacheBlocks | None:
        out = original(self, request, num_new_tokens, *args, **kwargs)
        if out is not None:
            return out
        pool = self.block_pool
        if not isinstance(pool, VllmElasticPool):
            return None
        coord = self.coordinator
        count = coord.get_num_blocks_to_allocate
        needed = 0

        def counted(*a: Any, **k: Any) -> int:
            nonlocal needed
            n: int = count(*a, **k)
            needed = max(needed, n)
            return n

        # this call only (an instance attribute over vLLM's own method)
        coord.get_num_blocks_to_allocate = counted  # type: ignore[method-assign, unused-ignore]
        try:
            out = original(self, request, num_new_tokens, *args, **kwargs)
        finally:
            del coord.get_num_blocks_to_allocate
        if out is not None:  # a shrink or grant landed in between
            return out
        reserved: int = kwargs.get("reserved_blocks", 0)
        short = needed + self.watermark_blocks + reserved - pool.get_num_free_blocks()
        if short <= 0 or not pool.grow(short):
            return None
        out = original(self, request, num_new_tokens, *args, **kwargs)
        if out is None:
            pool.stash_free()
        return out

    return allocate_slots
