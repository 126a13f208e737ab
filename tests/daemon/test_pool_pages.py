"""Pool rules with real memfds: whose pages go where, retained pages in the budget, and
all-or-nothing grants when retirement cannot make room."""

from __future__ import annotations

import os

import pytest

from kvpool.daemon.pool import PoolExhausted, Pool
from vmm.fixtures import host_backend

PAGE = 64 << 10


backend = host_backend(PAGE)


def inode(pool: Pool, pfn: int) -> int:
    return os.fstat(pool.pages[pfn].handle).st_ino


def settle(pool: Pool) -> None:
    for _ in range(1000):
        if not pool.has_work():
            return
        pool.maintain(1.0)
    raise AssertionError("maintenance never settles")


def test_only_the_releaser_gets_a_released_page_back(backend):
    pool = Pool(backend, budget_pages=6, warm_min=0, warm_max=6)
    a = pool.take(3, tenant=1)
    exported = {inode(pool, x) for x in a}
    pool.give_back(a, tenant=1)
    mine = pool.take(2, tenant=1)  # its own, as they were: no new page
    assert set(mine) <= set(a) and pool.created == 3
    other = pool.take(4, tenant=2)  # the budget's rest: needs tenant 1's third page's room
    assert not exported & {inode(pool, x) for x in other}
    assert pool.check() == []
    pool.give_back(mine, tenant=1)
    pool.give_back(other, tenant=2)
    settle(pool)
    assert not pool.dirty and pool.renewed > 0
    assert not exported & {inode(pool, x) for x in pool.pages}, "a released page was kept"
    assert pool.check() == []
    pool.close()


def test_retained_pages_count_in_the_budget_until_let_go(backend):
    pool = Pool(backend, budget_pages=4, warm_min=0, warm_max=4)
    got = pool.take(4, tenant=1)
    kept = [os.dup(pool.pages[x].handle) for x in got[:3]]  # what a tenant could keep
    pool.give_back(got, tenant=1)
    settle(pool)
    assert pool.retained_pages(1) == 3 and pool.retained_pages() == 3
    assert pool.available == 1 and pool.free == 0 and len(pool.warm) == 1
    with pytest.raises(PoolExhausted):
        pool.take(2, tenant=2)
    with pytest.raises(PoolExhausted):
        pool.lease(2)
    assert pool.recheck_retained() == 0  # still held
    for fd in kept:
        os.close(fd)
    assert pool.recheck_retained() == 3
    assert pool.available == 4
    assert len(pool.take(4, tenant=2)) == 4
    assert pool.check() == []
    pool.close()


def test_a_grant_that_retirement_cannot_cover_changes_nothing(backend):
    """Tenant 1's released pages look available, but it still holds two of them:
    retiring them on tenant 2's grant path frees no budget, so the grant fails whole and
    what it had taken goes back where it was."""
    pool = Pool(backend, budget_pages=4, warm_min=0, warm_max=4)
    mine = pool.take(1, tenant=2)
    pool.give_back(mine, tenant=2)  # dirty, tenant 2's own
    first = pool.take(3, tenant=1)
    kept = [os.dup(pool.pages[x].handle) for x in first[:2]]
    pool.give_back(first, tenant=1)  # not retired yet: no idle time in between
    assert pool.available == 4
    with pytest.raises(PoolExhausted):
        pool.take(3, tenant=2)  # its own page + one fresh: tenant 1 holds the rest
    assert pool.dirty == {mine[0]: 2}, "its own page is back where it was"
    assert pool.retained_pages(1) == 2 and len(pool.warm) == 1  # the fresh one, unused
    assert pool.check() == []
    ready = [mine[0], *pool.warm]
    assert sorted(pool.take(2, tenant=2)) == sorted(ready)
    for fd in kept:
        os.close(fd)
    pool.close()
