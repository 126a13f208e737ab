"""Warm restart: an idle bundled engine hands its prefix cache to a new engine process as
pages (no copy), so the new one starts with the old one's cache hits.

    # old engine (idle: no request in it), asked by the new one
    c, ticket = offer_cache(old, to="new-tenant")     # its cache's units in escrow
    send(c.to_json())
    settle_cache(old, c, ticket)     # "claimed": those units are gone; the old engine
                                     # must not step again (its null block may be gone)
    # new engine
    adopt_cache(new, CacheHandover.from_json(msg))    # claimed; blocks cached, evictable

What travels (:class:`CacheHandover`): every valid prefix-cache entry (hash, tokens,
parent block) of the old pool, parents before children, the chunks they lie in, and the
ticket. The new engine maps each given chunk at a chunk of its own (units in order) and
renames block ``b`` of old chunk ``c`` to ``c' * per + b % per`` (parents too); blocks
of those chunks that hold no entry are freed into its allocator (the memory stays,
charged once: to the new tenant).

Invariants: the old engine is idle and takes no step between offer and settle; an
expired or cancelled ticket leaves it exactly as it was.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from kvpool.client_lib import handoff as wire
from kvpool.engine.block_pool import NULL_BLOCK, CachedBlock
from kvpool.engine_adapters.bundled.handoff import claim_chunks
from kvpool.engine_adapters.bundled.settings import AdapterError


@dataclass
class CacheHandover:
    ticket: str
    chunks: list[int]
    blocks_per_chunk: int
    pages_per_chunk: int
    entries: list[tuple[int, int, list[int], int]]  # (block, hash, tokens, parent), LRU first

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | dict) -> CacheHandover:
        d = json.loads(text) if isinstance(text, str) else dict(text)
        d["entries"] = [tuple(e) for e in d["entries"]]
        return cls(**d)


def _valid_entries(pool) -> list[tuple[int, CachedBlock]]:
    """Evictable entries whose whole parent chain is valid, parents first, LRU first."""
    order = list(pool._evictable)  # LRU first
    valid: set[int] = set()
    out: list[tuple[int, CachedBlock]] = []
    pending = [(b, pool._entry[b]) for b in order]
    while pending:
        rest = []
        for b, e in pending:
            if e.parent == NULL_BLOCK or (e.parent in valid
                                          and e.parent_epoch == pool._epoch[e.parent]):
                valid.add(b)
                out.append((b, e))
            elif e.parent in pool._evictable and e.parent not in valid:
                rest.append((b, e))
        if len(rest) == len(pending):
            break
        pending = rest
    return out


def offer_cache(engine, to: str, ttl_s: float = 10.0) -> tuple[CacheHandover, wire.Ticket]:
    """Offer the units holding the idle ``engine``'s prefix cache to tenant ``to``."""
    pool = engine.pool
    alloc = pool.allocator
    with pool.step_lock:
        if engine.has_unfinished() or engine.detached:
            raise AdapterError("the engine still has requests: hand its cache over idle")
        with pool.lock:
            entries = _valid_entries(pool)
            chunks = sorted({alloc.chunk_of(b) for b, _ in entries})
            if not chunks:
                raise AdapterError("the engine has no prefix cache to hand over")
            ticket = wire.offer(alloc.group, alloc.units_of(chunks), to=to, ttl_s=ttl_s)
    return CacheHandover(
        ticket=ticket.id, chunks=chunks, blocks_per_chunk=alloc.blocks_per_chunk,
        pages_per_chunk=alloc.pages_per_chunk,
        entries=[(b, e.block_hash, list(e.tokens), e.parent) for b, e in entries]), ticket


def settle_cache(engine, c: CacheHandover, ticket: wire.Ticket,
                 timeout_s: float | None = None) -> str:
    """Wait for the ticket (cancel it at the timeout); on ``claimed`` the pool forgets
    the given chunks and every cache entry in them. Returns the final state."""
    pool = engine.pool
    state = ticket.wait(timeout_s)
    if state == wire.PENDING:
        wire.cancel(pool.allocator.group.tenant, ticket)
        state = ticket.state
    if state == "claimed":
        with pool.step_lock, pool.lock:
            gone = set(c.chunks)
            per = pool.allocator.blocks_per_chunk
            for b in [b for b in pool._entry if b // per in gone]:
                pool._evictable.pop(b, None)
                pool._uncache(b)
            pool.allocator.forget_chunks(c.chunks)
    return state


def adopt_cache(engine, c: CacheHandover) -> int:
    """Claim ``c``'s units into this (idle) engine's pool and register its entries as
    evictable cached blocks; returns how many. Raises, changing nothing, on refusal."""
    pool = engine.pool
    alloc = pool.allocator
    if (c.blocks_per_chunk, c.pages_per_chunk) != (alloc.blocks_per_chunk,
                                                   alloc.pages_per_chunk):
        raise AdapterError("block layout differs from the old engine's")
    per = c.blocks_per_chunk
    with pool.step_lock:
        mine = claim_chunks(alloc, c.ticket, len(c.chunks))
        at = dict(zip(c.chunks, mine))

        def rename(b: int) -> int:
            return NULL_BLOCK if b == NULL_BLOCK else at[b // per] * per + b % per

        with pool.lock:
            cached: set[int] = set()
            for b, h, tokens, parent in c.entries:
                nb, np_ = rename(b), rename(parent)
                pool._entry[nb] = CachedBlock(h, tuple(tokens), np_, pool._epoch[np_])
                pool._by_hash.setdefault(h, {})[nb] = None
                pool._evictable[nb] = None  # LRU order kept
                cached.add(nb)
            unused = [b for m in mine for b in range(m * per, (m + 1) * per)
                      if b not in cached]
            if unused:
                alloc.free(unused)
    return len(c.entries)
