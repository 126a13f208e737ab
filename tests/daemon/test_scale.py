"""Real page counts (host, 64 KiB pages): a daemon past 1,024 descriptors keeps serving,
answers ps/map for 32 tenants and 256 groups in bounded replies, and gets every page
back when the tenants holding them are killed — one process with 32 tenants (1,500
pages), and one tenant holding 1,100 pages alone. (Latencies: benchmarks/scale_bench.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from kvpool import protocol as p

from .helpers import PAGE, REPO, read_event

HOLDERS = Path(__file__).with_name("holders.py")
TENANTS, GROUPS, PAGES, SOLO = 32, 256, 1500, 1100
WARM = 64  # the daemon's warm pool cap (pages it may keep open after the kill)


def holders(d, prefix: str, tenants: int, groups: int, pages: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(HOLDERS), str(d.run_dir), prefix, str(tenants),
                             str(groups), str(pages)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    d.workers.append(proc)
    return proc


def wait_empty(m, deadline: float) -> p.PsReply:
    while True:
        ps = m.ps()
        if not ps.tenants and ps.pool.granted == 0:
            return ps
        assert time.monotonic() < deadline, f"pages not back: {ps.pool}"
        time.sleep(0.02)


def test_32_tenants_256_groups_past_1024_fds(start_daemon):
    d = start_daemon(budget=str((PAGES + 64) * PAGE), extra=("--warm-max", str(WARM * PAGE)))
    daemon = psutil.Process(d.pid)
    fds0 = daemon.num_fds()
    h = holders(d, "t", TENANTS, GROUPS, PAGES)
    ready = read_event(h, "ready", timeout=120)
    assert daemon.num_fds() > 1024  # one memfd per page it owns
    with d.monitor() as m:
        ps = m.ps()
        assert {t.name: t.mapped for t in ps.tenants} == ready["per_tenant"]
        assert ps.pool.granted == PAGES * PAGE
        reply = m.call(p.MapReq())  # one page of the map: bounded
        assert len(p.encode(reply)) <= p.MAP_REPLY_BYTES + 4096
        groups = m.map().groups  # every page of it
        assert len(groups) == GROUPS
        assert sum(g.in_use_units for g in groups) == PAGES
        with d.connect("probe") as t:  # the daemon still serves a newcomer
            g = t.region_group(2, 4 * PAGE)
            g.grant(range(4))
            g.release(range(4))
        assert m.check() == []
        os.kill(ready["pid"], signal.SIGKILL)  # all 32 tenants die at once
        wait_empty(m, time.monotonic() + 60)
        assert m.check() == []
    assert d.proc.poll() is None, d.logs()
    # the dead tenants' pages are closed (the idle loop trims dirty/warm pages to the cap)
    deadline = time.monotonic() + 60
    while daemon.num_fds() > fds0 + WARM + 16:
        assert time.monotonic() < deadline, f"daemon fds {daemon.num_fds()} (start {fds0})"
        time.sleep(0.05)


def test_tenants_killed_while_the_daemon_holds_1100_pages(start_daemon):
    """A tenant that connects once the daemon holds 1,100 descriptors gets a channel
    numbered past 1,024; its death (and the big one's) must not take the daemon down."""
    d = start_daemon(budget=str((SOLO + 64) * PAGE))
    solo = read_event(holders(d, "solo", 1, 1, SOLO), "ready", timeout=120)
    assert psutil.Process(d.pid).num_fds() > SOLO
    late = read_event(holders(d, "late", 1, 1, 8), "ready", timeout=120)
    with d.monitor() as m:
        os.kill(late["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "late0" in {t.name for t in m.ps().tenants}:
            assert d.proc.poll() is None, d.logs()
            assert time.monotonic() < deadline, "the late tenant's pages are still held"
            time.sleep(0.02)
        assert m.ps().pool.granted == SOLO * PAGE
        os.kill(solo["pid"], signal.SIGKILL)
        wait_empty(m, time.monotonic() + 60)
        assert m.check() == []
    assert d.proc.poll() is None, d.logs()
    with d.connect("after") as t:
        t.region_group(1, 4 * PAGE).grant(range(4))
    assert d.cli("check").stdout.strip() == "ok"
