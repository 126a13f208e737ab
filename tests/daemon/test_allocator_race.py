"""The allocator's slow path against reclaims and the refill thread (issue 9, #13).

A grant that succeeded must reach the caller: chunks granted for an ``alloc`` are handed
to it directly, never parked in the reserve where a reclaim or the refill thread could
release them first (``alloc`` returned None after a successful grant, and under pressure
looped grant -> reclaim -> grant)."""

from __future__ import annotations

from kvpool.client_lib import ElasticBlockAllocator

from .helpers import PAGE


def test_a_reclaim_right_after_the_grant_cannot_take_the_callers_chunks(daemon):
    """Forces the interleaving: a reclaim of the whole reserve runs the moment the slow
    path's grant has been mapped, before ``alloc`` returns."""
    with daemon.connect("raced") as t:
        g = t.region_group(1, 16 * PAGE)
        a = ElasticBlockAllocator(g, 16 << 10, background=False)  # 4 blocks per chunk
        grow = a._grow
        reclaimed: list[int] = []

        def grow_then_reclaim(*args, **kw):
            ok = grow(*args, **kw)
            reclaimed.append(a.release_reserve(1 << 40))  # the daemon asks for everything
            return ok

        a._grow = grow_then_reclaim
        got = a.alloc(8)  # two chunks: nothing mapped yet, so the slow path grants them
        assert got is not None and len(got) == 8
        assert reclaimed == [0]  # the reserve held none of the caller's chunks
        assert a.grants == 1 and a.used_blocks == 8
        a._grow = grow
        a.check_integrity()
        assert daemon.stats().pool.granted == 2 * PAGE
        a.free(got)
        a.check_integrity()


def test_a_refill_trim_right_after_the_grant_cannot_take_the_callers_chunks(daemon):
    """The same interleaving with the refill thread's step: with ``high=0`` a rebalance
    releases every reserve chunk it finds; it runs as soon as the slow path's grant is
    mapped, before ``alloc`` returns."""
    with daemon.connect("trimmed") as t:
        g = t.region_group(1, 16 * PAGE)
        a = ElasticBlockAllocator(g, 16 << 10, low=0, high=0, background=False)
        grow = a._grow

        def grow_then_trim(*args, **kw):
            ok = grow(*args, **kw)
            a.rebalance()
            return ok

        a._grow = grow_then_trim
        held: list[int] = []
        for _ in range(3):
            got = a.alloc(8)  # two more chunks, granted by the slow path each time
            assert got is not None and len(got) == 8
            held += got
        assert a.grants == a.slow_allocs == 3 and a.releases == 0
        a._grow = grow
        a.check_integrity()
        a.free(held)
        a.rebalance()  # and the trim does release what is really in the reserve
        assert a.releases == 1
        a.check_integrity()
