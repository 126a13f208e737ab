"""A bug met while serving one tenant drops that tenant, never the daemon; a bug that
does end the daemon leaves its restart state (``state.json``) for the next one."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvpool import protocol as p

from .helpers import PAGE, REPO, DaemonProc, read_event, wait_ready
from .rawpeer import RawPeer

FAULTY = Path(__file__).with_name("faulty_daemon.py")


@pytest.fixture
def faulty(tmp_path):
    started: list[DaemonProc] = []

    def start(fault: str) -> DaemonProc:
        run_dir = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))
        log = run_dir.with_suffix(".log")
        cmd = [sys.executable, str(FAULTY), fault, str(tmp_path / "trigger"), "daemon",
               "--backend", "host", "--run-dir", str(run_dir), "--budget", str(64 * PAGE),
               "--page-size", str(PAGE)]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        d = DaemonProc(run_dir=run_dir, proc=proc, log=log, page_size=PAGE)
        started.append(d)
        wait_ready(d)
        return d

    yield start
    for d in started:
        for w in d.workers:
            if w.poll() is None:
                w.kill()
            w.wait()
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
            try:
                d.proc.wait(10)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
        shutil.rmtree(d.run_dir, ignore_errors=True)
        d.log.unlink(missing_ok=True)


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
