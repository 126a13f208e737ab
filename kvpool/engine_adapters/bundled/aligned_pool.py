"""The request-aligned half of :class:`~.block_pool.ElasticBlockPool`: allocating a
request's blocks from chunks only it uses (:mod:`.aligned`), and handing those chunks to
another tenant or adopting them from one (:mod:`.handoff`).

Invariants: the mode is on once :meth:`AlignedPoolMixin.align_requests` has run (before
any request); every method runs under the pool's ``lock``, except the daemon calls,
which run without it (a shrink of this tenant never waits behind them).
"""

from __future__ import annotations

from kvpool.engine.errors import PoolExhausted
from kvpool.engine_adapters.bundled.aligned import RequestChunks


class AlignedPoolMixin:
    """Request-aligned allocation and handover for the elastic pool (see the module)."""

    aligned: RequestChunks | None  # request-aligned mode when set

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

    def request_chunks(self, rid: str) -> list[int]:
        """The chunks request ``rid`` owns, in the order its blocks fill them."""
        with self.lock:
            return list(self.aligned.chunks.get(rid, []))

    def forget_request(self, rid: str, block_ids: list[int]) -> list[int]:
        """Another tenant claimed ``rid``'s chunks (the group unmapped them): its blocks
        lose their reference, the chunks leave the books unmapped. Returns them."""
        with self.lock:
            for b in block_ids:
                assert self._ref[b] == 1, f"handed-over block {b} is shared"
                self._ref[b] = 0
            chunks = self.aligned.forget(rid)
            self.allocator.forget_chunks(chunks)
            return chunks

    def adopt_request(self, rid: str, chunks: list[int], block_ids: list[int]) -> None:
        """``chunks`` (adopted by the allocator, wholly held) now belong to ``rid``,
        which uses ``block_ids`` of them (ref 1 each)."""
        with self.lock:
            self.aligned.adopt(rid, chunks, block_ids)
            for b in block_ids:
                self._ref[b] = 1
