"""kill -9 of a tenant 100 times in a row while another tenant keeps allocating: every
time the dead tenant's pages come back, the next tenant finds them zeroed, the books
balance; ``kvpool check`` is clean at the end (real daemon, real processes, host)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import PAGE, REPO, read_event

ROUNDS = 100
VICTIM_PAGES = 16
CHURN_PAGES = 32  # the load tenant's limit: the victims get what it cannot take
VICTIMS = Path(__file__).with_name("victims.py")


def wait_gone(m, name: str, deadline: float):
    """The ps reply in which ``name`` no longer appears (generous deadline)."""
    while True:
        ps = m.ps()
        if name not in {t.name for t in ps.tenants}:
            return ps
        assert time.monotonic() < deadline, f"{name} still listed after its kill: {ps.tenants}"
        time.sleep(0.005)


@pytest.mark.timeout(900)
def test_kill9_storm_under_load(start_daemon, tmp_path):
    d = start_daemon(budget=str((VICTIM_PAGES + CHURN_PAGES) * PAGE))
    d.cli("limit", "churner", str(CHURN_PAGES * PAGE))  # pending until it registers
    stop = tmp_path / "stop"
    churn = d.worker("churn", "--name", "churner", "--seconds", "900", "--until-file", str(stop),
                     "--max-blocks", "400", "--block", str(16 << 10))
    read_event(churn, "ready")
    server = subprocess.Popen([sys.executable, str(VICTIMS), str(d.run_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO)
    d.workers.append(server)
    came_back = zeroed = 0
    with d.monitor() as m:
        for i in range(ROUNDS):
            name = f"victim{i}"
            server.stdin.write(f"go {name} {VICTIM_PAGES} {i % 255 + 1:#x}\n")
            server.stdin.flush()
            ready = read_event(server, "ready", timeout=60)
            assert ready["pages"] == VICTIM_PAGES
            zeroed += ready["nonzero"] == 0
            assert ready["nonzero"] == 0, f"round {i}: {ready['nonzero']} bytes of old data"
            held = {t.name: t.mapped for t in m.ps().tenants}
            assert held[name] == VICTIM_PAGES * PAGE and held["churner"] <= CHURN_PAGES * PAGE
            os.kill(ready["pid"], signal.SIGKILL)
            ps = wait_gone(m, name, time.monotonic() + 30)
            # the books balance: every granted page belongs to a live tenant
            assert ps.pool.granted == sum(t.mapped for t in ps.tenants), ps
            assert not [g for g in m.map().groups if g.tenant_name == name]
            came_back += 1
            if i % 10 == 9:
                assert m.check() == [], f"after round {i}"
                assert churn.poll() is None, "the load tenant died"
    assert (came_back, zeroed) == (ROUNDS, ROUNDS)
    stop.touch()
    done = read_event(churn, "done", timeout=60)
    assert done["ok"] > ROUNDS, done  # it really kept allocating throughout
    assert churn.wait(30) == 0
    server.stdin.close()
    server.wait(30)
    assert d.cli("check").stdout.strip() == "ok"
    s = d.stats()
    assert s.pool.granted == 0 and not s.tenants
