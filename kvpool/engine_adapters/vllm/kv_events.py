"""vLLM's KV events when kvpool takes KV back, sent through vLLM's own publisher.

vLLM (``--kv-events-config``) publishes its block pool's events only at the end of an
engine step (``Scheduler.update_from_output`` takes the pool's queue and hands a
``KVEventBatch`` to ``scheduler.kv_event_publisher``). kvpool takes KV back between
steps — a reclaim, the idle release, a sleep — and an engine it takes from is often
idle: its ``BlockRemoved`` events (the pool's own ``_maybe_evict_cached_block`` queues
them) and a sleep's ``AllBlocksCleared`` would wait for the next request, and a
precise-prefix router would meanwhile send requests to KV that is gone. So:

* :func:`publish_pending` (called by the elastic pool's ``publish_removals`` at the end
  of each shrink, idle release and sleep, with the step lock held, so it never
  interleaves with a step's own take) sends what the pool queued now, the way the
  step does;
* :func:`publish_cleared` sends one ``AllBlocksCleared`` first thing when the scheduler
  is built: a restarted engine's stream starts by telling a reconnecting router to
  forget what a killed predecessor had cached (the replay socket keeps it as sequence
  0). A stopped vLLM server says nothing more than a killed one: on SIGTERM vLLM's API
  server force-kills its engine core (timeout 0) before the scheduler shuts down, so
  there is no last batch to add; the next start's clear covers both.

All through vLLM's classes and vLLM's publisher (its queue; a slow subscriber never
blocks it: ZeroMQ drops at the high-water mark). Nothing is sent when events are off
(vLLM's ``NullEventPublisher``, the pool's ``enable_kv_cache_events`` false).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler


def _enabled(scheduler: Scheduler | None) -> bool:
    if scheduler is None:
        return False
    return bool(scheduler.kv_cache_manager.block_pool.enable_kv_cache_events)


def publish_pending(scheduler: Scheduler | None) -> int:
    """(step lock held) Publish the block pool's queued events now, as one batch;
    returns how many (0 with events off or no scheduler yet)."""
    if scheduler is None or not _enabled(scheduler):
        return 0
    events = scheduler.kv_cache_manager.take_events()
    if not events:
        return 0
    # (vLLM's scheduler builds its batch from the same list type)
    batch = KVEventBatch(ts=time.time(), events=events)  # type: ignore[arg-type, unused-ignore]
    scheduler.kv_event_publisher.publish(batch)
    return len(events)


def publish_cleared(scheduler: Scheduler) -> None:
    """Publish one ``AllBlocksCleared`` batch (with events on)."""
    if _enabled(scheduler):
        scheduler.kv_event_publisher.publish(
            KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
