"""The adapter contract: what every engine's elastic block pool does the same way.

An engine adapter gives its engine a block pool whose free blocks come from and go back
to the client library's :class:`~kvpool.client_lib.ElasticBlockAllocator`. Three things
about such a pool do not depend on the engine, and live here once:

* **shrink** (the tenant's shrink callback: the daemon wants ``nbytes`` back), between
  engine steps only: give the stash back, evict the cached blocks of the chunks that hold
  nothing else, fewest held blocks first (whole units empty, the library releases them),
  then, if that was not enough, every cached block (LRU), then preempt running requests,
  newest first, evicting what each frees, until the tenant holds ``want`` chunks fewer
  (never below the null block's chunk). The daemon asks only for memory above the
  tenant's ``max(min, fair share)``, so preempting is what the tenant owes.
* **idle release**: once the engine has had no request and done no work for
  ``idle_timeout_s``, evict its whole prefix cache (and stash), so the allocator's idle
  trim gives the emptied chunks back: an idle engine keeps one unit (its null block's);
  otherwise its cache counts as held memory that fair share protects.
* **sleep and wake of the pool** (the KV half of an engine's
  :class:`~kvpool.engine_adapters.sleep_controller.SleepTarget`): asleep, the pool holds nothing:
  the engine empties it (``empty_for_sleep``: cache evicted, stash back, refused while a
  block is in use), the null block is freed and the allocator suspended (every chunk
  released, no refill); a wake resumes the allocator taking block 0 first (waiting for
  memory like a grant), checks it is block 0 (else frees what came and fails), and the
  pool hands out blocks again.

The engine-specific half is :class:`ElasticHooks`, which the pool implements;
:class:`ElasticPolicy` is the shared half, which the pool builds with itself as the hooks
and with its allocator, and to which it hands the tenant's shrink callback, the idle
watcher, ``stop`` and its ``sleep``/``wake`` (its ``asleep`` is the pool's). The rules a pool keeps itself (see :class:`ElasticHooks`): block 0
is the engine's null block, allocated from the allocator before anything else and never
freed; block ids equal allocator block ids; a block is in exactly one of {allocator free,
stash, evictable (cached, unreferenced), in use}; blocks taken ahead of need (the stash:
a refill that raced the engine's own check) are given back before anything is evicted.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvpool.client_lib.allocator import Holdings

log = logging.getLogger("kvpool.adapter")

NULL_BLOCK = 0  # the engine's null block: allocated first, never freed
SHRINK_STEP_WAIT_S = 0.3  # a shrink waits this long for the engine's current step
URGENT_WAIT_FACTOR = 3  # ... this many times longer when the daemon's deadline is near
IDLE_TICK_MAX_S = 0.5  # the idle watcher looks at least this often (a quarter timeout)


class ChunkHoldings(Protocol):
    """The allocator as the policy reads it (:class:`~kvpool.client_lib.ElasticBlockAllocator`
    is one): chunks are its release units, ``held_by_chunk`` lists only chunks with a
    held block."""

    def holdings(self) -> Holdings: ...

    def held_by_chunk(self) -> Mapping[int, int]: ...

    def chunk_of(self, block: int) -> int: ...

    def free(self, ids: Iterable[int]) -> None: ...

    def suspend(self) -> int: ...

    def resume(self, take_first: int = 0) -> list[int] | None: ...


class ElasticHooks(Protocol):
    """The engine-specific half of an elastic pool: what :class:`ElasticPolicy` asks of it.

    The implementer's obligations:

    * ``step_lock`` is held by the engine for every step and every request admission or
      abort (the bundled engine's ``Engine.step_lock``; vLLM's engine-core loop holds the
      bridge's lock per step). The engine never waits on the daemon while holding it, so
      a shrink waits one step at most. The policy takes it before ``lock``, as the
      engine does (step, then pool): evictions and preemptions happen between steps
      only, because an eviction in the middle of a step could take a prefix hit the
      scheduler found but has not referenced yet.
    * ``lock`` is the pool's own RLock; the policy holds it (inside ``step_lock``)
      across one whole shrink and one idle release, and calls every hook below with
      both held; hooks may take ``lock`` again (it is re-entrant).
    * ``evictable_blocks`` lists the blocks that are cached and unreferenced (reusable
      by a prefix hit, otherwise free), in any order; ``evict_listed(ids)`` evicts
      exactly those given (each one of them evictable): their cache entries go and they
      are freed into the allocator; ``evict_cached`` does that for every evictable
      block (LRU first) and returns how many; ``has_cache`` says whether there is an
      evictable or stashed block at all (a cheap check, read without ``lock``).
    * ``release_stash`` gives blocks the pool took from the allocator ahead of need
      back to it (a no-op for a pool without a stash).
    * ``preempt_newest`` preempts the newest running request, and more only while a
      preemption freed no block (shared prefix blocks); they requeue and recompute.
      Returns how many it preempted; 0 when nothing runs or no engine is bound yet.
    * ``activity`` returns None while the engine has a request (running or waiting) or
      there is no engine to watch yet, else a counter that changes whenever the engine
      does work (its step count, the allocator's operation count).
    * ``empty_for_sleep`` (``lock`` held; the caller holds ``step_lock`` with no request
      in the engine) evicts every cached block and gives the stash back, so only the
      null block stays held; it raises ``sleep_error(...)`` while a block is in use or
      the pool cannot sleep (the null block is not its own), having freed no block in
      use. ``sleep_error(message)`` is the engine's own error for a pool that cannot
      sleep or wake, worded as that engine's errors are.
    * ``publish_removals`` (both locks held) is called once at the end of every shrink,
      idle release and sleep: the engine hands the prefix-cache changes those made
      (removed blocks, a clear) to its KV-events publisher now, because the engine is
      between steps and may stay idle (an engine whose publisher sends by itself, or
      that publishes no events, does nothing). Never blocks on a subscriber.
    """

    @property
    def step_lock(self) -> threading.RLock: ...

    @property
    def lock(self) -> threading.RLock: ...

    def evictable_blocks(self) -> Iterable[int]: ...

    def evict_listed(self, blocks: list[int]) -> None: ...

    def evict_cached(self) -> int: ...

    def has_cache(self) -> bool: ...

    def release_stash(self) -> None: ...

    def preempt_newest(self) -> int: ...

    def activity(self) -> int | None: ...

    def empty_for_sleep(self) -> None: ...

    def sleep_error(self, message: str) -> Exception: ...

    def publish_removals(self) -> None: ...


@dataclass(frozen=True)
class ShrinkOutcome:
    """What one shrink did."""

    evicted: int  # cached blocks evicted
    preempted: int  # running requests preempted


class ElasticPolicy:
    """Shrink and idle release of one elastic pool (see the module), over its hooks.

    Counters (read by tests and stats): ``shrinks`` (callbacks received),
    ``shrink_evictions`` and ``shrink_preemptions`` (what shrinks did),
    ``idle_evictions`` (blocks the idle watcher evicted). ``asleep``: every block given
    back (:meth:`sleep`), until :meth:`wake`.
    """

    def __init__(self, hooks: ElasticHooks, allocator: ChunkHoldings) -> None:
        self.hooks = hooks
        self.allocator = allocator
        self.shrinks = self.shrink_evictions = self.shrink_preemptions = 0
        self.idle_evictions = 0
        self._stopped = threading.Event()
        self._idle_thread: threading.Thread | None = None
        self.asleep = False

    # ---- shrink -----------------------------------------------------------------------
    def shrink(self, nbytes: int, urgent: bool) -> ShrinkOutcome | None:
        """Free blocks worth ``nbytes`` so the library can release whole chunks: whole
        chunks of cache (fewest held first), then all the cache, then running requests
        newest first. ``urgent`` (deadline near) only lets it wait longer for the
        engine's current step. None when the step did not end in time (nothing done: the
        library asks again while it is still short)."""
        self.shrinks += 1
        want = max(1, math.ceil(nbytes / self.allocator.holdings().chunk))
        wait = SHRINK_STEP_WAIT_S * (URGENT_WAIT_FACTOR if urgent else 1)
        hooks = self.hooks
        if not hooks.step_lock.acquire(timeout=wait):
            return None
        ev0, pre0 = self.shrink_evictions, self.shrink_preemptions
        try:
            with hooks.lock:
                hooks.release_stash()
                before = self.held_chunks()
                self.evict_whole_chunks(want)
                if before - self.held_chunks() < want and hooks.has_cache():
                    self.shrink_evictions += hooks.evict_cached()
                target = max(before - want, 1)  # the null block's chunk stays
                while self.held_chunks() > target:
                    n = hooks.preempt_newest()
                    if not n:
                        break
                    self.shrink_preemptions += n
                    self.shrink_evictions += hooks.evict_cached()
                hooks.publish_removals()
        finally:
            hooks.step_lock.release()
        return ShrinkOutcome(self.shrink_evictions - ev0, self.shrink_preemptions - pre0)

    def evict_whole_chunks(self, want: int) -> int:
        """(locks held) Evict the cached blocks of up to ``want`` chunks in which every
        held block is evictable, fewest held blocks first (never the null block's
        chunk); returns how many chunks emptied."""
        alloc = self.allocator
        held = alloc.held_by_chunk()
        by_chunk: dict[int, list[int]] = defaultdict(list)
        for b in self.hooks.evictable_blocks():
            by_chunk[alloc.chunk_of(b)].append(b)
        null_chunk = alloc.chunk_of(NULL_BLOCK)
        whole = sorted((held[c], c) for c, blocks in by_chunk.items()
                       if c != null_chunk and len(blocks) == held.get(c, -1))[:want]
        for _, c in whole:
            self.hooks.evict_listed(by_chunk[c])
            self.shrink_evictions += len(by_chunk[c])
        return len(whole)

    def held_chunks(self) -> int:
        return len(self.allocator.held_by_chunk())

    # ---- idle release -------------------------------------------------------------------
    def start_idle_release(self, idle_timeout_s: float) -> None:
        """Start the idle watcher (once; not for ``idle_timeout_s <= 0``). It evicts
        under ``step_lock`` with no request in the engine, so it cannot race a prefix
        hit being taken."""
        if self._idle_thread is not None or idle_timeout_s <= 0:
            return
        self._idle_thread = threading.Thread(
            target=self._idle_loop, args=(idle_timeout_s,), name="kvpool-idle-cache",
            daemon=True)
        self._idle_thread.start()

    def stop(self) -> None:
        """End the idle watcher (joined unless called from it). Idempotent."""
        self._stopped.set()
        t = self._idle_thread
        if t is not None and t is not threading.current_thread():
            t.join()
            self._idle_thread = None

    def _idle_loop(self, timeout_s: float) -> None:
        tick = min(max(timeout_s / 4, 0.01), IDLE_TICK_MAX_S)
        last: int | None = None
        since = time.monotonic()
        while not self._stopped.wait(tick):
            now = time.monotonic()
            seen = self.hooks.activity()
            if seen is None or seen != last:
                last, since = seen, now
                continue
            if now - since >= timeout_s and self.hooks.has_cache():
                self.release_idle()

    def release_idle(self) -> int:
        """Evict the whole cache if the engine is between steps with no request;
        returns how many blocks (0 when a step or a request is under way)."""
        hooks = self.hooks
        if not hooks.step_lock.acquire(blocking=False):
            return 0  # a step or an add_request is under way: not idle
        try:
            if hooks.activity() is None:
                return 0
            with hooks.lock:
                hooks.release_stash()
                n = hooks.evict_cached()
                hooks.publish_removals()
            self.idle_evictions += n
            return n
        except Exception:  # never let the watcher die on a transient error
            log.exception("kvpool: idle cache release failed")
            return 0
        finally:
            hooks.step_lock.release()

    # ---- sleep ------------------------------------------------------------------------
    def sleep(self) -> int:
        """(the caller holds ``step_lock``, no request in the engine) Give every block
        back: the engine empties the pool (``empty_for_sleep``), the null block is freed
        and the allocator suspended (every chunk released, no refill until :meth:`wake`).
        Returns the chunks released (0 when already asleep). Raises the engine's
        ``sleep_error`` (nothing given back) while a block is in use; when the suspend
        fails the null block is taken back (:meth:`wake`) before it raises."""
        hooks = self.hooks
        with hooks.lock:
            if self.asleep:
                return 0
            hooks.empty_for_sleep()
            hooks.publish_removals()
            self.allocator.free([NULL_BLOCK])
            self.asleep = True
        try:
            return self.allocator.suspend()
        except BaseException:
            self.wake()  # not suspended after all: the null block back
            raise

    def wake(self) -> None:
        """Resume the allocator after :meth:`sleep`, taking block 0 (the null block) back
        first, waiting for memory like a grant; raises the engine's ``sleep_error``
        when the memory did not come or the first block is not block 0 (what came is
        freed; still asleep: call again). A no-op when awake."""
        hooks = self.hooks
        with hooks.lock:
            if not self.asleep:
                return
        got = self.allocator.resume(take_first=1)
        if got is None:
            raise hooks.sleep_error("no memory for the KV cache's first chunk (the daemon "
                                    "refused the grant)")
        if got != [NULL_BLOCK]:
            self.allocator.free(got)
            raise hooks.sleep_error(f"expected block {NULL_BLOCK} back on wake, got {got}")
        with hooks.lock:
            self.asleep = False
