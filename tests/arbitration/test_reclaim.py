"""Issue 5 acceptance: arbitration between real tenant processes (host backend).

The contend and idle workers shrink through the project's own components: their blocks
are prefix cache in the bundled engine's ``BundledElasticPool``, whose ``ElasticPolicy``
shrink is the tenant's shrink callback (tests/arbitration/worker.py)."""

from __future__ import annotations

from daemon.helpers import PAGE, read_event

from .helpers import READY_S, mapped, spawn, wait_for


def test_shares_1_1_2_converge_to_25_25_50(start_daemon, tmp_path):
    """Three tenants that want everything: the daemon's own fair shares are 1:1:2 of the
    budget, and it gets each tenant to its share — waited for as an event (all three at
    their shares in one snapshot, generous deadline), not after a sleep, and checked
    against the daemon's ``fair_share``, not a ±10% time average."""
    budget = 96
    d = start_daemon(budget=str(budget * PAGE), extra=("--warm-max", "0"))
    stop = tmp_path / "stop"
    ws = {"a": 1, "b": 1, "c": 2}
    procs = {n: spawn(d, "contend", "--name", n, "--shares", str(w), "--seed", str(i),
                      "--seconds", "120", "--until-file", str(stop))
             for i, (n, w) in enumerate(ws.items())}
    for w in procs.values():
        read_event(w, "ready", READY_S)
    want = {"a": 24 * PAGE, "b": 24 * PAGE, "c": 48 * PAGE}
    slack = 4 * PAGE  # the contenders churn a block or two at a time around their share

    with d.monitor() as m:
        def at_shares():
            s = m.stats()
            assert s.pool.granted + s.pool.warm + s.pool.dirty <= budget * PAGE
            t = {x.name: x for x in s.tenants}
            if set(t) != set(ws):
                return None
            if any(abs(t[n].fair_share - want[n]) > PAGE for n in ws):
                return None  # the daemon's shares, before every tenant wants more
            return t if all(abs(t[n].mapped - want[n]) <= slack for n in ws) else None

        got = wait_for(at_shares, 90.0, every=0.01, what="each tenant at its 1:1:2 share")
    stop.touch()
    done = {n: read_event(w, "done") for n, w in procs.items()}
    print("mapped", {n: t.mapped // PAGE for n, t in got.items()}, "pages")
    assert sum(x["evictions"] for x in done.values()) > 0  # step (c) really ran
    assert d.check() == []


def test_min_is_never_reclaimed(start_daemon, tmp_path):
    """A heavy tenant reclaims what an idle one holds above its ``min`` and never more:
    every ps from the hog's start until the guarded tenant is down at its min, then
    while the hog makes 200 more requests, shows it at or above its min."""
    budget = 64
    d = start_daemon(budget=str(budget * PAGE), extra=("--warm-max", "0"))
    mn = 24 * PAGE
    guarded = spawn(d, "idle", "--name", "guarded", "--min", str(mn), "--blocks", "40")
    assert read_event(guarded, "ready", READY_S)["blocks"] == 40
    stop = tmp_path / "stop"
    hog = spawn(d, "contend", "--name", "hog", "--shares", "100", "--seconds", "120",
                "--until-file", str(stop))
    read_event(hog, "ready", READY_S)
    seen: list[int] = []
    with d.monitor() as m:
        def guarded_mapped() -> int:
            got = {t.name: t.mapped for t in m.ps().tenants}["guarded"]
            seen.append(got)
            return got

        wait_for(lambda: guarded_mapped() <= mn + 2 * PAGE, 60.0, every=0.01,
                 what="guarded reclaimed down to its min")
        goal = m.stats().requests + 200  # the hog keeps pushing meanwhile
        wait_for(lambda: guarded_mapped() is not None and m.stats().requests >= goal, 60.0,
                 every=0.01, what="200 more requests")
    stop.touch()
    read_event(hog, "done")
    assert min(seen) >= mn, (min(seen), mn)  # never below its min...
    assert seen[-1] < 40 * PAGE  # ...while what was above it was reclaimed
    assert d.check() == []


def test_lowering_an_idle_tenants_max_frees_memory(start_daemon):
    d = start_daemon(budget=str(64 * PAGE))
    w = spawn(d, "idle", "--name", "sleepy", "--blocks", "32")
    assert read_event(w, "ready", READY_S)["blocks"] == 32
    assert mapped(d)["sleepy"] >= 32 * PAGE
    out = d.cli_json("limit", "sleepy", str(8 * PAGE))
    assert out["max"] == 8 * PAGE and out["applied"] is False and out["pending"] > 0
    # the outcome, with a generous deadline (the latency: benchmarks/recovery_bench.py)
    wait_for(lambda: mapped(d)["sleepy"] <= 8 * PAGE, 20.0, what="sleepy below its new max")
    out = d.cli_json("limit", "sleepy", str(8 * PAGE))
    assert out["applied"] is True and out["pending"] == 0
    assert d.check() == []


def test_idle_tenant_holds_at_most_one_unit_after_its_idle_timeout(daemon):
    from kvpool.client_lib import ElasticBlockAllocator

    with daemon.connect("idler") as t:
        g = t.region_group(2, 32 * PAGE)
        a = ElasticBlockAllocator(g, 16 << 10, low=2, high=6, idle_timeout_s=0.3)
        blocks = a.alloc(20)
        a.free(blocks[1:])  # one block stays in use
        unit = g.unit_bytes
        wait_for(lambda: daemon.stats().tenants[0].mapped <= unit, 3.0,
                 what="idle footprint of one unit")
        h = a.holdings()
        assert h.mapped_chunks == 1 and h.in_use == 2 * (16 << 10) and h.reserve == 0
        a.free(blocks[:1])
        wait_for(lambda: daemon.stats().tenants[0].mapped == 0, 3.0, what="nothing held")
