"""Handing requests between engines (prefill/decode, warm restart): the :class:`Engine`
methods that take requests out of scheduling with their blocks, put them back, drop them,
or adopt one another engine computed (part of).

Invariant: a detached request is in ``engine.detached`` only (not in ``requests`` nor
the scheduler) and still holds its blocks (ref counted by ``check_integrity``); a
detached waiting request holds none.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from kvpool.engine.errors import RequestError
from kvpool.engine.request import Request, RequestStatus
from kvpool.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.scheduler import Scheduler


class DetachMixin:
    """The handoff half of :class:`~kvpool.engine.engine.Engine` (same thread contract)."""

    config: EngineConfig
    device: torch.device
    scheduler: Scheduler
    requests: dict[str, Request]
    #: requests whose KV is being handed to another engine (they hold their blocks)
    detached: dict[str, Request]

    def detach(self, request_id: str) -> Request:
        """Take a running request out of scheduling, keeping its blocks (their bytes are
        about to change hands). Then :meth:`drop_detached` once the blocks are gone, or
        :meth:`reattach` if the handoff failed. Raises RequestError unless it is running
        with all of its tokens but the last computed (just after a step)."""
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            raise RequestError(f"request {request_id!r} is not running")
        if req.num_computed_tokens != req.num_tokens - 1:
            raise RequestError(f"request {request_id!r} is mid-prefill")
        self.scheduler.running.remove(req)
        del self.requests[request_id]
        self.detached[request_id] = req
        return req

    def detach_all(self) -> list[Request]:
        """(just after a step) Take every request out of scheduling, running ones first
        (mid-prefill too: they keep the blocks of their computed tokens), then the
        waiting ones (no blocks), each list in its scheduling order; returns them in that
        order. :meth:`reattach` them in the same order to restore the queues."""
        reqs = [*self.scheduler.running, *self.scheduler.waiting]
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        for req in reqs:
            del self.requests[req.request_id]
            self.detached[req.request_id] = req
        return reqs

    def reattach(self, request_id: str) -> None:
        """A detached request whose handoff failed runs (or waits) here again, at the end
        of its queue (its KV is intact)."""
        req = self.detached.pop(request_id)
        self.requests[request_id] = req
        if req.status is RequestStatus.WAITING:
            self.scheduler.waiting.append(req)
        else:
            self.scheduler.running.append(req)

    def drop_detached(self, request_id: str) -> Request:
        """A detached request's blocks now belong elsewhere (the pool forgot them): it is
        over here (finish reason "handoff")."""
        req = self.detached.pop(request_id)
        req.block_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = "handoff"
        return req

    def add_prefilled(self, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                      params: SamplingParams, block_ids: list[int],
                      output_text: str = "", detok_offsets: tuple[int, int] | None = None,
                      generator_state: torch.Tensor | None = None) -> str:
        """Adopt a request another engine prefilled: its K/V for all of ``token_ids`` but
        the last is in ``block_ids`` (blocks the pool already counts as held, ref 1), so
        it runs at once and its next step decodes; ``generator_state`` continues a seeded
        request's random stream where the other engine left it. Raises RequestError on a duplicate id
        or a block table that does not cover the tokens."""
        return self.add_adopted(request_id, token_ids, num_prompt_tokens, params, block_ids,
                                len(token_ids) - 1, output_text, detok_offsets,
                                generator_state)

    def add_adopted(self, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                    params: SamplingParams, block_ids: list[int], num_computed_tokens: int,
                    output_text: str = "", detok_offsets: tuple[int, int] | None = None,
                    generator_state: torch.Tensor | None = None, num_cached_blocks: int = 0,
                    num_preemptions: int = 0) -> str:
        """Adopt a request at any point another engine left it (:meth:`add_prefilled`
        generalised, for a warm restart): K/V of its first ``num_computed_tokens`` tokens
        in ``block_ids`` (held, ref counted by the caller), the first
        ``num_cached_blocks`` of them in the prefix cache. With K/V it runs at once (its
        next step decodes, or goes on prefilling); without (``num_computed_tokens == 0``,
        no blocks: it was waiting) it queues. Raises RequestError on a duplicate id or a
        block table that does not fit the tokens."""
        if request_id in self.requests or request_id in self.detached:
            raise RequestError(f"duplicate request id {request_id!r}")
        computed, bs = num_computed_tokens, self.config.block_size
        if not (0 < num_prompt_tokens <= len(token_ids) and 0 <= computed < len(token_ids)
                and len(block_ids) * bs >= computed and (computed > 0) == bool(block_ids)
                and len(block_ids) <= -(-len(token_ids) // bs)
                and 0 <= num_cached_blocks <= computed // bs):
            raise RequestError(f"request {request_id!r}: block table does not cover it")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            if generator_state is not None:
                gen.set_state(generator_state)
        req = Request(request_id, token_ids[:num_prompt_tokens], params, gen)
        req.token_ids = list(token_ids)
        req.output_text = output_text
        if detok_offsets is not None:
            req.detok_offsets = (detok_offsets[0], detok_offsets[1])
        req.num_preemptions = num_preemptions
        self.requests[request_id] = req
        if not block_ids:
            self.scheduler.add(req)  # waiting: it computes (or recomputes) here
            return request_id
        req.block_ids = list(block_ids)
        req.num_computed_tokens = computed
        req.num_cached_blocks = num_cached_blocks
        req.status = RequestStatus.RUNNING
        now = time.perf_counter()
        req.metrics.first_scheduled_time = now
        if req.num_output_tokens:
            req.metrics.first_token_time = now
        self.scheduler.running.append(req)
        return request_id
