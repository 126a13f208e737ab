"""Page handoff between tenants with real daemon processes and real tenants: the bytes
the giver wrote are what the receiver reads (same pages, no copy), the giver's mapping is
gone afterwards, a third tenant cannot claim, expired/reused/cancelled tickets and claims
past the receiver's max are refused while the giver keeps its pages, and killing either
side with pages in escrow or mid-handoff loses no memory."""

from __future__ import annotations

import ctypes
import grp
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.client_lib import KvpoolError, OverLimit
from kvpool import protocol as p
from kvpool.client_lib import handoff

from .handoff_worker import fill, pattern, read
from .helpers import PAGE, REPO, read_event, read_line

WORKER = Path(__file__).with_name("handoff_worker.py")
REGIONS = 2
CAP = 8 * PAGE  # 8 units per group


def spawn(d, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [*prefix, sys.executable, str(WORKER), *args, "--run-dir", str(d.run_dir)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": "/tmp"}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    d.workers.append(proc)
    return proc


def wait_for(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout} s")


def check_both(d, *groups) -> None:
    """Both sides after a handoff (the in-process giver's and receiver's groups): each
    group's own books (the units it maps, the page handles it keeps) equal the daemon's
    map of that group, and the daemon's books add up (``kvpool check``)."""
    with d.monitor() as m:
        daemon_units = {g.id: {int(u) for u in (g.pfns or {})}
                        for g in m.map(pfns=True).groups}
    for g in groups:
        assert set(g.handles) == g.mapped, (g.id, sorted(g.handles), sorted(g.mapped))
        assert daemon_units.get(g.id, set()) == g.mapped, (
            g.id, sorted(daemon_units.get(g.id, ())), sorted(g.mapped))
    assert d.check() == []


def tenant_info(d, name: str):
    with d.monitor() as m:
        return next((t for t in m.ps().tenants if t.name == name), None)


def table(d, name: str) -> dict[int, list[int]]:
    """unit -> pfns of the named tenant's only group, from the daemon's map."""
    with d.monitor() as m:
        groups = m.map(name, pfns=True).groups
    assert len(groups) == 1, groups
    return {int(u): list(v) for u, v in (groups[0].pfns or {}).items()}


def giver_with_data(d, units=(0, 1, 2), name="prefill"):
    t = d.connect(name)
    g = t.region_group(REGIONS, CAP)
    g.grant(list(units))
    fill(g, units)
    return t, g


def test_the_receiver_reads_the_givers_bytes_and_the_giver_lets_go(daemon):
    d = daemon
    giver, gg = giver_with_data(d)
    with giver, d.connect("decode") as receiver:
        rg = receiver.region_group(REGIONS, CAP)
        created = d.stats().pool.created
        before = table(d, "prefill")
        ticket = handoff.offer(gg, [1, 2], to="decode")
        assert ticket.pages == 2 * REGIONS and not ticket.settled
        assert table(d, "prefill") == before  # in escrow: still the giver's
        assert handoff.claim(rg, ticket.id, [5, 3]) == [5, 3]
        # unit 5 <- unit 1, unit 3 <- unit 2: the giver's bytes, unchanged
        for at, src in ((5, 1), (3, 2)):
            for r in range(REGIONS):
                assert read(rg, at, r) == pattern(src, r, PAGE)
        # the very same pages (pfns) changed hands; no page was created for it
        after = table(d, "decode")
        assert after == {5: before[1], 3: before[2]}
        assert d.stats().pool.created == created
        # the giver hears of it and drops its mappings (nothing released)
        assert ticket.wait(10) == "claimed"
        assert gg.mapped == {0} and set(gg.handles) == {0}
        assert table(d, "prefill") == {0: before[0]}
        gi, ri = tenant_info(d, "prefill"), tenant_info(d, "decode")
        assert (gi.mapped, ri.mapped) == (REGIONS * PAGE, 2 * REGIONS * PAGE)
        assert d.stats().pool.granted == 3 * REGIONS * PAGE  # moved, not added
        assert read(gg, 0) == pattern(0, 0, PAGE)  # what it kept is intact
        check_both(d, gg, rg)
        with d.monitor() as m:  # `kvpool events`: a handoff, not a grant
            events = m.call(p.Events()).events
        moved = [e for e in events if e.kind == "handoff"]
        assert [(e.tenant, e.bytes, e.detail["giver"]) for e in moved] == \
            [("decode", 2 * REGIONS * PAGE, "prefill")]
        assert [e.bytes for e in events if e.kind == "grant"] == [3 * REGIONS * PAGE]
        ps = {t["name"]: t["mapped"] for t in d.cli_json("ps")["tenants"]}  # `kvpool ps`
        assert ps == {"prefill": REGIONS * PAGE, "decode": 2 * REGIONS * PAGE}
        # the receiver owns them now: writes are its own, release gives them back
        ctypes.memset(rg.unit_address(0, 5), 0x5A, PAGE)
        rg.release([5, 3])
        assert tenant_info(d, "decode").mapped == 0
    assert d.check() == []
    s = d.stats()
    assert s.pool.granted == 0 and not s.tenants


def test_the_giver_can_no_longer_touch_the_pages(daemon):
    """In a child process: after the claim its read of a given unit dies by SIGSEGV,
    while a unit it kept still reads its bytes."""
    d = daemon
    giver = spawn(d, "give", "--units", "3", "--offer", "1,2", "--touch-after")
    tid = read_event(giver, "ticket")["ticket"]
    with d.connect("decode") as receiver:
        rg = receiver.region_group(REGIONS, CAP)
        handoff.claim(rg, tid, [0, 1])
        settled = read_event(giver, "settled")
        assert settled == {"event": "settled", "state": "claimed", "mapped": [0]}
        assert read_event(giver, "kept")["ok"] is True
        read_event(giver, "touching")
        assert giver.wait(30) == -signal.SIGSEGV
        assert read(rg, 0, 1) == pattern(1, 1, PAGE)  # the receiver's copy-free pages live on
        wait_for(lambda: tenant_info(d, "prefill") is None, "the dead giver is dropped")
        assert tenant_info(d, "decode").mapped == 2 * REGIONS * PAGE
        assert d.check() == []
    assert d.stats().pool.granted == 0


def test_a_third_tenant_cannot_claim(daemon):
    d = daemon
    giver, gg = giver_with_data(d)
    with giver, d.connect("decode") as receiver, d.connect("other") as third:
        ticket = handoff.offer(gg, [1], to="decode")
        tg = third.region_group(REGIONS, CAP)
        with pytest.raises(KvpoolError, match="is for tenant 'decode'") as err:
            handoff.claim(tg, ticket.id, [0])
        assert err.value.code == "UNAUTHORIZED"
        assert tg.mapped == set() and tenant_info(d, "other").mapped == 0
        with d.monitor() as m, pytest.raises(KvpoolError) as err:  # nor a monitor session
            m.conn.call(p.Claim(ticket=ticket.id, group=gg.id, units=[0]))
        assert err.value.code in ("UNAUTHORIZED", "NOT_FOUND")
        # not spoiled: the named receiver still gets it
        rg = receiver.region_group(REGIONS, CAP)
        handoff.claim(rg, ticket, [4])
        assert read(rg, 4, 0) == pattern(1, 0, PAGE)
        assert ticket.wait(10) == "claimed"
        check_both(d, gg, rg)


def test_a_reused_ticket_is_refused(daemon):
    d = daemon
    giver, gg = giver_with_data(d)
    with giver, d.connect("decode") as receiver:
        rg = receiver.region_group(REGIONS, CAP)
        ticket = handoff.offer(gg, [1], to="decode")
        handoff.claim(rg, ticket, [0])
        with pytest.raises(KvpoolError, match="was claimed already") as err:
            handoff.claim(rg, ticket, [1])
        assert err.value.code == "NOT_FOUND"
        assert rg.mapped == {0} and tenant_info(d, "decode").mapped == REGIONS * PAGE
        assert ticket.wait(10) == "claimed"
        assert handoff.cancel(giver, ticket) is False  # over: the giver learns it was claimed
        check_both(d, gg, rg)


@pytest.mark.parametrize("end", ["claimed", "expired"])
def test_a_lost_settled_notice_is_recovered_from_the_daemons_map(daemon, monkeypatch, end):
    """The daemon's word that a ticket is over never reaches the giver: its cancel
    learns how it ended from the daemon's map (claimed: the giver's mapping goes, as a
    Settled would have it; expired: the pages stay the giver's), never guessing. A
    claim whose giver never lets go is not handed over (it would share the pages with
    its giver): void after ``handoff_letgo_s``, the pages charged to the giver until
    its cancel drops the mapping."""
    d = daemon
    giver, gg = giver_with_data(d)
    with giver, d.connect("decode") as receiver:
        lost: list[p.Settled] = []
        monkeypatch.setattr(handoff.of(giver), "settled", lost.append)  # never handled
        rg = receiver.region_group(REGIONS, CAP)
        ticket = handoff.offer(gg, [1, 2], to="decode", ttl_s=0.3 if end == "expired" else 60)
        if end == "claimed":
            with pytest.raises(KvpoolError, match="still references"):
                handoff.claim(rg, ticket, [0, 1])
            assert rg.mapped == set()
        wait_for(lambda: lost, "the daemon's Settled (dropped here)")
        assert lost[0].state == end and not ticket.settled and gg.mapped == {0, 1, 2}
        monkeypatch.undo()  # the recovery goes through the real handler
        assert handoff.cancel(giver, ticket) is False
        assert ticket.state == end
        assert gg.mapped == ({0} if end == "claimed" else {0, 1, 2})
        if end == "expired":
            assert read(gg, 2, 1) == pattern(2, 1, PAGE)
        else:  # the mapping gone, the kept pages go too
            wait_for(lambda: d.stats().pool.retained == 0, "the giver's kept pages freed")
        check_both(d, gg, rg)


def test_an_expired_ticket_is_refused_and_the_giver_keeps_its_pages(daemon):
    d = daemon
    giver, gg = giver_with_data(d)
    with giver, d.connect("decode") as receiver:
        rg = receiver.region_group(REGIONS, CAP)
        before = table(d, "prefill")
        ticket = handoff.offer(gg, [1, 2], to="decode", ttl_s=0.2)
        assert ticket.wait(10) == "expired"  # the daemon said so (its timer)
        with pytest.raises(KvpoolError, match="expired already") as err:
            handoff.claim(rg, ticket, [0, 1])
        assert err.value.code == "NOT_FOUND"
        assert rg.mapped == set() and tenant_info(d, "decode").mapped == 0
        assert gg.mapped == {0, 1, 2} and table(d, "prefill") == before
        assert read(gg, 2, 1) == pattern(2, 1, PAGE)
        again = handoff.offer(gg, [1, 2], to="decode")  # the units can go out again
        assert handoff.cancel(giver, again) is True
        with pytest.raises(KvpoolError, match="cancelled already"):
            handoff.claim(rg, again, [0, 1])
        assert gg.mapped == {0, 1, 2}
        check_both(d, gg, rg)


@pytest.mark.parametrize("ticket", ["0" * 32, "f" * 32])
def test_a_forged_ticket_gets_nothing(daemon, ticket):
    d = daemon
    with d.connect("decode") as receiver:
        rg = receiver.region_group(REGIONS, CAP)
        with pytest.raises(KvpoolError, match="no ticket") as err:
            handoff.claim(rg, ticket, [0])
        assert err.value.code == "NOT_FOUND" and rg.mapped == set()


def test_a_claim_past_the_receivers_max_is_refused_and_the_giver_keeps_them(daemon):
    d = daemon
    giver, gg = giver_with_data(d)
    with giver, d.connect("decode", max=3 * PAGE) as receiver:
        rg = receiver.region_group(REGIONS, CAP)
        ticket = handoff.offer(gg, [1, 2], to="decode")  # 4 pages > 3
        with pytest.raises(OverLimit, match="giver keeps them"):
            handoff.claim(rg, ticket, [0, 1])
        assert rg.mapped == set() and tenant_info(d, "decode").mapped == 0
        assert gg.mapped == {0, 1, 2} and tenant_info(d, "prefill").mapped == 6 * PAGE
        assert not ticket.settled  # still claimable (within the max, e.g. after a change)
        one = handoff.offer(gg, [0], to="decode")  # 2 pages fit
        handoff.claim(rg, one, [7])
        assert read(rg, 7, 1) == pattern(0, 1, PAGE)
        assert handoff.cancel(giver, ticket) is True
        assert one.wait(10) == "claimed" and gg.mapped == {1, 2}
        check_both(d, gg, rg)


def test_layouts_must_match(daemon):
    d = daemon
    giver, gg = giver_with_data(d)
    with giver, d.connect("decode") as receiver:
        ticket = handoff.offer(gg, [1], to="decode")
        wrong = receiver.region_group(REGIONS + 1, CAP)
        with pytest.raises(KvpoolError, match="regions") as err:
            handoff.claim(wrong, ticket, [0])
        assert err.value.code == "BAD_REQUEST"
        rg = receiver.region_group(REGIONS, CAP)
        rg.grant([0])
        with pytest.raises(KvpoolError, match="mapped already"):
            handoff.claim(rg, ticket, [0])
        with pytest.raises(KvpoolError, match="target units"):
            handoff.claim(rg, ticket, [1, 2])
        assert gg.mapped == {0, 1, 2} and not ticket.settled
        handoff.claim(rg, ticket, [1])
        check_both(d, gg, rg)


def test_offers_are_checked(daemon):
    d = daemon
    giver, gg = giver_with_data(d, units=(0, 1))
    with giver:
        with pytest.raises(KvpoolError, match="not granted"):
            giver.conn.call(p.Offer(group=gg.id, units=[5], to="decode"))
        with pytest.raises(KvpoolError, match="named twice"):
            giver.conn.call(p.Offer(group=gg.id, units=[1, 1], to="decode"))
        handoff.offer(gg, [1], to="decode")
        with pytest.raises(KvpoolError, match="in escrow already"):
            handoff.offer(gg, [0, 1], to="decode")
        assert d.check() == []


def test_a_giver_released_unit_voids_the_ticket(daemon):
    d = daemon
    giver, gg = giver_with_data(d)
    with giver, d.connect("decode") as receiver:
        rg = receiver.region_group(REGIONS, CAP)
        ticket = handoff.offer(gg, [2], to="decode")
        gg.release([2])  # the giver broke its word: nothing of it may reach the receiver
        with pytest.raises(KvpoolError, match="no longer holds") as err:
            handoff.claim(rg, ticket, [0])
        assert err.value.code == "NOT_FOUND" and rg.mapped == set()
        assert ticket.wait(10) == "cancelled"
        check_both(d, gg, rg)


def test_giver_killed_with_pages_in_escrow_loses_no_memory(daemon):
    d = daemon
    giver = spawn(d, "give", "--units", "3", "--offer", "1,2")
    tid = read_event(giver, "ticket")["ticket"]
    assert d.stats().pool.granted == 3 * REGIONS * PAGE
    giver.send_signal(signal.SIGKILL)
    giver.wait(10)
    wait_for(lambda: d.stats().pool.granted == 0, "the giver's pages are back")
    with d.connect("decode") as receiver:
        rg = receiver.region_group(REGIONS, CAP)
        with pytest.raises(KvpoolError, match="cancelled already") as err:
            handoff.claim(rg, tid, [0, 1])
        assert err.value.code == "NOT_FOUND" and rg.mapped == set()
        check_both(d, rg)  # the receiver's side (the giver's process is gone)
    s = d.stats()
    assert s.pool.granted == 0 and not s.tenants


def test_giver_killed_after_the_claim_leaves_the_receiver_its_pages(daemon):
    d = daemon
    giver = spawn(d, "give", "--units", "3", "--offer", "1,2")
    tid = read_event(giver, "ticket")["ticket"]
    with d.connect("decode") as receiver:
        rg = receiver.region_group(REGIONS, CAP)
        handoff.claim(rg, tid, [6, 7])
        giver.send_signal(signal.SIGKILL)
        giver.wait(10)
        wait_for(lambda: tenant_info(d, "prefill") is None, "the dead giver is dropped")
        assert d.stats().pool.granted == 2 * REGIONS * PAGE  # exactly the receiver's
        for at, src in ((6, 1), (7, 2)):
            assert read(rg, at, 1) == pattern(src, 1, PAGE)
        check_both(d, rg)  # the receiver's side (the giver's process is gone)
    s = d.stats()
    assert s.pool.granted == 0 and not s.tenants and d.check() == []


@pytest.mark.parametrize("delay", [0.0, 0.5])
def test_receiver_killed_mid_handoff_loses_no_memory(daemon, delay):
    """SIGKILL the receiver right as it claims (delay 0: the kill races the claim) or
    after: whichever happened, the daemon's accounting is whole, the giver learns the
    outcome, and once everyone is gone the pool holds nothing."""
    d = daemon
    giver, gg = giver_with_data(d)
    with giver:
        ticket = handoff.offer(gg, [1, 2], to="decode", ttl_s=3.0)
        taker = spawn(d, "take", "--name", "decode", "--at", "0,1", "--from-units", "1,2")
        read_event(taker, "ready")
        taker.stdin.write(ticket.id + "\n")
        taker.stdin.flush()
        if delay:
            assert read_event(taker, "claimed")["ok"] is True
        taker.send_signal(signal.SIGKILL)
        taker.wait(10)
        wait_for(lambda: tenant_info(d, "decode") is None, "the dead receiver is dropped")
        state = ticket.wait(30)
        assert state in ("claimed", "expired") and (delay == 0 or state == "claimed")
        kept = {0} if state == "claimed" else {0, 1, 2}
        assert gg.mapped == kept
        assert d.stats().pool.granted == len(kept) * REGIONS * PAGE
        check_both(d, gg)  # the giver's side (the receiver's process is gone)
        assert d.cli("check").returncode == 0  # `kvpool check`: clean
    s = d.stats()
    assert s.pool.granted == 0 and not s.tenants and d.check() == []


GROUP = "kvpooltest"


def _other_uid_daemon(start_daemon, tmp_path, pairing: bool):
    """A daemon whose sockets a group can reach, so uid 65534 can be a tenant; with
    ``pairing`` its config lets ``prefill`` hand pages to ``decode`` across uids."""
    if subprocess.run(["getent", "group", GROUP], capture_output=True).returncode != 0:
        subprocess.run(["groupadd", GROUP], check=True)
    conf = tmp_path / "kvpool.toml"
    conf.write_text('[tenants.prefill]\nhandoff_to = ["decode"]\n' if pairing else "")
    d = start_daemon(extra=("--socket-group", GROUP, "--config", str(conf)))
    nobody = ("setpriv", "--reuid=65534", "--regid=65534",
              f"--groups={grp.getgrnam(GROUP).gr_gid}", "--")
    return d, nobody


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_another_uid_may_not_claim_without_a_pairing(start_daemon, tmp_path):
    d, nobody = _other_uid_daemon(start_daemon, tmp_path, pairing=False)
    taker = spawn(d, "take", "--name", "decode", "--at", "0", "--from-units", "1",
                  prefix=nobody)
    read_event(taker, "ready")
    giver, gg = giver_with_data(d)
    with giver:
        with pytest.raises(KvpoolError, match="not the same uid") as err:
            handoff.offer(gg, [1], to="decode")  # the receiver is there: refused now
        assert err.value.code == "UNAUTHORIZED"
        taker.kill()
        taker.wait(10)
        wait_for(lambda: tenant_info(d, "decode") is None, "the receiver is gone")
        ticket = handoff.offer(gg, [1], to="decode")  # offered while nobody holds the name
        taker = spawn(d, "take", "--name", "decode", "--at", "0", "--from-units", "1",
                      prefix=nobody)
        read_event(taker, "ready")
        taker.stdin.write(ticket.id + "\n")
        taker.stdin.flush()
        line = read_line(taker) or ""
        assert "not the same uid" in line and "UNAUTHORIZED" in line, line
        assert not ticket.settled and gg.mapped == {0, 1, 2}
        assert handoff.cancel(giver, ticket) is True
        assert d.check() == []


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_a_configured_pairing_admits_another_uid(start_daemon, tmp_path):
    d, nobody = _other_uid_daemon(start_daemon, tmp_path, pairing=True)
    taker = spawn(d, "take", "--name", "decode", "--at", "3,4", "--from-units", "1,2",
                  prefix=nobody)
    read_event(taker, "ready")
    giver, gg = giver_with_data(d)
    with giver:
        ticket = handoff.offer(gg, [1, 2], to="decode")
        taker.stdin.write(ticket.id + "\n")
        taker.stdin.flush()
        got = read_event(taker, "claimed")
        assert got["ok"] is True and got["mapped"] == [3, 4]
        assert ticket.wait(10) == "claimed" and gg.mapped == {0}
        with d.monitor() as m:
            uids = {t.name: t.uid for t in m.ps().tenants}
        assert uids == {"prefill": 0, "decode": 65534}
        assert d.check() == []


def test_a_daemon_restart_ends_pending_offers_and_the_giver_keeps_its_pages(daemon):
    from .policy_helpers import restart

    d = daemon
    giver, gg = giver_with_data(d)
    with giver:
        ticket = handoff.offer(gg, [1, 2], to="decode")
        restart(d, os.getpid(), next_group=gg.id + 1)
        assert ticket.wait(30) == "cancelled" and "restarted" in ticket.reason
        wait_for(lambda: giver.reconnects == 1, "the giver re-adopted")
        assert gg.mapped == {0, 1, 2} and read(gg, 2, 1) == pattern(2, 1, PAGE)
        with d.connect("decode") as receiver:
            rg = receiver.region_group(REGIONS, CAP)
            wait_for(lambda: not d.stats().pool.recovering, "recovery is over")
            with pytest.raises(KvpoolError, match="no ticket"):
                handoff.claim(rg, ticket, [0, 1])
        assert tenant_info(d, "prefill").mapped == 3 * REGIONS * PAGE
        check_both(d, gg, rg)
