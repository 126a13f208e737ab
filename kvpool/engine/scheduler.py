"""Iteration-level scheduler: one token budget per step shared by decodes and prefill chunks.

Each step:
1. running requests first, in arrival order, each gets ``min(uncomputed, budget)`` tokens;
   when the KV manager has no room, the newest running request is preempted (its KV is
   freed and it goes back to the front of the queue to be recomputed), repeatedly, until
   the allocation fits or the request itself was the one preempted;
2. then, if nothing was preempted this step, waiting requests are admitted in order
   (prefix-cache hit first, then a chunk of the rest) while budget and seats last and
   the pool keeps a free block per running request (so admission does not just trigger
   the next preemption).
No request is ever dropped: preempted requests keep their tokens and resume later.

Blocks enter the prefix cache as soon as they are scheduled to be filled (as in vLLM), so
requests sharing a prompt prefix admitted in the same step compute it once. This is safe
because (a) every attention layer stores the whole batch's K/V before any query attends,
so a hit on a block filled in the same step reads this step's values; (b) hits only happen
in the admission loop, which runs only if nothing was preempted this step, so a block
whose filling was scheduled is never freed before the step runs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvpool.engine.kv_manager import KVCacheManager
from kvpool.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """``scheduled[i] = (request, num_new_tokens)``; tokens ``[computed, computed + n)``
    of each request are computed this step."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int
                 ) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:  # running
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            out.scheduled.append((req, n))
            self.kv.cache_blocks(req, req.num_computed_tokens + n)
            budget -= n
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:  # waiting
            req = self.waiting[0]
            hit, hit_tokens = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - hit_tokens, budget)
            # NOTE: leave one free block per running request so they can keep decoding;
            # admitting into the last blocks only leads to preempting someone next step.
            need = self.kv.num_new_blocks(req, n, hit)
            if self.running and self.kv.pool.get_num_free_blocks() - need < len(self.running):
                break
            if self.kv.allocate_slots(req, n, hit) is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(req)
            out.scheduled.append((req, n))
            self.kv.cache_blocks(req, req.num_computed_tokens + n)
            budget -= n
        return out

    def preempt(self, req: Request) -> None:
        """Free the request's KV and requeue it at the front; it will be recomputed."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Take a request out of the queues for good and release its blocks."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.metrics.finish_time = time.perf_counter()
