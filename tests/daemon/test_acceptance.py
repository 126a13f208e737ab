"""Issue 3 acceptance: a real daemon process, real tenant processes, host backend."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from functools import partial

import psutil
import torch

from kvpool.client_lib import ElasticBlockAllocator
from .helpers import PAGE, read_event, wait_for
from .test_attacks_round3 import as_nobody, group_daemon, needs_root


def test_two_tenants_share_the_budget_and_limits_hold(start_daemon, tmp_path):
    """Two churning tenants, A limited: every sample keeps the budget and A's limit, and
    the outcomes are awaited, never timed: both made 50 allocations (A probing past its
    limit then, refused), and together they held more than half the budget at once."""
    budget_pages = 96
    d = start_daemon(budget=str(budget_pages * PAGE))
    budget = budget_pages * PAGE
    d.cli("limit", "A", "2MiB")
    stop = tmp_path / "stop"
    common = ["--seconds", "600", "--until-file", str(stop), "--mark-ok", "50",
              "--max-blocks", "200", "--regions", "2", "--block", str(16 << 10)]
    a = d.worker("churn", "--name", "A", "--seed", "1", "--probe-over-limit", *common)
    b = d.worker("churn", "--name", "B", "--seed", "2", *common)
    read_event(a, "ready")
    read_event(b, "ready")

    samples = 0
    peak = 0
    with d.monitor() as m:
        def sample() -> bool:
            nonlocal samples, peak
            s = m.stats()
            mapped = {t.name: t.mapped for t in s.tenants}
            assert s.pool.granted <= budget
            assert sum(mapped.values()) == s.pool.granted <= budget
            assert mapped.get("A", 0) <= 2 << 20
            peak = max(peak, s.pool.granted)
            samples += 1
            return samples >= 20 and peak > budget // 2  # they really competed

        wait_for(sample, timeout=120, every=0.01, what="20 samples, more than half granted")
    read_event(a, "over_limit", timeout=120)  # A was refused past its limit...
    read_event(a, "ok_reached", timeout=120)  # ...while both kept allocating
    read_event(b, "ok_reached", timeout=120)
    stop.touch()
    done_a = read_event(a, "done")
    done_b = read_event(b, "done")
    assert a.wait(20) == 0 and b.wait(20) == 0
    assert done_a["over_limit"] == 1, done_a
    assert done_b["ok"] >= 50 and done_a["ok"] >= 50
    assert d.check() == []
    s = d.stats()
    assert s.pool.granted == 0 and not s.tenants


@needs_root
def test_kill9_returns_the_pages_and_next_tenant_reads_zeros(start_daemon, tmp_path):
    """Idle maintenance is held off (``idle_work_s`` far below one page's retirement), so
    the victim's released pages are still *dirty* when the next tenant asks for the whole
    budget: what ``Pool.take`` does with another tenant's released pages is what the
    next tenant reads (it must retire them and give fresh zeroed ones). The next tenant
    is another uid (65534): a tenant of the victim's uid would have the ended session's
    pages settled (retired) before ``take`` runs, so it would read zeros whatever
    ``take`` does."""
    d = group_daemon(partial(start_daemon, budget=str(32 * PAGE)), tmp_path,
                     conf="idle_work_s = 1e-9\n")
    w = d.worker("hold", "--name", "victim", "--regions", "2", "--units", "16",
                 "--capacity", str(16 * PAGE), "--fill", "0xAB")
    ready = read_event(w, "ready")
    ps = d.cli_json("ps")
    (victim,) = [t for t in ps["tenants"] if t["pid"] == ready["pid"]]
    assert victim["mapped"] == 32 * PAGE and ps["pool"]["granted"] == 32 * PAGE

    os.kill(ready["pid"], signal.SIGKILL)
    # the outcome, with a generous deadline (the latency: benchmarks/recovery_bench.py)
    with d.monitor() as m:
        wait_for(lambda: not (p := m.ps()).tenants and p.pool.granted == 0,
                 timeout=30, what="the dead tenant's pages back")
    ps = d.cli_json("ps")
    assert ps["tenants"] == [] and ps["pool"]["granted"] == 0
    assert ps["pool"]["dirty"] == 32 * PAGE, "maintenance held off: still the victim's"

    got = as_nobody(d, f"""
        import ctypes
        from kvpool.client_lib import connect
        with connect(name="next", run_dir=run_dir) as t:
            g = t.region_group(2, {16 * PAGE})
            g.grant(range(16))  # the whole budget: only by retiring the victim's pages
            nonzero = [i for i, r in enumerate(g.ranges)
                       if ctypes.string_at(r.base, {16 * PAGE}).count(0) != {16 * PAGE}]
        print(json.dumps({{"nonzero": nonzero, "ranges": len(g.ranges)}}), flush=True)
    """, timeout=60)
    assert got["ranges"] == 2 and got["nonzero"] == [], \
        f"a page still holds the dead tenant's data: {got}"
    s = d.stats()
    assert s.pool.created == 64  # each of next's pages made fresh in a retired one's room
    assert d.check() == []


def test_tensor_data_survives_reserve_churn(daemon):
    block = 16 << 10  # 4 blocks per 64 KiB unit
    with daemon.connect("torch") as t:
        g = t.region_group(2, 32 * PAGE)
        a = ElasticBlockAllocator(g, block, low=1, high=3, idle_timeout_s=0.3, tick_s=0.002)
        floats = block // 4
        k = g.tensor(0, torch.float32, (a.num_blocks, floats))
        v = g.tensor(1, torch.float32, (a.num_blocks, floats))
        kept: dict[int, float] = {}

        def fill(blocks):
            for b in blocks:
                val = float(b * 7 + 1)
                k[b].fill_(val)
                v[b].fill_(-val)
                kept[b] = val

        def verify():
            for b, val in kept.items():
                assert torch.all(k[b] == val) and torch.all(v[b] == -val), f"block {b} changed"

        first = a.alloc(3)  # slow path, unless the refill thread mapped a reserve first
        slow = a.slow_allocs
        assert slow <= 1
        fill(first)
        wait_for(lambda: a.reserve_chunks >= 1, 30.0, every=0.005,
                 what="the refill thread's reserve")
        more = a.alloc(4)  # fast path: the partial chunk, then a reserve chunk
        assert a.slow_allocs == slow
        fill(more)
        verify()
        # churn: the reserve grows and shrinks (grants and releases) around kept blocks
        for i in range(200):
            tmp = a.alloc(1 + i % 9)
            assert tmp is not None
            k[tmp[0]].fill_(123.0)
            a.free(tmp)
            if i % 50 == 0:
                verify()
        a.check_integrity()
        # idle: the reserve drains to nothing (after idle_timeout_s), by releases. The churn
        # mapped at least two chunks beyond the two that hold the kept blocks, and those are
        # released once idle; right after the churn the reserve may already read 0 (its
        # empty current chunk joins the reserve only when idle), so wait for both outcomes.
        wait_for(lambda: a.reserve_chunks == 0 and a.releases >= 1, 30.0, every=0.01,
                 what="the reserve drained by a release")
        verify()
        big = a.alloc(12)  # slow path again after the drain
        assert big is not None and a.slow_allocs > slow
        fill(big)
        verify()
        # another view of the same memory agrees
        raw = g.tensor(0, torch.uint8)
        b0 = first[0]
        assert torch.equal(raw[b0 * block : (b0 + 1) * block].view(torch.float32), k[b0])
        a.check_integrity()
        del k, v, raw


def test_map_shows_exactly_the_daemon_state(daemon):
    with daemon.connect("mapper") as t:
        g = t.region_group(3, 8 * PAGE, label="kv")
        g.grant([0, 1, 2, 5])
        g.set_usage(reserve=[2, 5])
        h = t.region_group(1, 4 * PAGE)
        h.grant([3])
        out = daemon.cli_json("map")
        pool = out["pool"]
        assert pool["granted"] == (4 * 3 + 1) * PAGE
        assert pool["budget"] == pool["granted"] + pool["warm"] + pool["dirty"] + pool["free"]
        tables = {x["id"]: x for x in out["groups"]}
        # the table, run-length encoded: [start, length, reserve] ("##+..+..")
        assert tables[g.id]["runs"] == [[0, 2, False], [2, 1, True], [5, 1, True]]
        assert tables[g.id]["n_regions"] == 3 and tables[g.id]["bases"] == g.bases
        assert tables[h.id]["runs"] == [[3, 1, False]]

        text = daemon.cli("map", "mapper").stdout
        assert "0 ██▒··▒··" in text and "0 ···█" in text
        assert "granted 832 KiB" in text  # 13 pages of 64 KiB

        detail = daemon.cli_json("map", "mapper", "--pfns")
        pfns = [p for x in detail["groups"] for unit in x["pfns"].values() for p in unit]
        assert len(pfns) == len(set(pfns)) == 13
        assert daemon.cli("map", "nobody", check=False).returncode != 0

        g.release([0, 5])
        out = daemon.cli_json("map")
        tables = {x["id"]: x for x in out["groups"]}
        assert tables[g.id]["runs"] == [[1, 1, False], [2, 1, True]]
        assert out["pool"]["granted"] == (2 * 3 + 1) * PAGE


def test_daemon_rss_and_fds_flat_over_10k_grant_release_cycles(daemon):
    proc = psutil.Process(daemon.pid)
    with daemon.connect("cycler") as t, daemon.monitor() as m:  # (no connection per look)
        g = t.region_group(2, 16 * PAGE)

        def cycles(n):
            for i in range(n):
                u = i % 16
                g.grant([u])
                g.release([u])

        def settled() -> int | None:
            """Once idle maintenance has retired every released page: the daemon's
            descriptors other than its pages' (one each; how many pages the warm pool
            holds at that moment varies)."""
            pool = m.stats().pool
            if pool.dirty:
                return None
            return proc.num_fds() - (pool.granted + pool.warm) // PAGE

        cycles(1000)
        fds0 = wait_for(settled, 30.0, what="released pages retired")
        rss0 = proc.memory_info().rss
        cycles(10_000)
        fds1 = wait_for(settled, 30.0, what="released pages retired")
        rss1 = proc.memory_info().rss
    assert fds1 == fds0, f"daemon's own fds grew from {fds0} to {fds1}"
    assert rss1 - rss0 < 2 << 20, f"daemon RSS grew by {(rss1 - rss0) >> 10} KiB"
    assert daemon.check() == []
