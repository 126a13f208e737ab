"""The shared elastic-pool policy (kvpool.engine_adapters.elastic) over a fake engine:
the order of a shrink (whole chunks of cache fewest-held first, then the whole cache,
then preempt newest), the null block's chunk, the idle release, and the pool's sleep and
wake (the null block freed, the allocator suspended; block 0 back first)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pytest

from kvpool.client_lib import Holdings
from kvpool.engine_adapters.elastic import ElasticPolicy, ShrinkOutcome

PER = 4  # blocks per chunk
CHUNK = 1 << 16  # bytes per chunk


@dataclass
class FakeEngine:
    """An allocator's held blocks, a prefix cache and running requests, and a log of what
    the policy asked for (the ElasticHooks and ChunkHoldings of one fake pool)."""

    held: set[int] = field(default_factory=lambda: {0})  # block 0: the null block
    cached: list[int] = field(default_factory=list)  # evictable blocks, LRU first
    running: list[tuple[str, list[int]]] = field(default_factory=list)  # oldest first
    stash: list[int] = field(default_factory=list)
    log: list[tuple[str, object]] = field(default_factory=list)
    busy: bool = False
    steps: int = 0
    published: int = 0  # publish_removals calls
    suspended: bool = False
    resume_gives: list[int] | None = field(default_factory=lambda: [0])  # what resume hands
    step_lock: threading.RLock = field(default_factory=threading.RLock)
    lock: threading.RLock = field(default_factory=threading.RLock)

    # ChunkHoldings
    def holdings(self) -> Holdings:
        n = len(self.held_by_chunk())
        return Holdings(mapped=n * CHUNK, in_use=0, free=0, reserve=0, chunk=CHUNK,
                        mapped_chunks=n, reserve_chunks=0)

    def held_by_chunk(self) -> Mapping[int, int]:
        return Counter(b // PER for b in self.held)

    def chunk_of(self, block: int) -> int:
        return block // PER

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        assert set(ids) <= self.held, f"free of blocks not held: {ids}"
        self.log.append(("free", sorted(ids)))
        self.held -= set(ids)

    def suspend(self) -> int:
        assert not self.held, f"suspend with blocks held: {self.held}"
        self.suspended = True
        return 1

    def resume(self, take_first: int = 0) -> list[int] | None:
        got = self.resume_gives
        if got is None:
            return None
        self.suspended = False
        self.held |= set(got)
        return list(got)

    # ElasticHooks
    def evictable_blocks(self) -> Iterable[int]:
        return list(self.cached)

    def evict_listed(self, blocks: list[int]) -> None:
        assert all(b in self.cached for b in blocks)
        self.log.append(("chunk", sorted({b // PER for b in blocks})))
        self.cached = [b for b in self.cached if b not in blocks]
        self.held -= set(blocks)

    def evict_cached(self) -> int:
        n = len(self.cached)
        self.log.append(("all", n))
        self.held -= set(self.cached)
        self.cached = []
        return n

    def has_cache(self) -> bool:
        return bool(self.cached or self.stash)

    def release_stash(self) -> None:
        self.held -= set(self.stash)
        self.stash = []

    def preempt_newest(self) -> int:
        if not self.running:
            return 0
        rid, blocks = self.running.pop()
        self.log.append(("preempt", rid))
        self.cached += blocks  # a preempted request's blocks stay cached (evictable)
        return 1

    def activity(self) -> int | None:
        return None if self.busy or self.running else self.steps

    def empty_for_sleep(self) -> None:
        if self.running:
            raise self.sleep_error("cannot sleep: blocks are in use")
        self.release_stash()
        self.evict_cached()

    def sleep_error(self, message: str) -> Exception:
        return RuntimeError(f"fake: {message}")

    def publish_removals(self) -> None:
        self.published += 1


def _engine() -> FakeEngine:
    """Chunk 0: the null block and cached block 1. Chunk 1: 3 cached blocks. Chunk 2: 1
    cached block. Chunk 3: a cached block and one of request "old". Chunk 4: request
    "new"'s 4 blocks."""
    e = FakeEngine()
    e.cached = [1, 4, 5, 6, 8, 12]
    e.running = [("old", [13]), ("new", [16, 17, 18, 19])]
    e.held |= set(e.cached) | {13, 16, 17, 18, 19}
    return e


def test_whole_chunks_go_first_fewest_held_first():
    e = _engine()
    done = ElasticPolicy(e, e).shrink(2 * CHUNK, urgent=False)
    assert done == ShrinkOutcome(evicted=4, preempted=0)
    assert e.log == [("chunk", [2]), ("chunk", [1])]  # 1 held block, then 3
    assert 1 in e.cached and 12 in e.cached  # the null block's chunk and a mixed one stay


def test_then_the_whole_cache_then_the_newest_requests():
    e = _engine()
    policy = ElasticPolicy(e, e)
    done = policy.shrink(4 * CHUNK, urgent=True)
    assert e.log == [("chunk", [2]), ("chunk", [1]),  # whole chunks, fewest held first
                     ("all", 2),  # not enough: the whole cache
                     ("preempt", "new"), ("all", 4),  # then running requests, newest first
                     ("preempt", "old"), ("all", 1)]
    assert e.held == {0}  # down to the null block's chunk, never below
    assert done == ShrinkOutcome(evicted=4 + 2 + 4 + 1, preempted=2)
    assert (policy.shrinks, policy.shrink_preemptions) == (1, 2)


def test_preemption_stops_at_the_target():
    e = _engine()
    ElasticPolicy(e, e).shrink(3 * CHUNK, urgent=False)  # 5 chunks held, target 2
    assert [x for x in e.log if x[0] == "preempt"] == [("preempt", "new")]
    assert ("old", [13]) in e.running


def test_the_stash_goes_back_before_anything_is_evicted():
    e = _engine()
    e.stash = [20, 21, 22, 23]  # a whole chunk taken ahead of need
    e.held |= set(e.stash)
    ElasticPolicy(e, e).shrink(CHUNK, urgent=False)
    assert not e.stash and e.log == [("chunk", [2])]


def test_idle_release_evicts_only_an_idle_engine_between_steps():
    e = _engine()
    policy = ElasticPolicy(e, e)
    assert policy.release_idle() == 0 and e.log == []  # requests are running
    e.running = []
    with e.step_lock:  # another thread's step is under way: not idle
        t = threading.Thread(target=lambda: policy.release_idle())
        t.start()
        t.join()
    assert e.log == []
    assert policy.release_idle() == 6 and e.log == [("all", 6)]
    assert policy.idle_evictions == 6


def test_sleep_gives_every_block_back_and_wake_takes_block_0_first():
    e = _engine()
    e.running = []
    e.held -= {13, 16, 17, 18, 19}
    policy = ElasticPolicy(e, e)
    assert policy.sleep() == 1
    assert policy.asleep and e.suspended and e.held == set()
    assert ("free", [0]) in e.log  # the null block itself, freed by the policy
    assert policy.sleep() == 0  # already asleep: nothing more
    policy.wake()
    assert not policy.asleep and not e.suspended and e.held == {0}
    policy.wake()  # awake: a no-op
    assert e.held == {0}


def test_a_sleep_with_a_request_in_the_pool_gives_nothing_back():
    e = _engine()
    policy = ElasticPolicy(e, e)
    with pytest.raises(RuntimeError, match="^fake: cannot sleep"):
        policy.sleep()
    assert not policy.asleep and not e.suspended and 0 in e.held


def test_a_wake_without_memory_or_without_block_0_stays_asleep():
    e = FakeEngine()
    policy = ElasticPolicy(e, e)
    policy.sleep()
    e.resume_gives = None
    with pytest.raises(RuntimeError, match="^fake: no memory for the KV cache's first"):
        policy.wake()
    assert policy.asleep
    e.resume_gives = [4]
    with pytest.raises(RuntimeError, match=r"^fake: expected block 0 back on wake, got \[4\]"):
        policy.wake()
    assert policy.asleep and 4 not in e.held  # what came is freed again
    e.resume_gives = [0]
    policy.wake()
    assert not policy.asleep and e.held == {0}


def test_every_taking_hands_its_removals_to_the_publisher_once():
    """A shrink, an idle release and a sleep each end with one ``publish_removals`` (the
    engine may stay idle: its events must not wait for a step); a release that found the
    engine busy took nothing and publishes nothing."""
    e = _engine()
    policy = ElasticPolicy(e, e)
    assert policy.release_idle() == 0 and e.published == 0  # requests are running
    policy.shrink(2 * CHUNK, urgent=False)
    assert e.published == 1
    e.running = []
    e.held -= {13, 16, 17, 18, 19}
    assert policy.release_idle() > 0 and e.published == 2
    policy.sleep()
    assert e.published == 3
