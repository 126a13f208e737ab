"""One daemon, several devices (``--devices N`` on host: N independent pools) and gangs:
tensor-parallel tenants whose grants are all or none (issue 26; docs/ARCHITECTURE.md,
"Devices" and "Gangs").

Ranks here are in-process sessions (their own connections) driven from threads, since
a collective call returns only when every rank sent its part; the deaths use real
processes (``gang_harness``)."""

from __future__ import annotations

import json
import os
import threading

import pytest

from kvpool import protocol as p
from kvpool.client_lib import Monitor
from kvpool.client_lib.errors import KvpoolError, NoMemory

from .gang_harness import Ranks, gang_tables, invariant_problems
from .helpers import PAGE
from .test_attacks_round3 import as_nobody, group_daemon, needs_root

BUDGET = 16  # pages per device
LAYOUT = [(2, 8 * PAGE)]  # one group, 2 regions: a unit is 2 pages on every device


def together(*calls):
    """Run each call on its own thread (a collective needs every rank's part); the
    results, an exception standing for a call that raised."""
    out: list = [None] * len(calls)

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # (the test looks at it)
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return out


def two_devices(start_daemon, *extra: str):
    return start_daemon(budget=str(BUDGET * PAGE), extra=("--devices", "2", *extra))


def make_gang(d, name="tp", devices=(0, 1), **kw):
    r0 = d.connect(name, device=devices[0], **kw)
    token = r0.create_gang(list(devices), LAYOUT)
    r1 = d.connect(name, device=devices[1], gang=token, rank=1, layout=LAYOUT, **kw)
    return token, r0, r1, r0.region_group(*LAYOUT[0]), r1.region_group(*LAYOUT[0])


def test_devices_are_independent_pools(start_daemon):
    d = two_devices(start_daemon)
    with d.connect("a", device=0) as a, d.connect("b", device=1) as b, \
            Monitor(d.run_dir, device=0) as m0, Monitor(d.run_dir, device=1) as m1:
        a.region_group(1, BUDGET * PAGE).grant(range(BUDGET))  # all of device 0
        b.region_group(1, BUDGET * PAGE).grant(range(BUDGET))  # and all of device 1
        for dev, mon, name in ((0, m0, "a"), (1, m1, "b")):
            ps = mon.ps()
            assert ps.pool is not None and ps.pool.device == dev
            assert ps.pool.granted == ps.pool.budget == BUDGET * PAGE
            assert [(t.name, t.device) for t in ps.tenants] == [(name, dev)]
            assert mon.check() == []
        with d.connect("a2", device=0) as a2, pytest.raises(NoMemory):
            a2.region_group(1, PAGE).grant([0], speculative=True)  # device 0 is full
        with pytest.raises(KvpoolError, match="device 2 is not served .*devices 0, 1"):
            d.connect("c", device=2)


def test_a_gang_grant_is_all_or_none(start_daemon):
    d = two_devices(start_daemon)
    _, r0, r1, g0, g1 = make_gang(d)
    with r0, r1, d.connect("solo", device=1) as solo, \
            Monitor(d.run_dir, device=0) as m0, Monitor(d.run_dir, device=1) as m1:
        mons = {0: m0, 1: m1}
        sg = solo.region_group(1, BUDGET * PAGE)
        sg.grant(range(12))  # device 1 keeps 4 pages: 2 gang units, device 0 all 16
        a, b = together(lambda: g0.grant([0, 1, 2]), lambda: g1.grant([0, 1, 2]))
        assert isinstance(a, NoMemory) and isinstance(b, NoMemory), (a, b)
        assert str(a) == str(b) and "device 1" in str(a)  # one answer for every rank
        assert not g0.mapped and not g1.mapped
        assert m0.ps().pool.granted == 0 and invariant_problems(mons, 2) == []
        a, b = together(lambda: g0.grant([0, 1]), lambda: g1.grant([0, 1]))  # fits both
        assert (a, b) == (None, None)
        assert g0.mapped == g1.mapped == {0, 1}
        tables = gang_tables(mons)
        assert list(tables.values()) == [{0: {0, 1}, 1: {0, 1}}]
        assert m0.ps().pool.granted == m1.ps().pool.granted - 12 * PAGE == 4 * PAGE
        sg.release(range(12))
        a, b = together(lambda: g0.release([0]), lambda: g1.release([0]))
        assert (a, b) == (None, None)
        assert m0.ps().pool.granted == m1.ps().pool.granted == 2 * PAGE
        assert invariant_problems(mons, 2) == []


def shrinker(g):
    """A shrink callback releasing ``g``'s highest units (what the ask asks for)."""
    def shrink(nbytes, urgent):
        mapped = sorted(g.mapped)
        k = min(len(mapped), -(-nbytes // g.unit_bytes))
        if k:
            g.release(mapped[-k:])
    return shrink


def asks_to(mon, name):
    return [e for e in mon.call(p.Events(), p.EventsReply).events
            if e.kind == "ask" and e.tenant == name]


def grow_until_full(g):
    """A single tenant grows one unit at a time until its device refuses it."""
    for u in range(g.npages):
        try:
            g.grant([u])
        except NoMemory:
            return


def test_a_gang_grant_waits_while_a_growing_tenant_is_asked_to_shrink(start_daemon):
    """Issue 33 item 7: a single tenant grows until device 1 is full; the gang's grant
    waits (it does not fit on device 1), the single tenant is asked to shrink to its
    fair share, gives back, and the gang gets its pages on both devices at once."""
    d = two_devices(start_daemon, "--reclaim-timeout", "60")  # the outcome never waits on it
    _, r0, r1, g0, g1 = make_gang(d, timeout_s=120)  # (the ranks' calls neither)
    with r0, r1, d.connect("solo", device=1) as solo, \
            Monitor(d.run_dir, device=0) as m0, Monitor(d.run_dir, device=1) as m1:
        sg = solo.region_group(1, BUDGET * PAGE)
        solo.set_shrink_callback(shrinker(sg))
        grow_until_full(sg)
        assert len(sg.mapped) == BUDGET and m1.ps().pool.granted == BUDGET * PAGE
        a, b = together(lambda: g0.grant(range(4)), lambda: g1.grant(range(4)))
        assert (a, b) == (None, None), (a, b)
        assert g0.mapped == g1.mapped == {0, 1, 2, 3}
        # (the callback releases what each call names: the library calls it until the
        # ask is met, so it may give back more than its pages above its share)
        assert len(sg.mapped) <= BUDGET - 8
        asks = asks_to(m1, "solo")
        assert asks and all(e.detail.get("mode") == "shrink" for e in asks), asks
        assert not asks_to(m0, "tp") and not asks_to(m1, "tp")  # the waiter is not asked
        ps0, ps1 = m0.ps(), m1.ps()
        assert ps0.pool.granted == 8 * PAGE
        assert [(x.name, x.mapped) for x in ps1.tenants if x.name == "tp"] == [("tp", 8 * PAGE)]
        assert invariant_problems({0: m0, 1: m1}, 2) == []


def test_a_gang_grant_not_freed_by_its_deadline_takes_nothing(start_daemon):
    """Issue 33 item 7: the single tenant ignores the ask; at the deadline every rank
    gets the same NO_MEMORY naming the device, and no device holds a page for the gang
    (the pages set aside on device 0 while it waited were never taken)."""
    d = two_devices(start_daemon, "--reclaim-timeout", "3")
    _, r0, r1, g0, g1 = make_gang(d)
    with r0, r1, d.connect("solo", device=1) as solo, \
            Monitor(d.run_dir, device=0) as m0, Monitor(d.run_dir, device=1) as m1:
        sg = solo.region_group(1, BUDGET * PAGE)  # (no shrink callback: it gives nothing)
        grow_until_full(sg)
        a, b = together(lambda: g0.grant(range(4)), lambda: g1.grant(range(4)))
        assert isinstance(a, NoMemory) and isinstance(b, NoMemory), (a, b)
        assert str(a) == str(b) and "device 1" in str(a) and "not freed" in str(a), a
        assert asks_to(m1, "solo")  # it was asked (and did not give back)
        assert not g0.mapped and not g1.mapped
        assert m0.ps().pool.granted == 0 and m1.ps().pool.granted == BUDGET * PAGE
        assert invariant_problems({0: m0, 1: m1}, 2) == []
        sg.release(range(8))  # room again: the gang goes on
        a, b = together(lambda: g0.grant([0, 1]), lambda: g1.grant([0, 1]))
        assert (a, b) == (None, None) and g0.mapped == g1.mapped == {0, 1}
        assert invariant_problems({0: m0, 1: m1}, 2) == []


def test_a_rank_missing_its_part_is_rolled_back_by_the_deadline(start_daemon):
    d = two_devices(start_daemon, "--reclaim-timeout", "0.3")
    _, r0, r1, g0, g1 = make_gang(d)
    with r0, r1, Monitor(d.run_dir, device=0) as m0, Monitor(d.run_dir, device=1) as m1:
        with pytest.raises(NoMemory, match="rank.* 1 did not send their part of this grant"):
            g0.grant([0, 1])  # rank 1 never answers
        assert m0.ps().pool.granted == m1.ps().pool.granted == 0
        a, b = together(lambda: g0.grant([3]), lambda: g1.grant([3]))  # the gang goes on
        assert (a, b) == (None, None) and g0.mapped == g1.mapped == {3}
        assert invariant_problems({0: m0, 1: m1}, 2) == []


def test_a_rank_killed_ends_the_gang_and_every_page_returns(start_daemon, tmp_path):
    d = two_devices(start_daemon)
    ranks = Ranks(d.run_dir, tmp_path)
    gang = ranks.gang("tp", [0, 1], LAYOUT)
    try:
        with Monitor(d.run_dir, device=0) as m0, Monitor(d.run_dir, device=1) as m1:
            assert [r["ok"] for r in gang.collective({"op": "grant", "units": [0, 1, 2]})] \
                == [True, True]
            assert m0.ps().pool.granted == m1.ps().pool.granted == 6 * PAGE
            gang.ranks[1].kill()
            ended = gang.ranks[0].call({"op": "ended", "timeout": 30})["ended"]
            assert ended and "rank 1" in ended
            assert m0.ps().pool.granted == m1.ps().pool.granted == 0  # on every device
            late = gang.ranks[0].call({"op": "grant", "units": [5]})
            assert not late["ok"] and "ended" in late["msg"], late
            assert invariant_problems({0: m0, 1: m1}, 2) == []
    finally:
        gang.ranks[0].close()
        ranks.close()


def test_joins_that_are_refused_hold_nothing(start_daemon):
    d = two_devices(start_daemon)
    token, r0, r1, g0, g1 = make_gang(d, "tp")
    lone = d.connect("tq", device=0)  # a gang whose rank 1 has not joined yet
    open_token = lone.create_gang([0, 1], LAYOUT)
    with r0, r1, lone:
        forged = "0" * 32 if "0" * 32 not in (token, open_token) else "1" * 32
        cases = [
            (dict(gang=forged, rank=1, layout=LAYOUT, device=1), "unknown gang token"),
            (dict(gang=token, rank=1, layout=LAYOUT, device=1, name="tp"), "has joined already"),
            (dict(gang=open_token, rank=2, layout=LAYOUT, device=1), "outside gang"),
            (dict(gang=open_token, rank=1, layout=[(3, 8 * PAGE)], device=1), "differs from"),
            (dict(gang=open_token, rank=1, layout=LAYOUT, device=0), "lives on device 1"),
            (dict(gang=open_token, rank=1, layout=LAYOUT, device=1, name="other"),
             "register as"),
            (dict(gang=open_token, rank=1, device=1), "come together"),
        ]
        for kw, why in cases:
            name = kw.pop("name", "tq")
            with pytest.raises(KvpoolError, match=why) as e:
                d.connect(name, **kw)
            assert "\n" not in str(e.value)
        with Monitor(d.run_dir, device=1) as m1:  # none of them holds or joined anything
            assert [(t.name, t.gang, t.rank) for t in m1.ps().tenants
                    if t.registered] == [("tp", 1, 1)]
        with pytest.raises(KvpoolError, match="layout has 1 groups"):
            r1.region_group(1, 8 * PAGE)  # not the layout's group
        for req, why in ((p.Lease(bytes=PAGE), "rank of a gang may not lease"),
                         (p.DestroyGroup(group=g0.id), "may not destroy"),
                         (p.CreateGang(devices=[0, 1], layout=[p.GangGroup(
                             n_regions=1, capacity=PAGE)]), "already")):
            with pytest.raises(KvpoolError, match=why):
                r0.call(req, p.Done)
        with d.connect("solo", device=1) as solo:  # creating: devices the daemon serves
            for devices, why in (([1, 0, 0], "named twice"), ([0, 1], "devices\\[0\\]"),
                                 ([1, 5], "device 5 is not served")):
                with pytest.raises(KvpoolError, match=why):
                    solo.create_gang(devices, LAYOUT)
        assert d.check() == []


@needs_root
def test_another_uid_may_not_join(start_daemon, tmp_path):
    d = group_daemon(start_daemon, tmp_path, extra=("--devices", "2", "--budget",
                                                    str(BUDGET * PAGE)))
    with d.connect("tp", device=0) as r0:
        token = r0.create_gang([0, 1], LAYOUT)
        got = as_nobody(d, f"""
            from kvpool.client_lib import connect
            from kvpool.client_lib.errors import KvpoolError
            try:
                connect("tp", device=1, run_dir=run_dir, gang={token!r}, rank=1,
                        layout={LAYOUT!r})
                print(json.dumps({{"joined": True}}))
            except KvpoolError as e:
                print(json.dumps({{"code": e.code, "message": e.message}}))
        """)
        assert got["code"] == p.UNAUTHORIZED and "belongs to uid" in got["message"], got
        with Monitor(d.run_dir, device=1) as m1:
            assert [t.name for t in m1.ps().tenants if t.registered] == []  # nobody joined


def test_the_cli_reads_the_device_it_is_given(start_daemon):
    d = two_devices(start_daemon)
    with d.connect("one", device=1) as t:
        t.region_group(1, 4 * PAGE).grant([0, 1])
        ps1 = d.cli_json("ps", "--device", "1")
        assert [x["name"] for x in ps1["tenants"]] == ["one"]
        assert ps1["pool"]["device"] == 1 and ps1["pool"]["granted"] == 2 * PAGE
        ps0 = d.cli_json("ps", "--device", "0")
        assert ps0["tenants"] == [] and ps0["pool"]["device"] == 0
        every = d.cli_json("ps")  # every device by default (issue 34 item 4)
        assert [x["name"] for x in every["tenants"]] == ["one"]
        assert [x["device"] for x in every["pools"]] == [0, 1]
        assert d.cli("check", "--device", "1").stdout.strip() == "ok"
        assert "one" in d.cli("map", "--device", "1").stdout


def test_metrics_carry_every_device(start_daemon):
    """One exporter, every device's samples (``device`` label), each family once."""
    import socket
    import urllib.request

    with socket.socket() as sock:  # a free port (the daemon binds it at once)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    d = two_devices(start_daemon, "--metrics-address", f"127.0.0.1:{port}")
    with d.connect("one", device=1) as t:
        t.region_group(1, 4 * PAGE).grant([0, 1])
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    lines = text.decode().splitlines()
    granted = [ln for ln in lines if ln.startswith("kvpool_pool_granted_bytes{")]
    assert sorted(granted) == [f'kvpool_pool_granted_bytes{{device="0"}} 0.0',
                               f'kvpool_pool_granted_bytes{{device="1"}} {2.0 * PAGE}'], granted
    helps = [ln for ln in lines if ln.startswith("# HELP ")]
    assert len(helps) == len(set(helps))  # each family once


def test_a_restart_recovers_the_tenants_of_every_device(start_daemon):
    """kill -9 of a two-device daemon: the next one waits for the tenants of both
    devices, each adopts its pages on its own device."""
    from .policy_helpers import restart

    d = two_devices(start_daemon)
    with d.connect("zero", device=0) as t0, d.connect("one", device=1) as t1:
        t0.region_group(1, 4 * PAGE).grant([0])
        t1.region_group(1, 4 * PAGE).grant([0, 1, 2])
        saved = d.run_dir / "state.json"
        for _ in range(600):  # the state names both devices' groups (saved by the loop)
            try:
                if json.loads(saved.read_text()).get("next_groups") == {"0": 2, "1": 2}:
                    break
            except (OSError, ValueError):
                pass
            threading.Event().wait(0.05)
        restart(d, os.getpid(), next_group=2)
        with Monitor(d.run_dir, device=0) as m0, Monitor(d.run_dir, device=1) as m1:
            for _ in range(600):  # until both tenants have adopted (the keepers reconnect)
                if t0.reconnects and t1.reconnects:
                    break
                threading.Event().wait(0.05)
            assert t0.reconnects == t1.reconnects == 1
            assert m0.ps().pool.granted == PAGE and m1.ps().pool.granted == 3 * PAGE
            assert [x.name for x in m1.ps().tenants] == ["one"]
            assert m0.check() == [] and m1.check() == []


def test_a_lease_reclaims_a_gang_as_one_with_one_ask_per_rank(start_daemon):
    """A lease on device 0 needs the gang's pages there: rank 0 is asked, the ask is
    mirrored once to rank 1, their collective release returns both devices' pages."""
    d = two_devices(start_daemon)
    _, r0, r1, g0, g1 = make_gang(d)

    def shrinker(g):
        def shrink(nbytes, urgent):
            mapped = sorted(g.mapped)
            k = min(len(mapped), -(-nbytes // g.unit_bytes))
            if k:
                g.release(mapped[-k:])
        return shrink

    r0.set_shrink_callback(shrinker(g0))
    r1.set_shrink_callback(shrinker(g1))
    with r0, r1, d.connect("trainer", device=0, kind="lease") as lt, \
            Monitor(d.run_dir, device=0) as m0, Monitor(d.run_dir, device=1) as m1:
        assert together(lambda: g0.grant(range(8)), lambda: g1.grant(range(8))) == [None] * 2
        lease = lt.lease(BUDGET * PAGE)  # all of device 0: the gang gives back everything
        assert not g0.mapped and not g1.mapped
        assert m0.ps().pool.leased == BUDGET * PAGE and m1.ps().pool.granted == 0
        lease.close()
        evs = m0.call(p.Events(), p.EventsReply).events  # (one log: every device's)
        for dev in (0, 1):
            asks = [e for e in evs if e.kind == "ask" and e.device == dev]
            assert len(asks) == 1 and asks[0].tenant == "tp", asks  # mirrored once, no echo
        assert invariant_problems({0: m0, 1: m1}, 2) == []
