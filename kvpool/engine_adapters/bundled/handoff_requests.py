"""The in-flight requests of a warm restart (:mod:`.handoff_cache`): what travels for each
request (:class:`MovingRequest`), and the receiving side's check of a whole handover
before it claims anything.

A request moves at whatever point it was between two steps of the old engine: decoding
(K/V for all of its tokens but the last), part way through its prefill (K/V for the
first ``num_computed_tokens``), or waiting (no K/V: it computes, or recomputes, on the
new engine). Its block table is in the giver's block ids; the receiver renames each
block ``b`` of giver chunk ``c`` to ``c' * per + b % per``, as for the cache entries.

The handover is untrusted input (any process of the same uid can post one): every
check below runs before the claim, so a refused handover changes nothing and leaves the
ticket for a correct one. Failures raise :class:`AdapterError` with one line that starts
with ``bad handover:``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from kvpool.engine.block_pool import NULL_BLOCK
from kvpool.engine.request import Request
from kvpool.engine.sampling import SamplingParams
from kvpool.engine_adapters.bundled.settings import AdapterError

if TYPE_CHECKING:
    import torch

    from kvpool.engine.engine import Engine

MAX_REQUESTS = 4096  # per handover; an engine runs far fewer at once


@dataclass
class MovingRequest:
    """One request on its way from the old engine to the new one."""

    request_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens with K/V in block_ids (0: it was waiting)
    block_ids: list[int]  # the giver's block ids
    num_cached_blocks: int  # its first blocks registered in the prefix cache
    params: dict[str, Any]
    output_text: str = ""
    detok_offsets: tuple[int, int] | None = None
    generator_state: str | None = None  # a seeded request's random state (base64)
    num_preemptions: int = 0


def describe(req: Request) -> MovingRequest:
    """What of detached ``req`` travels."""
    return MovingRequest(
        request_id=req.request_id, token_ids=list(req.token_ids),
        num_prompt_tokens=req.num_prompt_tokens, num_computed_tokens=req.num_computed_tokens,
        block_ids=list(req.block_ids), num_cached_blocks=req.num_cached_blocks,
        params=dataclasses.asdict(req.params), output_text=req.output_text,
        detok_offsets=(int(req.detok_offsets[0]), int(req.detok_offsets[1])),
        generator_state=state_of(req.generator), num_preemptions=req.num_preemptions)


class Handover(Protocol):
    """What :func:`check` reads of a :class:`~.handoff_cache.CacheHandover`."""

    @property
    def blocks_per_chunk(self) -> int: ...

    @property
    def chunks(self) -> Sequence[int]: ...

    @property
    def entries(self) -> Sequence[tuple[int, int, list[int], int]]: ...

    @property
    def requests(self) -> Sequence[MovingRequest]: ...


@dataclass
class Prepared:
    """A checked request, ready to add once the claim succeeded."""

    moving: MovingRequest
    params: SamplingParams
    generator_state: Any  # a torch uint8 tensor, or None


def check(engine: Engine, c: Handover) -> list[Prepared]:
    """Check handover ``c`` (a :class:`~.handoff_cache.CacheHandover`) against this
    engine before claiming: chunks listed once, every block (entry or request) in one of
    them, parents among the entries, lengths consistent with the block size, requests
    new here, within the context and the vocabulary, their sampling state usable.
    Returns the requests prepared; raises AdapterError ("bad handover: ...")."""
    per, bs = c.blocks_per_chunk, engine.config.block_size
    chunks = set(c.chunks)
    if len(chunks) != len(c.chunks) or any(x < 0 for x in chunks):
        _bad("a chunk is listed twice or negative")

    def in_chunks(b: int) -> bool:
        return b > NULL_BLOCK and b // per in chunks

    entry_blocks = [e[0] for e in c.entries]
    if len(set(entry_blocks)) != len(entry_blocks) or len(entry_blocks) > len(chunks) * per:
        _bad("a cache entry's block is listed twice")
    entries = set(entry_blocks)
    for b, _h, tokens, parent in c.entries:
        if not in_chunks(b):
            _bad(f"cache entry block {b} is not in the given chunks")
        if parent != NULL_BLOCK and parent not in entries:
            _bad(f"cache entry block {b}: its parent {parent} is not an entry")
        if len(tokens) != bs:
            _bad(f"cache entry block {b} holds {len(tokens)} tokens, a block {bs}")
    if len(c.requests) > MAX_REQUESTS:
        _bad(f"{len(c.requests)} requests; at most {MAX_REQUESTS}")
    ids = [r.request_id for r in c.requests]
    if len(set(ids)) != len(ids):
        _bad("a request id is listed twice")
    holders: Counter[int] = Counter()
    out = []
    for r in c.requests:
        out.append(_check_request(engine, r, in_chunks))
        holders.update(r.block_ids)
    shared = [b for b, n in holders.items() if n > 1 and b not in entries]
    if shared:
        _bad(f"block {shared[0]} is held by several requests but is no cache entry")
    return out


def _check_request(engine: Engine, r: MovingRequest, in_chunks: Callable[[int], bool]
                   ) -> Prepared:
    rid, n, bs = r.request_id, len(r.token_ids), engine.config.block_size
    where = f"request {rid!r}"
    if rid in engine.requests or rid in engine.detached:
        _bad(f"{where} is running here already")
    if not 0 < r.num_prompt_tokens <= n or n >= engine.max_model_len:
        _bad(f"{where}: {n} tokens, {r.num_prompt_tokens} of them prompt; this engine's "
             f"context holds {engine.max_model_len}")
    vocab = engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in r.token_ids):
        _bad(f"{where}: token ids must be in [0, {vocab})")
    blocks, computed = r.block_ids, r.num_computed_tokens
    if not (0 <= computed < n and (computed > 0) == bool(blocks)
            and len(blocks) * bs >= computed and len(blocks) <= -(-n // bs)
            and 0 <= r.num_cached_blocks <= computed // bs):
        _bad(f"{where}: {len(blocks)} blocks do not fit {computed} computed of {n} tokens")
    if len(set(blocks)) != len(blocks) or not all(in_chunks(b) for b in blocks):
        _bad(f"{where}: its block table is not in the given chunks (or repeats a block)")
    if r.detok_offsets is not None and not all(0 <= x <= n for x in r.detok_offsets):
        _bad(f"{where}: detokenizer offsets out of range")
    try:
        params = SamplingParams(**r.params)
    except (TypeError, ValueError) as e:  # RequestError is a ValueError
        _bad(f"{where}: sampling parameters: {e}")
    state = None
    if r.generator_state is not None:
        if params.seed is None:
            _bad(f"{where}: a generator state without a seed")
        try:
            state = unstate(r.generator_state)
            import torch

            torch.Generator(device=engine.device).set_state(state)
        except (binascii.Error, ValueError, RuntimeError) as e:
            _bad(f"{where}: generator state unusable: {e}")
    return Prepared(r, params, state)


def add(engine: Engine, prepared: list[Prepared], rename: Callable[[int], int]) -> None:
    """(after the claim, the pool's locks held) Add each checked request to ``engine``
    with its block table renamed (the caller set the blocks' reference counts)."""
    for p in prepared:
        r = p.moving
        engine.add_adopted(r.request_id, r.token_ids, r.num_prompt_tokens, p.params,
                           [rename(b) for b in r.block_ids], r.num_computed_tokens,
                           r.output_text, r.detok_offsets, p.generator_state,
                           r.num_cached_blocks, r.num_preemptions)


def state_of(generator: torch.Generator | None) -> str | None:
    if generator is None:
        return None
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode()


def unstate(text: str) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)),
                            dtype=torch.uint8)


def _bad(why: str) -> NoReturn:
    raise AdapterError(f"bad handover: {why}")
