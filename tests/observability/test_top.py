"""``kvpool top``: ``--once`` prints every tenant, the pool and recent events within 80
columns; live under tmux (send-keys / capture-pane) it shows every tenant and the pool,
updates when a tenant grows, and quits on ``q``."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time

import pytest

from daemon.helpers import PAGE, REPO
from kvpool.sizes import format_size

from . import scenario


def test_once_shows_tenants_pool_and_events_in_80_columns(start_daemon):
    d, _ = scenario.start(start_daemon, metrics=False)
    out = d.cli("top", "--once").stdout
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    rows = {line.split()[0]: line for line in lines if line.split()}
    assert "alpha" in rows and "beta" in rows
    for t in d.cli_json("ps")["tenants"]:  # (idle tenants: nothing moves in between)
        assert f"{format_size(t['mapped'])} " in rows[t["name"]]
        assert format_size(t["max"]) in rows[t["name"]]
    assert any(line.startswith("pool host:0") and "budget 2 MiB" in line for line in lines)
    assert "last events:" in out and "ask" not in out.split("last events:")[0]
    assert "2 tenants" in lines[0]


def tmux(sock: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True, timeout=30)


def wait_screen(sock: str, pred, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = tmux(sock, "capture-pane", "-p", "-t", "top").stdout
        if pred(screen):
            return screen
        time.sleep(0.1)
    raise AssertionError(f"the screen never matched:\n{screen}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_under_tmux_updates_and_quits_on_q(start_daemon):
    d, _ = scenario.start(start_daemon, metrics=False)
    grower = d.connect("grower")
    g = grower.region_group(1, 16 * PAGE)
    g.grant(range(2))
    sock = f"kvp-{secrets.token_hex(4)}"
    cmd = (f"{sys.executable} -m kvpool.cli.main top --interval 0.2 --run-dir {d.run_dir}; "
           f"echo top exited with $?; sleep 30")  # the pane stays to show how top ended
    env = {**os.environ, "TERM": "xterm-256color"}
    started = subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-s", "top", "-x", "80",
                              "-y", "24", cmd], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=30)
    assert started.returncode == 0, started.stderr
    try:
        screen = wait_screen(sock, lambda s: all(n in s for n in ("alpha", "beta", "grower",
                                                                  "pool host:0")))
        row = next(line for line in screen.splitlines() if line.startswith("grower"))
        assert "128 KiB" in row
        g.grant(range(2, 10))  # grows to 8 pages
        wait_screen(sock, lambda s: any(line.startswith("grower") and "640 KiB" in line
                                        for line in s.splitlines()))
        tmux(sock, "send-keys", "-t", "top", "q")
        wait_screen(sock, lambda s: "top exited with 0" in s)  # the shell goes on
    finally:
        tmux(sock, "kill-server")
        grower.close()
