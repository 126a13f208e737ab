"""A bug met while serving one tenant drops that tenant, never the daemon; a bug that
does end the daemon leaves its restart state (``state.json``) for the next one."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from kvpool import protocol as p
from kvpool.client_lib import Monitor

from .helpers import PAGE, DaemonProc, read_event, wait_for
from .rawpeer import RawPeer

FAULTY = Path(__file__).with_name("faulty_daemon.py")


@pytest.fixture
def faulty(start_daemon, tmp_path):
    """``faulty(fault)``: a real daemon whose ``fault`` fires once the trigger file exists."""
    def start(fault: str) -> DaemonProc:
        return start_daemon(budget=str(64 * PAGE), launcher=[
            sys.executable, str(FAULTY), fault, str(tmp_path / "trigger")])
    return start


def test_a_bug_in_one_tenants_handling_drops_only_that_tenant(faulty):
    d = faulty("read")
    with d.connect("bystander") as honest:
        g = honest.region_group(1, 4 * PAGE)
        g.grant([0])
        boom = RawPeer(d.run_dir)
        boom.register("boom")
        gid = boom.group(4, PAGE)
        assert isinstance(boom.call(p.Grant(group=gid, units=[0, 1])), p.Granted)
        boom.fd.send(b"x")  # makes the daemon read boom's fd channel: the injected bug
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with d.monitor() as m:
                if not [t for t in m.ps().tenants if t.name == "boom"]:
                    break
            time.sleep(0.05)
        else:
            raise AssertionError(f"boom was not dropped:\n{d.logs()}")
        assert d.proc.poll() is None, d.logs()
        assert "injected fault" in d.logs()
        g.release([0])
        g.grant([1, 2])  # the bystander is still served
        assert d.stats().pool.granted == 2 * PAGE  # boom's two pages came back
        boom.close()
    assert d.check() == []


def test_a_crash_keeps_the_restart_state(faulty, tmp_path):
    d = faulty("crash")
    holder = d.worker("hold", "--name", "keeper", "--units", "2")
    read_event(holder, "ready")
    deadline = time.monotonic() + 30
    while not (d.run_dir / "state.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (tmp_path / "trigger").touch()
    assert d.proc.wait(30) != 0  # it did crash
    state = json.loads((d.run_dir / "state.json").read_text())
    assert [t["name"] for t in state["tenants"]] == ["keeper"], state


def peer_on(d: DaemonProc, name: str, device: int) -> RawPeer:
    peer = RawPeer(d.run_dir)
    assert isinstance(peer.call(p.Register(name=name, device=device)), p.Registered)
    return peer


def waiting_on(d: DaemonProc, device: int) -> int:
    with Monitor(d.run_dir, device=device) as m:
        return sum(t.waiting for t in m.ps().tenants)


@pytest.mark.parametrize("fault", ["step", "serve"])
def test_a_device_whose_tick_raises_loses_no_waiter(start_daemon, tmp_path, fault):
    """Two devices, each full (a holder of all 16 pages) with a grant waiting for 4.
    Then device 1's tick raises at every turn (``step``: after taking its waiters off
    the queue; ``serve``: while serving one). Device 1's waiter still gets an answer
    (granted, or INTERNAL when serving it is what raised), and device 0's waiter, served
    in ticks where device 1 raises, is granted: nobody waits for a reply that never
    comes."""
    d = start_daemon(budget=str(16 * PAGE), launcher=[
        sys.executable, str(FAULTY), fault, str(tmp_path / "trigger")],
        extra=("--devices", "2", "--reclaim-timeout", "120", "--warm-max", "0"))
    peers, holders = [], []
    try:
        waiters, rids = [], []
        for dev in (0, 1):
            h = d.connect(f"holder{dev}", device=dev)
            holders.append(h)
            hg = h.region_group(1, 16 * PAGE)
            hg.grant(range(16))
            w = peer_on(d, f"waiter{dev}", dev)
            peers.append(w)
            rids.append(w.send(p.Grant(group=w.group(4, PAGE), units=[0, 1, 2, 3])))
            waiters.append(w)
            wait_for(lambda: waiting_on(d, dev) == 4 * PAGE, what=f"device {dev}'s waiter")
        (tmp_path / "trigger").touch()
        for dev in (1, 0):  # device 1 first: its waiter is taken while it raises
            (hg,) = holders[dev].groups.values()
            hg.release([0, 1, 2, 3])
        got = {}
        for dev, (w, rid) in enumerate(zip(waiters, rids)):
            reply = w.recv(60)  # (AssertionError: the daemon never answered)
            assert reply.id == rid, reply
            got[dev] = reply
        assert isinstance(got[0], p.Granted), got
        if fault == "step":
            assert isinstance(got[1], p.Granted), got
        else:
            assert got[1].code == p.INTERNAL and "injected fault" in got[1].message, got
        assert d.proc.poll() is None and "injected fault" in d.logs()
    finally:
        for peer in peers:
            peer.close()
        for h in holders:
            h.close()
