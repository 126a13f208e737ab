"""The arbiter's policy decisions without a daemon: each check of check_integrity that
issue 9 added can fail; the head-of-line rule and the id allocator, in isolation."""

from __future__ import annotations

from kvpool import protocol as p
from kvpool.daemon.regions import GroupRecord

PAGE = 64 << 10


def test_integrity_flags_a_monitor_that_holds_memory(arb):
    m, _ = arb.tenant("watch", kind="monitor")
    assert arb.check_integrity() == []
    m.groups[99] = GroupRecord(id=99, tenant=m.id, n_regions=1, npages=1)
    arb.groups[99] = m.groups[99]
    assert any("monitor session" in x for x in arb.check_integrity())


def test_integrity_flags_an_index_mismatch_and_ids_out_of_range(arb):
    t, ident = arb.tenant("a")
    g = arb.handle(ident, p.CreateGroup(id=2, token=t.token, n_regions=1, capacity=PAGE)).reply
    assert arb.check_integrity() == []
    del arb.groups[g.group]
    assert any("group index" in x for x in arb.check_integrity())
    arb.groups[g.group] = t.groups[g.group]
    big = GroupRecord(id=p.MAX_GROUP_ID + 1, tenant=t.id, n_regions=1, npages=1)
    t.groups[big.id] = arb.groups[big.id] = big
    assert any("outside 1.." in x for x in arb.check_integrity())


def test_group_ids_wrap_within_range_and_skip_live_ones(arb):
    t, ident = arb.tenant("a")
    arb.next_group = p.MAX_GROUP_ID
    ids = [arb.handle(ident, p.CreateGroup(id=i, token=t.token, n_regions=1,
                                           capacity=PAGE)).reply.group for i in range(3)]
    assert ids == [p.MAX_GROUP_ID, 1, 2]
    arb.next_group = 1  # 1 and 2 are live: skipped
    assert arb.handle(ident, p.CreateGroup(id=9, token=t.token, n_regions=1,
                                           capacity=PAGE)).reply.group == 3


def test_a_grant_that_fits_jumps_a_waiter_only_within_its_fair_share(arb):
    hog, hi = arb.tenant("hog")
    small, si = arb.tenant("small")
    waiter, wi = arb.tenant("waiter")
    gid = {}
    for t, i in ((hog, hi), (small, si), (waiter, wi)):
        gid[t.id] = arb.handle(i, p.CreateGroup(id=2, token=t.token, n_regions=1,
                                                capacity=16 * PAGE)).reply.group
    grant = lambda t, i, units: arb.handle(i, p.Grant(id=3, token=t.token, group=gid[t.id],
                                                      units=units))
    assert grant(hog, hi, list(range(12))).reply.ok
    assert grant(small, si, [0, 1, 2, 3]).reply.ok
    assert grant(waiter, wi, [0, 1, 2, 3]).deferred  # full: it waits for reclaim
    arb.handle(si, p.Release(id=4, token=small.token, group=gid[small.id], units=[3]))
    out = grant(small, si, [3])  # fits, within its share: served now
    assert isinstance(out.reply, p.Granted)
    arb.handle(hi, p.Release(id=5, token=hog.token, group=gid[hog.id], units=[11]))
    hog.ask = None  # (not being asked: only its share stops it)
    out = grant(hog, hi, [11])  # fits, but above its share: it queues behind the waiter
    assert out.deferred or out.reply.code == p.NO_MEMORY
