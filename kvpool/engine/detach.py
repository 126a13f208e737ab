"""Handing a request between engines (prefill/decode): the :class:`Engine` methods that
take a running request out of scheduling with its blocks, put it back, drop it, or adopt
one another engine prefilled.

Invariant: a detached request is in ``engine.detached`` only (not in ``requests`` nor
the scheduler) and still holds its blocks (ref counted by ``check_integrity``).
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

    def reattach(self, request_id: str) -> None:
        """A detached request whose handoff failed runs here again (its KV is intact)."""
        req = self.detached.pop(request_id)
        self.requests[request_id] = req
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
        if request_id in self.requests or request_id in self.detached:
            raise RequestError(f"duplicate request id {request_id!r}")
        computed = len(token_ids) - 1
        if not 0 < num_prompt_tokens <= computed + 1 or \
                len(block_ids) * self.config.block_size < computed:
            raise RequestError(f"request {request_id!r}: block table does not cover it")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            if generator_state is not None:
                gen.set_state(generator_state)
        req = Request(request_id, token_ids[:num_prompt_tokens], params, gen)
        req.token_ids = list(token_ids)
        req.block_ids = list(block_ids)
        req.num_computed_tokens = computed
        req.status = RequestStatus.RUNNING
        req.output_text = output_text
        if detok_offsets is not None:
            req.detok_offsets = tuple(detok_offsets)
        now = time.perf_counter()
        req.metrics.first_scheduled_time = req.metrics.first_token_time = now
        self.requests[request_id] = req
        self.scheduler.running.append(req)
        return request_id
