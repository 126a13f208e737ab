"""Sleep and wake, daemon side (issue 22, point 4; kvpool.daemon.sleepers).

Arbiter-level (no daemon process, explicit clocks): whom the daemon puts to sleep when
a waiting grant misses pages (one idle sleepable tenant, longest idle then fewest
shares; never the asker, a busy, a non-sleepable or an already-asked one), a refusal
(the grant ends NO_MEMORY at its deadline and nothing stalls), who may ask (own uid or
admin), states forgotten with the session. Real daemon: the operator's `kvpool sleep` /
`kvpool wake` reach the tenant's handler and ps shows asleep then not; a daemon-initiated
sleep lets a needy grant through where without `sleepable` it gets NO_MEMORY; another
uid's `kvpool sleep` is refused; a flood of state changes is answered and harmless.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvpool import protocol as p
from kvpool.client_lib import KvpoolError
from kvpool.daemon.config import Config

from kvpool.demo.cluster import free_port

from .helpers import PAGE, respawn, stop_daemon, wait_for
from .rawpeer import RawPeer
from .test_attacks_round3 import as_nobody, group_daemon, needs_root
from observability.helpers import scrape, value

BUDGET = 16  # pages (make_arb's pool)


def config(**tenants) -> Config:
    """make_arb's budget; deadlines and the short-answer backoff long enough that no
    test depends on how fast the machine runs them (expiry is ticked with a late clock)."""
    return Config.from_dict({"budget": BUDGET * PAGE, "reclaim_timeout_s": 30.0,
                             "short_backoff_s": 30.0, "tenants": tenants})


LATE = 1000.0  # seconds past every deadline above


# ---- arbiter level ----------------------------------------------------------------------
class Arb:
    """Sessions on an arbiter from ``make_arb``: ``join(name, pages, ...)`` registers a
    tenant (uid ``uid``), gives it a 16-page group and ``pages`` of it, and says ``state``."""

    def __init__(self, arb):
        self.arb = arb
        self.idents: dict[int, bytes] = {}
        self.groups: dict[int, int] = {}

    def session(self, name: str, uid: int = 0, kind: str = "engine",
                sleepable: bool | None = None):
        x, y = socket.socketpair()
        self.arb.socks.extend((x, y))
        t = self.arb.open_session(x, 1000 + len(self.arb.socks), uid, uid, None)
        ident = f"{name}-{t.id}".encode()
        out = self.arb.handle(ident, p.Register(id=1, token=t.token, name=name, kind=kind,
                                                sleepable=sleepable))
        assert out.reply.ok, out.reply
        self.idents[t.id] = ident
        return t

    def join(self, name: str, pages: int = 0, state: str | None = None,
             sleepable: bool | None = True, uid: int = 0):
        t = self.session(name, uid, sleepable=sleepable)
        self.groups[t.id] = self.call(t, p.CreateGroup(n_regions=1, capacity=BUDGET * PAGE)
                                      ).reply.group
        if pages:
            assert self.grant(t, range(pages)).reply.ok
        if state:
            self.say(t, state)
        return t

    def call(self, t, req: p.Request):
        req.token = t.token
        return self.arb.handle(self.idents[t.id], req, [self.idents[t.id]])

    def grant(self, t, units):
        return self.call(t, p.Grant(id=3, group=self.groups[t.id], units=list(units)))

    def release(self, t, units):
        return self.call(t, p.Release(id=4, group=self.groups[t.id], units=list(units)))

    def say(self, t, state: str):
        out = self.call(t, p.TenantState(id=5, state=state))
        assert out.reply.ok, out.reply

    def outbox(self) -> list[tuple[bytes, p.Reply]]:
        return self.arb.take_outbox()

    def sleep_asks(self) -> dict[bytes, p.SleepAsk]:
        return {i: m for i, m in self.outbox() if isinstance(m, p.SleepAsk)}

    def answer_reclaims(self, sent: list[tuple[bytes, p.Reply]]) -> None:
        """Every tenant asked to give back answers at once, having freed nothing."""
        by_ident = {v: k for k, v in self.idents.items()}
        for ident, m in sent:
            if isinstance(m, p.Reclaim):
                t = self.arb.tenants.by_id[by_ident[ident]]
                assert self.call(t, p.Reclaimed(id=6, seq=m.seq)).reply.ok


def needy_round(a: Arb, y, n: int = 8, first: int = 0):
    """``y`` asks for ``n`` pages from unit ``first`` on (it waits); every asked tenant
    answers having freed nothing; returns (the grant's outcome, the sleep asks sent, by
    identity)."""
    out = a.grant(y, range(first, first + n))
    assert out.deferred, out.reply
    asks: dict[bytes, p.SleepAsk] = {}
    for _ in range(10):  # until nobody is asked for KV any more
        a.arb.tick()  # (the server ticks after every request)
        sent = a.outbox()
        asks.update({i: m for i, m in sent if isinstance(m, p.SleepAsk)})
        if not any(isinstance(m, p.Reclaim) for _, m in sent):
            break
        a.answer_reclaims(sent)
    return out, asks


def test_pressure_asks_one_idle_sleepable_tenant_and_the_grant_goes_through(make_arb):
    a = Arb(make_arb(config()))
    x = a.join("x", 10, "idle")
    y = a.join("y", state="busy")
    out, asks = needy_round(a, y)
    assert list(asks) == [a.idents[x.id]]
    ask = asks[a.idents[x.id]]
    assert not ask.wake and ask.reason == "pressure"
    a.release(x, range(10))  # its handler released everything
    a.say(x, "asleep")
    done = a.arb.tick()
    assert [o.reply.ok for o in done] == [True] and isinstance(done[0].reply, p.Granted)
    assert a.arb.views.tenant_info(x).state == "asleep"


def test_without_sleepable_the_grant_ends_no_memory(make_arb):
    a = Arb(make_arb(config()))
    a.join("x", 10, "idle", sleepable=False)
    y = a.join("y", state="busy")
    out, asks = needy_round(a, y)
    assert asks == {}
    done = a.arb.tick(time.monotonic() + LATE)  # past its deadline
    assert [o.reply.code for o in done] == [p.NO_MEMORY]


@pytest.mark.parametrize("sleepable", [True, False])
def test_a_grant_past_its_fair_share_waits_for_a_sleep_that_covers_it(make_arb, sleepable):
    """x (idle) holds 10 of 16 pages; y asks for 12, past its fair share (8): refused at
    once unless x may be put to sleep, which then frees enough: y waits and is served."""
    a = Arb(make_arb(config()))
    x = a.join("x", 10, "idle", sleepable=sleepable)
    y = a.join("y", state="busy")
    if not sleepable:
        assert a.grant(y, range(12)).reply.code == p.NO_MEMORY
        return
    out, asks = needy_round(a, y, 12)
    assert list(asks) == [a.idents[x.id]]
    a.release(x, range(10))
    a.say(x, "asleep")
    assert [isinstance(o.reply, p.Granted) for o in a.arb.tick()] == [True]


@pytest.mark.parametrize("case", ["busy", "awake", "asker", "empty", "not_sleepable"])
def test_who_is_never_asked(make_arb, case):
    """A busy tenant, one that never said its state, one that holds nothing, one that
    did not opt in (by Register or by config) and the asker itself are never asked."""
    a = Arb(make_arb(config(x={"sleepable": False}) if case == "not_sleepable"
                     else config()))
    state = {"busy": "busy", "awake": None}.get(case, "idle")
    x = a.join("x", 0 if case == "empty" else 10, state)  # asks to be sleepable
    if case == "empty":  # the memory is a busy tenant's
        a.join("f", 10, "busy", sleepable=False)
    if case == "asker":  # the needy one is itself idle and sleepable; x is not
        a.say(x, "busy")
        y = a.join("y", 2, "idle")
    else:
        y = a.join("y", state="busy")
    out, asks = needy_round(a, y, 6 if case == "asker" else 8, 2 if case == "asker" else 0)
    assert asks == {}, case
    assert a.arb.views.tenant_info(x).sleepable == (case != "not_sleepable")


def test_longest_idle_then_fewest_shares_and_only_one_at_a_time(make_arb):
    a = Arb(make_arb(config(heavy={"shares": 3.0}, light={"shares": 1.0},
                            late={"shares": 0.5}, y={"shares": 100.0})))
    heavy = a.join("heavy", 4, "idle")
    light = a.join("light", 4, "idle")
    late = a.join("late", 4, "idle")
    rec = a.arb.sleep.records
    rec[heavy.id].idle_since = rec[light.id].idle_since = 5.0  # idle as long as each other
    rec[late.id].idle_since = 7.0  # idle for less time, fewest shares
    y = a.join("y", state="busy")
    out, asks = needy_round(a, y, 8)
    assert list(asks) == [a.idents[light.id]], asks
    a.arb.tick()  # still short: the pending ask is not repeated, nobody else is asked
    assert a.sleep_asks() == {}
    a.say(light, "idle")  # it refused: the next one is asked
    a.arb.tick()
    assert list(a.sleep_asks()) == [a.idents[heavy.id]]
    a.arb.tick()
    assert a.sleep_asks() == {}


def test_a_refusal_ends_the_grant_no_memory_at_its_deadline_without_stalling(make_arb):
    a = Arb(make_arb(config()))
    x = a.join("x", 10, "idle")
    y = a.join("y", state="busy")
    out, asks = needy_round(a, y)
    assert list(asks) == [a.idents[x.id]]
    a.say(x, "idle")  # refused (its handler returned False)
    for _ in range(3):  # not asked again while the grant waits
        a.arb.tick()
        assert a.sleep_asks() == {}
    done = a.arb.tick(time.monotonic() + LATE)
    assert [o.reply.code for o in done] == [p.NO_MEMORY]
    z = a.join("z", state="busy")  # nothing stalls: what fits is granted at once
    assert a.grant(z, range(6)).reply.ok


def test_an_unanswered_pressure_ask_is_given_up(make_arb):
    a = Arb(make_arb(config()))
    x = a.join("x", 10, "idle")
    y = a.join("y", state="busy")
    needy_round(a, y)
    book = a.arb.sleep
    assert book.pending
    later = time.monotonic() + 2 * book.patience_s
    assert book.put_one_to_sleep(set(), 8, later) is None  # x was given up, not asked again
    assert not book.pending and book.records[x.id].not_before > later


def test_sleep_of_another_uids_tenant_is_refused_unless_admin(make_arb):
    a = Arb(make_arb())
    a.join("srv", 2, "idle", uid=1000)
    for uid, admin, ok in ((1000, False, True), (2000, False, False), (2000, True, True)):
        mon = a.session("monitor", uid=uid, kind="monitor")
        mon.admin = admin
        for wake in (False, True):
            out = a.call(mon, p.SleepTenant(id=9, name="srv", wake=wake))
            if ok:
                assert isinstance(out.reply, p.SleepAsked) and out.reply.tenants == 1
                (m,) = a.sleep_asks().values()
                assert m.wake == wake and m.reason == "operator"
            else:
                assert out.reply.code == p.UNAUTHORIZED and "uid 1000" in out.reply.message
                assert a.sleep_asks() == {}
    out = a.call(mon, p.SleepTenant(id=9, name="ghost"))
    assert isinstance(out.reply, p.SleepAsked) and out.reply.tenants == 0


def test_states_are_a_tenants_own_and_forgotten_with_its_session(make_arb):
    a = Arb(make_arb())
    x = a.join("x", 2, "idle")
    mon = a.session("monitor", kind="monitor")
    assert a.call(mon, p.TenantState(id=5, state="idle")).reply.code == p.UNAUTHORIZED
    assert x.id in a.arb.sleep.records
    a.arb.drop(x, "test")
    assert x.id not in a.arb.sleep.records


# ---- real daemon ------------------------------------------------------------------------
class Releaser:
    """A sleep handler that releases every unit of ``group`` (or refuses)."""

    def __init__(self, group, refuse: bool = False):
        self.group = group
        self.refuse = refuse
        self.calls: list[tuple[str, str]] = []
        self.done = threading.Event()

    def sleep(self, reason: str) -> bool:
        self.calls.append(("sleep", reason))
        if not self.refuse:
            self.group.release(sorted(self.group.mapped))
        self.done.set()
        return not self.refuse

    def wake(self, reason: str) -> bool:
        self.calls.append(("wake", reason))
        self.done.set()
        return True


def states(d, name: str) -> list[tuple[str, int]]:
    with d.monitor() as m:
        return [(t.state, t.mapped) for t in m.ps().tenants if t.name == name]


def unresponsive(d, name: str) -> list[bool]:
    with d.monitor() as m:
        return [t.unresponsive for t in m.ps().tenants if t.name == name]


def test_operator_sleep_and_wake_reach_the_handler_and_ps_shows_them(start_daemon):
    port = free_port()
    daemon = start_daemon(extra=("--metrics-address", f"127.0.0.1:{port}"))
    with daemon.connect("srv", timeout_s=30) as srv:
        g = srv.region_group(1, 8 * PAGE)
        g.grant(range(4))
        handler = Releaser(g)
        srv.set_sleep_handler(handler)
        srv.report_state("idle")
        assert states(daemon, "srv") == [("idle", 4 * PAGE)]
        out = daemon.cli("sleep", "srv", "--wait", "60")
        assert out.stdout.strip() == "srv: asleep", out
        assert handler.calls == [("sleep", "operator")]
        assert states(daemon, "srv") == [("asleep", 0)]  # asleep, holding nothing
        shown = daemon.cli_json("ps")["tenants"]
        assert [(t["state"], t["sleepable"]) for t in shown] == [("asleep", False)]
        assert wait_for(lambda: value(scrape(port), "kvpool_tenant_asleep", tenant="srv"),
                        what="the asleep gauge") == 1
        out = daemon.cli("wake", "srv", "--wait", "60")
        assert out.stdout.strip() == "srv: awake", out
        assert handler.calls[-1] == ("wake", "operator")
        assert states(daemon, "srv") == [("idle", 0)]
        out = daemon.cli("wake", "ghost", "--wait", "1", check=False)  # unknown tenant
        assert out.returncode != 0 and "no tenant named ghost" in out.stderr, out
        assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1
        srv.set_sleep_handler(None)  # nobody handles it: the wait expires, one line
        out = daemon.cli("sleep", "srv", "--wait", "0.3", check=False)
        assert out.returncode != 0 and "not asleep after 0.3 s" in out.stderr, out
        assert len(out.stderr.splitlines()) == 1
    assert daemon.check() == []


@pytest.mark.parametrize("sleepable", [True, False])
def test_daemon_puts_an_idle_sleepable_tenant_to_sleep_for_a_needy_grant(start_daemon,
                                                                         sleepable):
    """16 pages; x (idle) holds 12 and frees them only in its sleep handler; y asks for
    8, within its fair share. x answers the shrink having freed nothing: sleepable, it
    is put to sleep and y's grant goes through; otherwise y gets NO_MEMORY."""
    timeout = "30" if sleepable else "1"  # (an outcome; the refusal waits it out)
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--reclaim-timeout", timeout,
                                                      "--warm-max", "0"))
    with d.connect("x", timeout_s=60, sleepable=sleepable) as x, \
            d.connect("y", timeout_s=60) as y:
        gx = x.region_group(1, BUDGET * PAGE)
        gx.grant(range(12))
        handler = Releaser(gx)
        x.set_sleep_handler(handler)
        x.report_state("idle")
        y.report_state("busy")
        gy = y.region_group(1, BUDGET * PAGE)
        if sleepable:
            gy.grant(range(8))
            assert handler.calls == [("sleep", "pressure")]
            assert wait_for(lambda: states(d, "x") == [("asleep", 0)], what="x asleep")
            assert gy.mapped == set(range(8))
        else:
            with pytest.raises(KvpoolError) as e:
                gy.grant(range(8))
            assert e.value.code == p.NO_MEMORY
            assert handler.calls == [] and states(d, "x") == [("idle", 12 * PAGE)]
    assert d.check() == []


class Detacher:
    """A sleep handler that lets go of a weight set (and refuses to wake: not needed)."""

    def __init__(self, ws):
        self.ws = ws
        self.calls: list[str] = []

    def sleep(self, reason: str) -> bool:
        self.calls.append(reason)
        self.ws.detach()
        return True

    def wake(self, reason: str) -> bool:
        return False


def test_a_sleeping_tenants_weight_set_is_evicted_for_a_needy_grant(start_daemon):
    """x (idle, sleepable) holds a 10-page weight set of a 16-page pool, so y's fair
    share of the rest is 6 pages; y asks for 8 KV pages: x is put to sleep, detaches,
    the set (cached, held by nobody) is evicted and y's grant goes through."""
    from kvpool.client_lib.weights import WeightSet

    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--reclaim-timeout", "30",
                                                      "--warm-max", "0"))
    with d.connect("x", timeout_s=60, sleepable=True) as x, \
            d.connect("y", timeout_s=60) as y:
        ws = WeightSet.create(x, "cd" * 32, 10 * PAGE)
        ws.seal()
        handler = Detacher(ws)
        x.set_sleep_handler(handler)
        x.report_state("idle")
        gy = y.region_group(1, BUDGET * PAGE)
        gy.grant(range(8))
        assert handler.calls == ["pressure"]
        assert wait_for(lambda: states(d, "x") == [("asleep", 0)], what="x asleep")
        with d.monitor() as m:
            ps = m.ps()
        assert ps.pool is not None and ps.pool.weights == 0  # evicted
        assert [t.weights for t in ps.tenants if t.name == "x"] == [0]
    assert d.check() == []


def test_a_flood_of_state_changes_is_answered_and_harmless(daemon):
    peer = RawPeer(daemon.run_dir)
    try:
        peer.register("flood")
        for batch in range(15):  # 3000 changes, 200 in flight at a time
            for i in range(200):
                peer.send(p.TenantState(state=p.SLEEP_STATES[i % 3]))
            got = [peer.recv(60) for _ in range(200)]
            assert all(isinstance(r, p.Done) for r in got), got
        bad = peer.call(p.TenantState(state="idle"))  # still served
        assert isinstance(bad, p.Done)
        with daemon.monitor() as m:
            (t,) = [t for t in m.ps().tenants if t.name == "flood"]
        assert t.state == "idle"
    finally:
        peer.close()
    assert daemon.check() == []


def test_the_state_is_sent_again_after_a_daemon_restart(daemon):
    with daemon.connect("srv", timeout_s=30) as srv:
        srv.report_state("idle")
        srv.report_state("idle")  # unchanged: not sent again
        stop_daemon(daemon)
        respawn(daemon)
        wait_for(lambda: srv.reconnects == 1, what="the tenant's reconnect")
        assert states(daemon, "srv") == [("idle", 0)]
        assert srv.state == "idle"


@needs_root
def test_another_uids_kvpool_sleep_is_refused(start_daemon, tmp_path):
    d = group_daemon(start_daemon, tmp_path)
    with d.connect("rootsrv") as srv:
        srv.report_state("idle")
        got = as_nobody(d, """
            import contextlib, io
            from kvpool.cli.main import cli
            err, rc = io.StringIO(), 0
            with contextlib.redirect_stderr(err):
                try:
                    cli(["sleep", "rootsrv", "--wait", "1", "--run-dir", str(run_dir)])
                except SystemExit as e:
                    rc = e.code
            print(json.dumps({"rc": rc, "err": err.getvalue()}))
        """)
        assert got["rc"] != 0 and "UNAUTHORIZED" in got["err"], got
        assert "Traceback" not in got["err"] and len(got["err"].splitlines()) == 1, got
        assert states(d, "rootsrv") == [("idle", 0)]
        out = d.cli("sleep", "rootsrv", "--wait", "0.2", check=False)  # its own uid may
        assert "not asleep" in out.stderr, out  # (asked; no handler: the wait expires)


def test_a_tenant_that_ignores_asks_does_not_block_pressure_sleep(start_daemon):
    """16 pages: a hung tenant (never answers a reclaim) holds 8, x holds 4 and frees
    them only in its sleep handler, y (busy) asks for 5 (its fair share; 4 are free).
    First x is busy too: the hung tenant, above its share, is asked for the missing
    page and ignores it; y's grant ends NO_MEMORY and the hung tenant is marked
    unresponsive. Then x says idle and y asks again: the hung tenant's pages must not
    count as coming back (it ignored its last ask), so x is put to sleep and y's grant
    goes through (it used to end NO_MEMORY at every try: the hung tenant's ask
    "covered" the need and nobody else was asked)."""
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--reclaim-timeout", "5",
                                                      "--warm-max", "0"))
    hung = RawPeer(d.run_dir)
    try:
        hung.register("hung")
        gid = hung.group(BUDGET, PAGE)
        assert isinstance(hung.call(p.Grant(group=gid, units=list(range(8)))), p.Granted)
        with d.connect("x", timeout_s=60, sleepable=True) as x, \
                d.connect("y", timeout_s=60) as y:
            gx = x.region_group(1, BUDGET * PAGE)
            gx.grant(range(4))
            handler = Releaser(gx)
            x.set_sleep_handler(handler)
            x.report_state("busy")
            y.report_state("busy")
            gy = y.region_group(1, BUDGET * PAGE)
            with pytest.raises(KvpoolError) as e:
                gy.grant(range(5))
            assert e.value.code == p.NO_MEMORY
            wait_for(lambda: unresponsive(d, "hung") == [True], what="hung unresponsive")
            x.report_state("idle")
            gy.grant(range(5))
            assert handler.calls == [("sleep", "pressure")]
            assert gy.mapped == set(range(5))
    finally:
        hung.close()
    assert d.check() == []


class Sleeper:
    """A sleep handler that releases every unit of ``group`` and lets go of ``ws``."""

    def __init__(self, group=None, ws=None):
        self.group, self.ws = group, ws
        self.calls: list[str] = []

    def sleep(self, reason: str) -> bool:
        self.calls.append(reason)
        if self.group is not None:
            self.group.release(sorted(self.group.mapped))
        if self.ws is not None:
            self.ws.detach()
        return True

    def wake(self, reason: str) -> bool:
        return False


def shared_set(d, owner, other, pages: int):
    """A ``pages``-page weight set created and sealed by ``owner``, attached by ``other``:
    (owner's handle, other's handle)."""
    from kvpool.client_lib.weights import WeightSet

    ws = WeightSet.create(owner, "ab" * 32, pages * PAGE)
    ws.seal()
    return ws, WeightSet.attach(other, "ab" * 32)


def test_a_sleeper_whose_weight_set_is_shared_is_not_put_to_sleep_for_nothing(start_daemon):
    """16 pages: r1 (idle, sleepable, no KV) and r2 (busy) hold one 10-page weight set, two
    replicas of one model. y asks for 8 KV pages, past its share of the 6 left: putting
    r1 to sleep would free nothing (r2 still holds the set), so y is refused at once and
    r1 is never asked (it used to be put to sleep, and y to wait out its deadline)."""
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--reclaim-timeout", "5",
                                                      "--warm-max", "0"))
    with d.connect("r1", timeout_s=60, sleepable=True) as r1, \
            d.connect("r2", timeout_s=60) as r2, d.connect("y", timeout_s=60) as y:
        w1, w2 = shared_set(d, r1, r2, 10)
        handler = Sleeper(ws=w1)
        r1.set_sleep_handler(handler)
        r2.report_state("busy")
        r1.report_state("idle")
        y.report_state("busy")
        gy = y.region_group(1, BUDGET * PAGE)
        with pytest.raises(KvpoolError) as e:
            gy.grant(range(8))
        assert e.value.code == p.NO_MEMORY
        assert handler.calls == [] and states(d, "r1") == [("idle", 0)]
        gy.grant(range(6))  # what is free still is
        w2.detach()
    assert d.check() == []


def test_pressure_sleep_picks_the_tenant_whose_sleep_frees_the_need(start_daemon):
    """16 pages: a (idle the longest, sleepable) holds 1 KV page and a 6-page weight set
    that z (busy) holds too; b (idle, sleepable) holds 6 KV pages; 3 are free. y asks for
    6: a's sleep would free 1 page, b's 6. b is put to sleep and a never is (a, idle
    longer, used to be put to sleep first, credited with the whole shared set)."""
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--reclaim-timeout", "30",
                                                      "--warm-max", "0"))
    with d.connect("a", timeout_s=60, sleepable=True) as a, \
            d.connect("b", timeout_s=60, sleepable=True) as b, \
            d.connect("z", timeout_s=60) as z, d.connect("y", timeout_s=60) as y:
        wz, wa = shared_set(d, z, a, 6)
        ga = a.region_group(1, BUDGET * PAGE)
        ga.grant([0])
        gb = b.region_group(1, BUDGET * PAGE)
        gb.grant(range(6))
        sleep_a, sleep_b = Sleeper(ga, wa), Sleeper(gb)
        a.set_sleep_handler(sleep_a)
        b.set_sleep_handler(sleep_b)
        z.report_state("busy")
        y.report_state("busy")
        a.report_state("idle")
        wait_for(lambda: states(d, "a") == [("idle", PAGE)], what="a idle")
        b.report_state("idle")
        gy = y.region_group(1, BUDGET * PAGE)
        gy.grant(range(6))
        assert sleep_b.calls == ["pressure"] and sleep_a.calls == [], d.logs()
        assert states(d, "a") == [("idle", PAGE)]
        wz.detach()
    assert d.check() == []
