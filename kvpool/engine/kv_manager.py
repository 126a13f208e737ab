"""KVCacheManager: maps requests to block lists on top of any :class:`BlockPool`.

The scheduler sees only this class. ``allocate_slots`` is the single place where running
out of memory shows up, as a ``None`` return.
"""

from __future__ import annotations

from kvpool.engine.block_pool import NULL_BLOCK, BlockPool
from kvpool.engine.errors import PoolExhausted
from kvpool.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of ``req`` as (block ids, tokens). The hit is capped at
        ``num_tokens - 1`` so at least one token is computed (its logits are needed).
        Reference counts are unchanged until :meth:`allocate_slots` takes the blocks."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        blocks: list[int] = []
        parent = NULL_BLOCK
        for i in range((req.num_tokens - 1) // bs):
            b = self.pool.get_cached_block(req.block_hash(i, bs), req.block_tokens(i, bs),
                                           parent)
            if b is None:
                break
            blocks.append(b)
            parent = b
        return blocks, len(blocks) * bs

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of K/V::

            | computed (held) | computed_blocks (prefix hit) | new tokens |
            ^ req.num_computed_tokens

        ``computed_blocks`` is only for a request that holds no blocks yet; on success
        they are taken (ref +1), ``req.num_computed_tokens`` advances past them and the
        newly allocated ids are returned. On ``None`` (pool short) nothing changed.
        """
        hit = computed_blocks or []
        assert not hit or not req.block_ids, "prefix hit for a request that holds blocks"
        computed = req.num_computed_tokens + len(hit) * self.block_size
        need = self.num_new_blocks(req, num_new_tokens, hit)
        if hit:
            self.pool.touch(hit)  # first, so allocating cannot evict the hit blocks
        try:
            new = self.pool.get_blocks_for(req.request_id, max(need, 0))
        except PoolExhausted:
            if hit:
                self.pool.free_blocks(reversed(hit))
            return None
        if hit:
            req.block_ids.extend(hit)
            req.num_cached_blocks = len(hit)
            req.num_computed_tokens = computed
            req.num_prefix_hit_tokens = len(hit) * self.block_size
        req.block_ids.extend(new)
        return new

    def num_new_blocks(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> int:
        """Blocks :meth:`allocate_slots` would take from the pool for the same arguments."""
        hit = len(computed_blocks or [])
        total = req.num_computed_tokens + hit * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_ids) - hit)

    def cache_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        """Register the request's full blocks among its first ``num_tokens`` tokens (default:
        the computed ones) in the prefix cache. The scheduler passes the tokens this step
        will have computed, so a later request of the same step can hit them (see
        :mod:`kvpool.engine.scheduler` for why that is safe)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = (req.num_computed_tokens if num_tokens is None else num_tokens) // bs
        first = req.num_cached_blocks
        if full <= first:
            return
        idx = range(first, full)
        self.pool.cache_full_blocks(
            req.block_ids[first:full], [req.block_hash(i, bs) for i in idx],
            [req.block_tokens(i, bs) for i in idx],
            req.block_ids[first - 1] if first else NULL_BLOCK)
        req.num_cached_blocks = full

    def free(self, req: Request) -> None:
        """Release all of the request's blocks, tail first (evicted first)."""
        self.pool.free_blocks(reversed(req.block_ids))
        req.block_ids = []
        req.num_cached_blocks = 0

    def usage(self) -> float:
        return self.pool.get_usage()
