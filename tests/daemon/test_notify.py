"""sd_notify against real datagram sockets, the daemon under a fake systemd, the unit."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvpool.daemon.notify import Notifier

from .helpers import REPO


def _recv_all(sock: socket.socket, timeout: float) -> list[str]:
    sock.settimeout(timeout)
    out = []
    try:
        while True:
            out.append(sock.recv(4096).decode())
            sock.settimeout(0.01)
    except (socket.timeout, BlockingIOError):
        return out


def test_notify_path_socket(tmp_path):
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        n = Notifier.from_env({"NOTIFY_SOCKET": str(path)})
        assert n.enabled and n.watchdog_interval is None
        assert n.ready("serving")
        assert n.watchdog() and n.status("busy")
        msgs = _recv_all(sock, 1)
        n.close()
    assert msgs[0].splitlines()[:2] == ["READY=1", "STATUS=serving"]
    assert f"MAINPID={os.getpid()}" in msgs[0]
    assert msgs[1:] == ["WATCHDOG=1", "STATUS=busy"]


def test_notify_abstract_socket():
    name = f"kvpool-test-{secrets.token_hex(4)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.stopping()
        assert _recv_all(sock, 1) == ["STOPPING=1"]
        n.close()


def test_notify_disabled_and_watchdog_env():
    assert not Notifier.from_env({}).ready()
    mine = Notifier.from_env({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "4000000",
                              "WATCHDOG_PID": str(os.getpid())})
    assert mine.watchdog_interval == 2.0
    other = Notifier.from_env({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "4000000",
                               "WATCHDOG_PID": "1"})
    assert other.watchdog_interval is None  # meant for another process
    assert Notifier.from_env({"WATCHDOG_USEC": "junk"}).watchdog_interval is None
    # a socket nobody listens on: best effort, no exception
    assert not Notifier("@kvpool-nobody-" + secrets.token_hex(4)).send("READY=1")


def test_daemon_speaks_sd_notify_and_stops_cleanly(start_daemon):
    name = f"kvpool-test-{secrets.token_hex(4)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        d = start_daemon(env={"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "200000"})
        msgs = _recv_all(sock, 5)
        deadline = time.monotonic() + 3
        while sum(m == "WATCHDOG=1" for m in msgs) < 3 and time.monotonic() < deadline:
            msgs += _recv_all(sock, 0.5)
        assert msgs[0].startswith("READY=1\nSTATUS=0 tenants")
        assert sum(m == "WATCHDOG=1" for m in msgs) >= 3
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
        assert "STOPPING=1" in _recv_all(sock, 2)
    assert not (d.run_dir / "control.sock").exists()
    assert not (d.run_dir / "pages.sock").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_stop_the_daemon_and_remove_sockets(start_daemon, sig):
    d = start_daemon()
    with d.connect("t") as t:
        g = t.region_group(1, 4 * d.page_size)
        g.grant([0, 1])
        d.proc.send_signal(sig)
        assert d.proc.wait(10) == 0
        # our mapping outlives the daemon (nothing revokes it)
        import ctypes
        ctypes.memset(g.ranges[0].base, 7, d.page_size)
        assert ctypes.string_at(g.ranges[0].base, 4) == b"\x07" * 4
    assert not (d.run_dir / "control.sock").exists() and not (d.run_dir / "pages.sock").exists()


def test_unit_file_verifies():
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    unit = (REPO / "systemd" / "kvpool.service").read_text()
    exe = REPO / ".venv" / "bin" / "kvpool"
    if not exe.exists():
        exe = Path(shutil.which("kvpool") or "/bin/true")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvpool-{secrets.token_hex(4)}.service"
    tmp.write_text(unit.replace("/usr/local/bin/kvpool", str(exe)))
    try:
        out = subprocess.run([tool, "verify", str(tmp)], capture_output=True, text=True, timeout=60)
    finally:
        tmp.unlink()
    if out.returncode != 0 and "Failed to" in out.stderr and "kvpool" not in out.stderr:
        pytest.skip(f"systemd-analyze cannot run here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    assert "Type=notify" in unit and "RuntimeDirectoryMode=0750" in unit and "WatchdogSec" in unit
