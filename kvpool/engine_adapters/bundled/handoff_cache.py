"""Warm restart: a bundled engine hands its prefix cache, and optionally its in-flight
requests, to a new engine process as pages (no copy), so the new one starts with the old
one's cache hits and goes on with its requests where they were.

    # old engine (between steps), asked by the new one
    c, ticket = offer_cache(old, to="new-tenant", in_flight=True)  # units in escrow
    send(c.to_json())
    settle_cache(old, c, ticket)     # "claimed": those units and requests are gone; the
                                     # old engine is retired (its null block went too:
                                     # it allocates nothing more; its books still add
                                     # up); else all of it runs here again
    # new engine
    adopt_cache(new, CacheHandover.from_json(msg))    # claimed; blocks cached, requests
                                                      # running (or waiting) here

What travels (:class:`CacheHandover`): every valid prefix-cache entry (hash, tokens,
parent block) of the old pool, evictable ones LRU first, the in-flight requests
(:class:`~.handoff_requests.MovingRequest`: tokens, sampling state, block table), the
chunks holding any of their blocks (in this prefix-cache mode a chunk can hold entries,
several requests' blocks and free blocks), and the ticket. The new engine maps each given
chunk at a chunk of its own (units in order) and renames block ``b`` of old chunk ``c``
to ``c' * per + b % per`` (parents and block tables too); a block's reference count is
the number of moved requests holding it; blocks of those chunks that hold nothing are
freed into its allocator (the memory stays, charged once: to the new tenant).

Invariants: the old engine takes no step between offer and settle (without
``in_flight`` it must be idle; with it, every request is detached); an expired or
cancelled ticket leaves it exactly as it was (the requests reattached in their order).
The message is checked whole (:func:`~.handoff_requests.check`) before the claim.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

from typing import TYPE_CHECKING, Any

import msgspec

from kvpool.client_lib import handoff as wire
from kvpool.engine.block_pool import NULL_BLOCK
from kvpool.engine_adapters.bundled import handoff_requests
from kvpool.engine_adapters.bundled.block_pool import elastic_pool
from kvpool.engine_adapters.bundled.handoff import claim_chunks
from kvpool.engine_adapters.bundled.handoff_requests import MovingRequest
from kvpool.engine_adapters.bundled.settings import AdapterError

if TYPE_CHECKING:
    from kvpool.engine.engine import Engine


@dataclass
class CacheHandover:
    ticket: str
    chunks: list[int]
    blocks_per_chunk: int
    pages_per_chunk: int
    entries: list[tuple[int, int, list[int], int]]  # (block, hash, tokens, parent), LRU first
    requests: list[MovingRequest] = field(default_factory=list)  # running first, in order

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> CacheHandover:
        """Parse (and type-check) a handover; AdapterError ("bad handover: ...")."""
        try:
            d = json.loads(text) if isinstance(text, str) else text
            return msgspec.convert(d, cls)
        except (ValueError, msgspec.ValidationError) as e:
            raise AdapterError(f"bad handover: {e}") from None


def offer_cache(engine: Engine, to: str, ttl_s: float = 10.0, in_flight: bool = False
                ) -> tuple[CacheHandover, wire.Ticket]:
    """Offer the units holding ``engine``'s prefix cache to tenant ``to``; with
    ``in_flight`` every request is detached and goes too (its blocks' chunks with it),
    else the engine must be idle. Raises AdapterError (nothing changed) when it cannot."""
    pool = elastic_pool(engine)
    alloc = pool.allocator
    if in_flight and pool.aligned is not None:
        raise AdapterError("in-flight requests move only in the prefix-cache mode, "
                           "not request-aligned")
    with engine.step_lock:
        if not in_flight and (engine.has_unfinished() or engine.detached):
            raise AdapterError("the engine still has requests: hand its cache over idle")
        reqs = engine.detach_all() if in_flight else []
        try:
            with pool.lock:
                entries = pool.cache_entries()
                live = {b for b, _ in entries} | {b for r in reqs for b in r.block_ids}
                chunks = sorted({alloc.chunk_of(b) for b in live})
                if not chunks and not in_flight:
                    raise AdapterError("the engine has no prefix cache to hand over")
                # the null block's chunk stands in for an empty handover: the ticket's
                # claim is what tells both sides the requests changed engine
                chunks = chunks or [alloc.chunk_of(NULL_BLOCK)]
                moving = [handoff_requests.describe(r) for r in reqs]
                ticket = wire.offer(alloc.region_group, alloc.units_of(chunks), to=to, ttl_s=ttl_s)
        except BaseException:
            for r in reqs:
                engine.reattach(r.request_id)
            raise
    return CacheHandover(
        ticket=ticket.id, chunks=chunks, blocks_per_chunk=alloc.blocks_per_chunk,
        pages_per_chunk=alloc.pages_per_chunk,
        entries=[(b, e.block_hash, list(e.tokens), e.parent) for b, e in entries],
        requests=moving), ticket


def settle_cache(engine: Engine, c: CacheHandover, ticket: wire.Ticket,
                 timeout_s: float | None = None) -> str:
    """Wait for the ticket (cancel it at the timeout); on ``claimed`` the pool forgets
    the given chunks, every cache entry and block reference in them, and the moved
    requests are over here; otherwise the requests run here again. Returns the state."""
    pool = elastic_pool(engine)
    state = ticket.wait(timeout_s)
    if state == wire.PENDING:
        wire.cancel(pool.allocator.region_group.tenant, ticket)
        state = ticket.state
    with engine.step_lock, pool.lock:
        if state != "claimed":
            for r in c.requests:
                engine.reattach(r.request_id)
            return state
        per = pool.allocator.blocks_per_chunk
        if pool.allocator.chunk_of(NULL_BLOCK) in c.chunks:  # it went too: the books say so
            pool.null_given_away()
        pool.forget_blocks(b for ch in set(c.chunks) for b in range(ch * per, (ch + 1) * per))
        pool.allocator.forget_chunks(c.chunks)
        for r in c.requests:
            engine.drop_detached(r.request_id)
    return state


def adopt_cache(engine: Engine, c: CacheHandover) -> int:
    """Claim ``c``'s units into this engine's pool, register its entries as cached
    blocks and add its requests (running ones run at once); returns how many entries.
    Raises, changing nothing, on a bad handover or a refused claim."""
    pool = elastic_pool(engine)
    alloc = pool.allocator
    if (c.blocks_per_chunk, c.pages_per_chunk) != (alloc.blocks_per_chunk,
                                                   alloc.pages_per_chunk):
        raise AdapterError("block layout differs from the old engine's")
    if c.requests and pool.aligned is not None:
        raise AdapterError("in-flight requests move only in the prefix-cache mode, "
                           "not request-aligned")
    per = c.blocks_per_chunk
    with engine.step_lock:
        prepared = handoff_requests.check(engine, c)
        mine = claim_chunks(alloc, c.ticket, len(c.chunks))
        at = dict(zip(c.chunks, mine))

        def rename(b: int) -> int:
            return NULL_BLOCK if b == NULL_BLOCK else at[b // per] * per + b % per

        with pool.lock:
            refs = Counter(rename(b) for r in c.requests for b in r.block_ids)
            pool.adopt_blocks(refs, [(rename(b), h, tokens, rename(parent))
                                     for b, h, tokens, parent in c.entries])  # LRU order
            unused = [b for m in mine for b in range(m * per, (m + 1) * per)
                      if not pool.is_cached(b) and not refs[b]]
            if unused:
                alloc.free(unused)
            handoff_requests.add(engine, prepared, rename)
    return len(c.entries)
