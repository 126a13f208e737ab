"""Cached weight sets (sealed, held by nobody) never keep a set out (issue 33, item 2;
docs/THREAT-MODEL.md, "Weight sets"): each uid caches at most
:data:`~kvpool.daemon.weights.MAX_CACHED_PER_UID` sets (its least recently held go
first), and a create that finds the pool's :data:`~kvpool.daemon.weights.MAX_SETS`
taken evicts the least recently held cached set before it is refused. The attack runs
against a real daemon; the count rule against ``WeightSets`` over a host pool with a
small cap (no daemon, as tests/daemon/test_weight_scope.py does)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvpool import protocol as p
from kvpool.client_lib.weights import WeightSet
from kvpool.daemon.outcome import Fail, Sender
from kvpool.daemon.pool import Pool
from kvpool.daemon.tenants import TenantRecord, Tenants
from kvpool.daemon.weights import MAX_CACHED_PER_UID, MAX_SETS, WeightSets
from kvpool.vmm.host import HostBackend

from .helpers import PAGE
from .test_weight_sets import KEY_A, PATTERN, loaded


def key(i: int) -> str:
    return f"{i:064x}"


def test_one_uids_cached_sets_never_fill_the_pool(start_daemon):
    """The attack: a uid with a 256 KiB max creates, seals and detaches 256 one-page sets
    (each is cached, held by nobody, on no one's max). It keeps at most its share of
    cached sets, and a later create by anyone is made."""
    d = start_daemon(budget="32MiB")  # 512 pages: room for every set, no eviction for pages
    with d.connect("flooder", max=4 * PAGE) as f:
        for i in range(MAX_SETS):
            loaded(f, key(i), bytes(PAGE)).detach()
    with d.monitor() as m:
        pool = m.ps().pool
    assert pool is not None and pool.weight_sets == MAX_CACHED_PER_UID
    assert pool.weights_cached == MAX_CACHED_PER_UID * PAGE
    with d.connect("honest") as h:
        ws = loaded(h, KEY_A, PATTERN)
        assert bytes(ws.view) == PATTERN
    with d.connect("again") as a:  # the flooder's latest sets are still cached
        assert bytes(WeightSet.attach(a, key(MAX_SETS - 1)).view) == bytes(PAGE)
    assert d.check() == []


# ---- the pool-wide count, over WeightSets itself -------------------------------------------
SENDER = Sender(identity=b"x", envelope=[b"x"])


@pytest.fixture
def socks() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


def small_cap(socks: list[socket.socket], uids: int
              ) -> tuple[WeightSets, list[TenantRecord]]:
    """WeightSets over a 64-page host pool that holds at most 4 sets; one tenant per uid."""
    pool = Pool(HostBackend(page_size=PAGE), budget_pages=64)
    tenants = Tenants()
    made = []
    for uid in range(1000, 1000 + uids):
        a, b = socket.socketpair()
        socks.extend((a, b))
        made.append(tenants.add(token=str(uid), pid=uid, uid=uid, gid=uid, conn=a,
                                name=f"u{uid}", kind="engine", registered=True,
                                max_pages=64))
    return WeightSets(pool, tenants, owed=lambda: 0, max_sets=4), made


def create(ws: WeightSets, t: TenantRecord, k: str, seal: bool = True) -> None:
    out = ws.create(t, SENDER, p.WeightCreate(id=1, key=k, nbytes=PAGE))
    assert isinstance(out.reply, p.WeightGranted)
    if seal:
        ws.seal(t, SENDER, p.WeightSeal(id=2, key=k))


def test_a_full_count_evicts_the_least_recently_held_cached_set(socks):
    ws, (a, b, c) = small_cap(socks, 3)
    try:
        for i in range(4):  # four uids' worth of cached sets: the count is full
            create(ws, a if i < 2 else b, key(i))
            ws.detach(a if i < 2 else b, SENDER, p.WeightDetach(id=3, key=key(i)))
        assert len(ws.sets) == 4 and ws.pinned_pages == 0
        create(ws, c, key(9))  # the oldest cached set makes room
        assert sorted(s.key for s in ws.sets.values()) == [key(1), key(2), key(3), key(9)]
        for t, i in ((a, 1), (b, 2), (b, 3)):  # held now: nothing to evict, it refuses
            ws.attach(t, SENDER, p.WeightAttach(id=4, key=key(i)))
        with pytest.raises(Fail) as e:
            create(ws, c, key(10), seal=False)
        assert e.value.code == p.OVER_LIMIT and "4 weight sets" in str(e.value)
        assert ws.check(set()) == [] and ws.pool.check_charges(ws.tenants.by_id) == []
    finally:
        ws.pool.close()
