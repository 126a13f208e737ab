"""Memory itself as an attack surface (issue 9): released pages a tenant keeps, the warm
pool against the budget, two tenants racing for the last pages. Real daemon, real
memfds, real processes."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import pytest

from kvpool import protocol as p
from kvpool.client_lib.errors import KvpoolError, NoMemory, OverLimit
from kvpool.daemon.pool import Pool
from kvpool.vmm.host import HostBackend

from .helpers import PAGE, wait_for

BUDGET = 32  # pages


def tenant_row(d, name):
    with d.monitor() as m:
        return next(t for t in m.ps().tenants if t.name == name)


def resident(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


@pytest.mark.parametrize("keep", ["fds", "mappings"])
def test_released_pages_a_tenant_keeps_stay_inside_the_budget(start_daemon, keep):
    """The attack: grant the whole budget, write it, keep a descriptor (or a mapping) of
    every page, release, repeat. Before: three rounds held 3x the budget while ``ps``
    said 0. Now the kept pages stay charged (``retained``) until they are really gone."""
    d = start_daemon(budget=str(BUDGET * PAGE))
    kept_fds: list[int] = []
    kept_maps: list[mmap.mmap] = []
    with d.connect("keeper") as t, d.connect("honest") as h:
        g = t.region_group(1, BUDGET * PAGE)
        g.grant(range(BUDGET))
        ctypes.memset(g.ranges[0].base, 0x5A, BUDGET * PAGE)  # really resident
        for u in range(BUDGET):
            fd = os.dup(g.handles[u][0].handle)
            if keep == "fds":
                kept_fds.append(fd)
            else:
                kept_maps.append(mmap.mmap(fd, PAGE))
                os.close(fd)
        g.release(range(BUDGET))
        held = (sum(resident(fd) for fd in kept_fds) if keep == "fds"
                else BUDGET * PAGE)  # a mapping of a written page: resident by definition
        assert held == BUDGET * PAGE

        # the daemon retires the released pages when idle; what it cannot free stays charged
        wait_for(lambda: d.stats().pool.dirty == 0, what="released pages retired")
        row = tenant_row(d, "keeper")
        assert row.retained == BUDGET * PAGE and row.mapped == 0
        line = next(x for x in d.cli("ps").stdout.splitlines() if "keeper" in x)
        assert "retained" in line  # the operator sees it too
        pool = d.stats().pool
        assert pool.retained == BUDGET * PAGE
        assert pool.granted + pool.warm + pool.dirty + pool.leased + pool.retained <= pool.budget

        # so neither the keeper (they count against its limit, the budget by default)
        # nor anyone else gets a second budget's worth
        with pytest.raises(OverLimit, match="still references"):
            g.grant(range(BUDGET), speculative=True)
        hg = h.region_group(1, BUDGET * PAGE)
        with pytest.raises(NoMemory):
            hg.grant([0], speculative=True)
        assert d.check() == []

        # letting go of the last reference gives the memory back to the pool
        for fd in kept_fds:
            os.close(fd)
        for m in kept_maps:
            m.close()
        wait_for(lambda: tenant_row(d, "keeper").retained == 0, what="retained back to 0")
        hg.grant(range(BUDGET))  # the whole budget again, for the honest tenant
        data = ctypes.string_at(hg.ranges[0].base, BUDGET * PAGE)
        assert data.count(0) == len(data), "a page handed on holds the keeper's data"
        assert d.check() == []


def test_a_page_handed_to_another_tenant_was_never_exported_to_the_previous(daemon):
    """A tenant that keeps a descriptor of a page it released sees nothing of the next
    tenant's data, and writes through it reach no one (fresh memfds)."""
    with daemon.connect("before") as a, daemon.connect("after") as b:
        ga = a.region_group(1, 4 * PAGE)
        ga.grant(range(4))
        kept = [os.dup(ga.handles[u][0].handle) for u in range(4)]
        inodes = {os.fstat(fd).st_ino for fd in kept}
        ga.release(range(4))
        wait_for(lambda: daemon.stats().pool.dirty == 0, what="released pages retired")
        gb = b.region_group(1, 4 * PAGE)
        gb.grant(range(4))
        assert not inodes & {os.fstat(gb.handles[u][0].handle).st_ino for u in range(4)}
        ctypes.memset(gb.ranges[0].base, 0x42, 4 * PAGE)
        for fd in kept:
            with mmap.mmap(fd, PAGE) as m:
                assert m[:] == bytes(PAGE), "the kept page shows the next tenant's data"
                m[:4] = b"evil"
            os.close(fd)
        assert ctypes.string_at(gb.ranges[0].base, 4 * PAGE) == b"\x42" * (4 * PAGE)


def test_warm_pool_is_clamped_to_the_budget(start_daemon):
    """``warm_max`` above the budget, ``warm_min`` all of it: the warm pool still never
    holds more than the budget leaves. (A ``warm_min`` above the budget is refused at
    start: tests/daemon/test_config_validation.py.)"""
    d = start_daemon(budget=str(8 * PAGE), extra=("--warm-min", str(8 * PAGE),
                                                  "--warm-max", str(64 * PAGE)))
    pool = d.stats().pool
    assert pool.warm_max <= pool.budget and pool.warm_min <= pool.budget
    with d.connect("a") as t:
        g = t.region_group(1, 8 * PAGE)
        g.grant(range(6))
        wait_for(lambda: d.stats().pool.warm == 2 * PAGE, what="warm pool refilled")
        pool = d.stats().pool
        assert pool.granted + pool.warm + pool.dirty <= pool.budget
        g.release(range(6))
        wait_for(lambda: d.stats().pool.dirty == 0, what="released pages retired")
        pool = d.stats().pool
        assert pool.warm <= pool.budget and pool.granted + pool.warm <= pool.budget


def test_adopted_pages_over_the_budget_leave_no_warm_surplus():
    """Adoption may bring more pages than the budget (tenants shrink afterwards); as they
    come back the pool must shrink to the budget, not keep them warm up to warm_max."""
    backend = HostBackend(page_size=PAGE)
    pool = Pool(backend, budget_pages=4, warm_min=2, warm_max=64)
    assert pool.warm_max == 4
    pfns = [pool.adopt(backend.create_page(), tenant=7) for _ in range(10)]
    pool.give_back(pfns, tenant=7)
    for _ in range(1000):
        if not pool.has_work():
            break
        pool.maintain(1.0)
    assert not pool.has_work()
    assert len(pool.pages) + pool.leased + len(pool.retained) <= pool.budget_pages
    assert len(pool.warm) <= pool.budget_pages
    assert pool.check() == []
    pool.close()
    backend.close()


def test_two_tenants_racing_for_the_last_pages(start_daemon):
    """1,000 rounds each: two tenants grant and release the last free pages while a third
    holds the rest. Nobody aborts, every refusal is a clean NO_MEMORY, the budget is
    never exceeded (watched from outside throughout), the books balance at the end."""
    d = start_daemon(budget=str(16 * PAGE))
    rounds = 1000
    results: dict[str, dict[str, int]] = {}
    errors: list[BaseException] = []
    over: list[str] = []
    done = threading.Event()

    def watch():
        with d.monitor() as m:
            while not done.is_set():
                s = m.stats().pool
                used = s.granted + s.warm + s.dirty + s.leased + s.retained
                if used > s.budget:
                    over.append(f"{used} > {s.budget}: {s}")

    def race(name: str):
        counts = {"granted": 0, p.NO_MEMORY: 0}
        try:
            with d.connect(name) as t:
                g = t.region_group(2, 4 * PAGE)
                for _ in range(rounds):
                    try:
                        g.grant([0, 1], speculative=True)  # 4 pages: both cannot fit
                    except KvpoolError as e:
                        counts[e.code] = counts.get(e.code, 0) + 1
                        continue
                    counts["granted"] += 1
                    g.release([0, 1])
        except BaseException as e:  # an abort: reported below
            errors.append(e)
        results[name] = counts

    with d.connect("holder") as holder:
        hg = holder.region_group(1, 10 * PAGE)
        hg.grant(range(10))  # 6 pages left: room for one racer's 4, never for both
        watcher = threading.Thread(target=watch)
        watcher.start()
        racers = [threading.Thread(target=race, args=(n,)) for n in ("red", "blue")]
        for r in racers:
            r.start()
        for r in racers:
            r.join()
        done.set()
        watcher.join()
        assert not errors, errors
        assert not over, over[:3]
        for name, counts in results.items():
            assert set(counts) <= {"granted", p.NO_MEMORY}, (name, counts)
            assert counts["granted"] + counts[p.NO_MEMORY] == rounds, (name, counts)
            assert counts["granted"] > 0, (name, counts)
        assert d.proc.poll() is None
        assert d.check() == []
        s = d.stats()
        assert s.pool.granted == 10 * PAGE
