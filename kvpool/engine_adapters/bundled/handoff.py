"""Hand one request's KV from a bundled engine to another without copying a byte.

Both engines run request-aligned (``Settings(request_aligned=True)``): a request's blocks
fill whole chunks only it uses, in order. The giver (e.g. a prefill engine, right after
the step that sampled the request's first token):

    h, ticket = give(engine, rid, to="decode")   # detached; its units in escrow
    send(h.to_json())                            # out of band (the router)
    settle(engine, h, ticket)                    # "claimed": the units are gone here

The receiver (a decode engine with the same model, block size and page size):

    take(engine, Handover.from_json(msg))        # claimed, block table rewritten; it decodes

What travels (:class:`Handover`): the tokens so far, the prompt length, the sampling
parameters, the ticket id, and the block layout: the giver's block table and the chunks
it lies in. The receiver maps the pages at chunks it picks from its unmapped ones (units
in the same order) and rewrites block ``b`` of giver chunk ``c`` to ``c' * per + b %
per`` where ``c'`` is the chunk it mapped ``c``'s units at: the same bytes, no copy.

Invariants: between ``give`` and ``settle`` the giver neither schedules the request nor
frees its blocks (it is detached, its blocks held); on a claim the giver's pool forgets
the chunks (no release: the pages are the receiver's, and charged to it); on expiry or
cancel the giver runs the request again itself. A failed claim leaves the receiver's books
as they were.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.client_lib import handoff as wire
from kvpool.engine.errors import RequestError
from kvpool.engine.request import Request
from kvpool.engine.sampling import SamplingParams
from kvpool.engine_adapters.bundled.block_pool import BundledElasticPool, elastic_pool
from kvpool.engine_adapters.bundled.settings import AdapterError

if TYPE_CHECKING:
    import torch

    from kvpool.client_lib import ElasticBlockAllocator
    from kvpool.engine.engine import Engine


@dataclass
class Handover:
    """One request on its way between engines (JSON-ready with :meth:`to_json`)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: dict[str, Any]
    ticket: str
    block_ids: list[int]
    chunks: list[int]  # the giver's chunks, in the order their units were offered
    blocks_per_chunk: int
    pages_per_chunk: int
    output_text: str = ""
    detok_offsets: tuple[int, int] | None = None
    generator_state: str | None = None  # a seeded request's random state (base64)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> Handover:
        d = json.loads(text) if isinstance(text, str) else dict(text)
        return cls(**d)


def _aligned_pool(engine: Engine) -> BundledElasticPool:
    pool = elastic_pool(engine)
    if pool.aligned is None:
        raise AdapterError("page handoff needs a request-aligned kvpool engine "
                           "(Settings(request_aligned=True) / KVPOOL_REQUEST_ALIGNED=1)")
    return pool


def give(engine: Engine, request_id: str, to: str, ttl_s: float = 10.0
         ) -> tuple[Handover, wire.Ticket]:
    """Detach ``request_id`` (just after a step) and offer its units to tenant ``to``."""
    pool = _aligned_pool(engine)
    alloc = pool.allocator
    with engine.step_lock:
        req = engine.detach(request_id)
        try:
            chunks = pool.request_chunks(request_id)
            ticket = wire.offer(alloc.region_group, alloc.units_of(chunks), to=to, ttl_s=ttl_s)
        except BaseException:
            engine.reattach(request_id)
            raise
    h = Handover(request_id=request_id, token_ids=list(req.token_ids),
                 num_prompt_tokens=req.num_prompt_tokens,
                 params=dataclasses.asdict(req.params), ticket=ticket.id,
                 block_ids=list(req.block_ids), chunks=chunks,
                 blocks_per_chunk=alloc.blocks_per_chunk,
                 pages_per_chunk=alloc.pages_per_chunk, output_text=req.output_text,
                 detok_offsets=(req.detok_offsets[0], req.detok_offsets[1]), generator_state=_state(req))
    return h, ticket


def settle(engine: Engine, h: Handover, ticket: wire.Ticket, timeout_s: float | None = None) -> str:
    """Wait for the ticket; ``claimed``: the pool forgets the request's chunks and the
    request is over here; otherwise (expired, cancelled, or still pending at the timeout,
    then cancelled) the request runs here again. Returns the final state."""
    pool = _aligned_pool(engine)
    state = ticket.wait(timeout_s)
    if state == wire.PENDING:  # take it back; it may have settled meanwhile
        wire.cancel(pool.allocator.region_group.tenant, ticket)
        state = ticket.state
    with engine.step_lock:
        if state == "claimed":
            pool.forget_request(h.request_id, h.block_ids)
            engine.drop_detached(h.request_id)
        else:
            engine.reattach(h.request_id)
    return state


def take(engine: Engine, h: Handover) -> str:
    """Claim ``h``'s units into chunks of this engine and run the request here (its next
    step decodes). Raises (changing nothing here) when the claim is refused."""
    pool = _aligned_pool(engine)
    alloc = pool.allocator
    if (h.blocks_per_chunk, h.pages_per_chunk) != (alloc.blocks_per_chunk,
                                                   alloc.pages_per_chunk):
        raise AdapterError(f"block layout differs: the giver has {h.blocks_per_chunk} "
                           f"blocks in {h.pages_per_chunk} pages per chunk, this engine "
                           f"{alloc.blocks_per_chunk} in {alloc.pages_per_chunk}")
    if h.request_id in engine.requests or h.request_id in engine.detached:
        raise RequestError(f"duplicate request id {h.request_id!r}")
    per = h.blocks_per_chunk
    if len(set(h.chunks)) != len(h.chunks) or any(b // per not in h.chunks
                                                  for b in h.block_ids):
        raise AdapterError("the handover's block table is not in its chunks")
    params = SamplingParams(**h.params)
    with engine.step_lock:
        mine = claim_chunks(alloc, h.ticket, len(h.chunks))
        at = dict(zip(h.chunks, mine))
        blocks = [at[b // per] * per + b % per for b in h.block_ids]
        pool.adopt_request(h.request_id, mine, blocks)
        engine.add_prefilled(h.request_id, h.token_ids, h.num_prompt_tokens, params, blocks,
                             h.output_text, h.detok_offsets, _unstate(h.generator_state))
    return h.request_id


def claim_chunks(alloc: ElasticBlockAllocator, ticket: str, count: int) -> list[int]:
    """(the engine's ``step_lock`` held) Claim ticket ``ticket``'s units into ``count``
    unmapped chunks of ``alloc`` (units in order) and adopt them as wholly held; returns
    those chunks, in the order of the giver's. Raises, changing nothing, when there are
    not enough unmapped chunks or the claim is refused."""
    mine = alloc.pick_unmapped_chunks(count)
    if mine is None:
        raise AdapterError(f"no {count} unmapped chunks to claim into")
    try:
        wire.claim(alloc.region_group, ticket, alloc.units_of(mine), populate=alloc.populate)
    except BaseException:
        alloc.return_chunks(mine)
        raise
    alloc.adopt_chunks(mine)
    return mine


def _state(req: Request) -> str | None:
    if req.generator is None:
        return None
    return base64.b64encode(req.generator.get_state().numpy().tobytes()).decode()


def _unstate(text: str | None) -> torch.Tensor | None:
    if text is None:
        return None
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
