"""A bug met while serving one tenant drops that tenant, never the daemon; a bug that
does end the daemon leaves its restart state (``state.json``) for the next one."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from kvpool import protocol as p

from .helpers import PAGE, DaemonProc, read_event
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
