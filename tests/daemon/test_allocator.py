"""ElasticBlockAllocator against a real daemon: layouts, policy, watermarks, invariants."""

from __future__ import annotations

import ctypes
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.client_lib import ElasticBlockAllocator

from .helpers import PAGE, wait_for


@pytest.mark.parametrize("block,ppc,bpc", [
    (16 << 10, 1, 4),  # a unit holds several blocks
    (64 << 10, 1, 1),
    (128 << 10, 2, 1),  # a block spans two units
    (48 << 10, 3, 4),  # neither divides: chunks of lcm = 192 KiB
])
def test_layouts_map_every_block_in_every_region(daemon, block, ppc, bpc):
    with daemon.connect("layout") as t:
        g = t.region_group(3, 24 * PAGE)
        a = ElasticBlockAllocator(g, block, background=False)
        assert (a.pages_per_chunk, a.blocks_per_chunk) == (ppc, bpc)
        blocks = a.alloc(a.num_blocks)
        assert sorted(blocks) == list(range(a.num_blocks))
        for b in blocks:  # first and last byte of each block, in each region: mapped
            for r in g.ranges:
                base = r.base + a.block_offset(b)
                ctypes.memset(base, b % 251 + 1, 1)
                ctypes.memset(base + block - 1, b % 251 + 1, 1)
        for b in blocks:
            for r in g.ranges:
                assert ctypes.string_at(r.base + a.block_offset(b), 1)[0] == b % 251 + 1
        assert a.alloc(1) is None  # virtual capacity exhausted: None, not an exception
        a.check_integrity()
        a.free(blocks)
        a.check_integrity()
        assert daemon.stats().pool.granted == a.mapped_chunks * ppc * 3 * PAGE


def test_fast_path_prefers_the_fullest_unit(daemon):
    with daemon.connect("fullest") as t:
        g = t.region_group(1, 8 * PAGE)
        a = ElasticBlockAllocator(g, 16 << 10, background=False)  # 4 blocks per unit
        first = a.alloc(8)  # two full chunks
        c = {b: b // 4 for b in first}
        chunk_a, chunk_b = sorted(set(c.values()))
        in_a = [b for b in first if c[b] == chunk_a]
        in_b = [b for b in first if c[b] == chunk_b]
        a.free(in_a[:3])  # chunk a: 1 held
        a.free(in_b[:1])  # chunk b: 3 held -> the fullest
        got = a.alloc(1)
        assert got[0] // 4 == chunk_b
        got2 = a.alloc(1)  # b is full now: a is the only partial chunk
        assert got2[0] // 4 == chunk_a
        a.check_integrity()
        slow = a.slow_allocs
        a.free(got + got2 + in_a[3:] + in_b[1:])
        assert a.alloc(4) is not None and a.slow_allocs == slow  # served from the reserve


def test_free_of_a_block_not_held_raises_and_changes_nothing(daemon):
    with daemon.connect("strict") as t:
        g = t.region_group(1, 4 * PAGE)
        a = ElasticBlockAllocator(g, 16 << 10, background=False)
        got = a.alloc(3)
        for bad in ([got[0], got[0]], [got[1], 10**6], [-1], [got[2], 15]):
            with pytest.raises(ValueError):
                a.free(bad)
            a.check_integrity()
        assert a.used_blocks == 3
        a.free(got)
        with pytest.raises(ValueError):
            a.free([got[0]])
        with pytest.raises(ValueError):
            a.alloc(-1)
        assert a.alloc(0) == []


def test_alloc_returns_none_when_the_daemon_says_no(start_daemon):
    d = start_daemon(budget=str(8 * PAGE))
    with d.connect("short") as t, d.connect("filler") as f:
        fg = f.region_group(1, 4 * PAGE)
        fg.grant(range(4))  # half the budget
        g = t.region_group(2, 8 * PAGE)
        a = ElasticBlockAllocator(g, 16 << 10, background=False)
        assert a.alloc(8) is not None  # 2 units x 2 regions = the rest of the budget
        assert a.alloc(1) is None  # NO_MEMORY -> None
        a.check_integrity()
        fg.release(range(4))  # the budget has room again...
        d.cli("limit", "short", str(4 * PAGE))  # ...but the limit is what short holds
        pool = d.stats().pool
        assert pool.budget - pool.granted >= 2 * PAGE  # free or warm: grantable
        assert a.alloc(4) is None  # OVER_LIMIT -> None, with the budget free
        a.check_integrity()
        d.cli("limit", "short", str(6 * PAGE))
        assert a.alloc(4) is not None  # the limit, not the budget, refused before
        a.check_integrity()


def test_background_thread_keeps_watermarks_and_drains_when_idle(daemon):
    with daemon.connect("bg") as t:
        g = t.region_group(1, 64 * PAGE)
        a = ElasticBlockAllocator(g, 16 << 10, low=2, high=5, idle_timeout_s=0.4, tick_s=0.002)
        held = a.alloc(1)
        wait_for(lambda: a.reserve_chunks >= 2)
        assert a.reserve_chunks <= 5
        more = a.alloc(40)  # eats the reserve; the thread refills it
        wait_for(lambda: a.reserve_chunks >= 2)
        a.free(more)  # 10 chunks come back empty: the surplus over 5 is released
        wait_for(lambda: a.reserve_chunks <= 5)
        assert a.releases >= 1
        a.check_integrity()
        wait_for(lambda: a.reserve_chunks == 0, timeout=5)  # idle
        a.report()
        with daemon.monitor() as m:
            (grp,) = m.map("bg").groups
        assert (grp.in_use_units, grp.reserve_units) == (1, 0)  # only `held`'s unit
        a.free(held)
        a.check_integrity()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 2**32)),
                    min_size=1, max_size=60),
       block=st.sampled_from([16 << 10, 32 << 10, 48 << 10, 128 << 10]))
def test_random_alloc_free_sequences_keep_the_books(shared_tenant, ops, block):
    g = shared_tenant.region_group(2, 32 * PAGE)
    a = ElasticBlockAllocator(g, block, low=1, high=3, tick_s=0.001)
    held: list[int] = []
    try:
        for is_alloc, n, seed in ops:
            if is_alloc or not held:
                got = a.alloc(n)
                if got is not None:
                    assert not set(got) & set(held)
                    held.extend(got)
            else:
                random.Random(seed).shuffle(held)
                k = min(n, len(held))
                a.free(held[:k])
                del held[:k]
            a.check_integrity()
        a.free(held)
        a.check_integrity()
    finally:
        g.close()


@pytest.fixture(scope="module")
def shared_tenant():
    """One daemon and tenant for the hypothesis test (module scope: fast examples)."""
    import shutil
    import tempfile
    from pathlib import Path

    from .helpers import daemon_command, spawn_daemon, stop_daemon

    run_dir = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))
    log = run_dir.with_suffix(".log")
    d = spawn_daemon(daemon_command(run_dir, budget=48 * PAGE), run_dir, log)
    t = d.connect("hyp")
    yield t
    t.close()
    assert d.check() == []
    assert d.stats().pool.granted == 0
    stop_daemon(d)
    shutil.rmtree(run_dir, ignore_errors=True)
    log.unlink(missing_ok=True)


def test_concurrent_engine_and_refill_threads(daemon):
    """The engine thread allocates and frees while the refill thread grows and shrinks."""
    with daemon.connect("threads") as t:
        g = t.region_group(2, 64 * PAGE)
        a = ElasticBlockAllocator(g, 16 << 10, low=1, high=2, tick_s=0.0005)
        rng = random.Random(7)
        held: list[int] = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            if held and rng.random() < 0.5:
                k = rng.randint(1, len(held))
                a.free(held[:k])
                del held[:k]
            else:
                got = a.alloc(rng.randint(1, 10))
                if got:
                    held += got
        a.free(held)
        a.stop()
        a.check_integrity()
        assert a.grants > 5 and a.releases > 1


def test_reclaim_is_served_from_the_reserve(daemon):
    from kvpool import protocol as p

    with daemon.connect("reclaimed") as t:
        g = t.region_group(2, 32 * PAGE)
        a = ElasticBlockAllocator(g, 16 << 10, background=False)
        held = a.alloc(1)
        a.rebalance()  # reserve below low: grows to high
        assert a.reserve_chunks == a.high
        t.handle_message(p.Reclaim(bytes=3 * 2 * PAGE))  # as if the daemon asked
        assert a.reserve_chunks == a.high - 3
        assert t.reclaim_reserve(1 << 30) == (a.high - 3) * 2 * PAGE
        assert a.reserve_chunks == 0
        a.check_integrity()
        assert daemon.stats().pool.granted == 2 * PAGE  # only the unit holding `held`
        a.free(held)


def test_take_first_gets_block_zero_even_when_the_refill_thread_runs_first(daemon):
    """An engine's null block must be block 0. Without ``take_first`` the background
    thread may map the first chunks into the reserve before the engine's first alloc
    (seen with three servers starting on two loaded cores: 'got [8]'); with it, block 0
    is taken before the thread starts."""
    with daemon.connect("first") as t:
        g = t.region_group(1, 16 * PAGE)
        racy = ElasticBlockAllocator(g, 16 << 10, low=2, high=4, tick_s=0.001)
        wait_for(lambda: racy.mapped_chunks >= 2, what="the refill thread filling the reserve")
        assert racy.alloc(1) != [0]  # the race: the reserve's chunk came first
        racy.close()
        g2 = t.region_group(1, 16 * PAGE)
        a = ElasticBlockAllocator(g2, 16 << 10, low=2, high=4, tick_s=0.001, take_first=1)
        assert a.first_blocks == [0]
        wait_for(lambda: a.mapped_chunks >= 2, what="the reserve filled after block 0")
        a.check_integrity()
        a.close()


def test_suspend_gives_every_chunk_back_and_resume_takes_block_0_first(daemon):
    """The sleep of an engine (issue 22): suspended, the allocator holds nothing and the
    refill thread grants nothing; resume's first block is block 0 again (an engine's
    null block), before the refill maps anything."""
    with daemon.connect("sleeper") as t:
        g = t.region_group(2, 16 * PAGE)
        a = ElasticBlockAllocator(g, 16 << 10, low=2, high=4, tick_s=0.005,
                                  idle_timeout_s=60, take_first=1)
        assert a.first_blocks == [0]
        more = a.alloc(9)
        wait_for(lambda: a.reserve_chunks >= 2, what="a refilled reserve")
        with pytest.raises(ValueError, match="still held"):
            a.suspend()  # blocks held: nothing released
        assert not a.suspended and a.mapped_chunks > 0
        a.free([0, *more])
        assert a.suspend() > 0
        assert a.suspended and a.mapped_chunks == 0 and not g.mapped
        assert daemon.stats().pool.granted == 0
        a.rebalance()  # the refill step does nothing while suspended
        assert a.mapped_chunks == 0 and a.alloc(1) is None and a.alloc_chunks(1) is None
        a.check_integrity()
        assert a.resume(take_first=1) == [0]
        assert not a.suspended
        # a wake maps what its first requests take (issue 36 item 5): no reserve refill
        # while block 0's chunk covers them, however many refill steps run
        got = a.alloc(3)  # block 0's chunk holds them
        for _ in range(5):
            a.rebalance()
        assert (a.mapped_chunks, a.reserve_chunks) == (1, 0)
        more = a.alloc(8)  # beyond that chunk: a grant for demand, and refills run again
        wait_for(lambda: a.reserve_chunks >= 2, what="the refill once requests outgrew it")
        a.free([0, *got, *more])
        a.check_integrity()
        a.close()
