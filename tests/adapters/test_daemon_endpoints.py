"""The daemon's endpoints file (issue 38 item 3: ``kvpool daemon --endpoints-file``): one
entry per server registered with it, kept current from real processes — two elastic
``kvpool serve`` servers, one put to sleep, one killed with SIGKILL (gone from the
file); the file names its writer (the daemon), a SIGKILLed daemon's file is known dead
and the next daemon rewrites it at once; hostile flags are one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from daemon.helpers import daemon_command, spawn_daemon, stop_daemon, wait_for, wait_ready
from kvpool.discovery import writer_of

from .serve_procs import REPO

DEADLINE_S = 60.0


def entries(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    doc = yaml.safe_load(path.read_text()) or {}
    return {e["labels"]["model"]: e for e in doc.get("endpoints") or []}


def test_the_file_follows_the_servers(tiny_model, start_daemon, servers, tmp_path) -> None:
    out = tmp_path / "eps" / "endpoints.yaml"
    out.parent.mkdir()
    d = start_daemon(budget="16MiB", extra=("--endpoints-file", str(out), "--endpoints-address",
                                            "10.9.8.7", "--endpoints-namespace", "ns2"))
    wait_for(lambda: out.exists(), DEADLINE_S, 0.05, "the file written at start")
    assert writer_of(out.read_text()).pid == d.proc.pid
    assert entries(out) == {}  # empty
    a = servers.start("a", run_dir=d.run_dir, idle_timeout=3600)
    b = servers.start("b", run_dir=d.run_dir, idle_timeout=3600)
    servers.wait_healthy()
    wait_for(lambda: set(entries(out)) == {"a", "b"}, DEADLINE_S, 0.1,
             f"both servers in the file: {out.read_text() if out.exists() else ''}")
    e = entries(out)
    for name, srv in (("a", a), ("b", b)):
        assert (e[name]["address"], e[name]["port"], e[name]["namespace"]) == (
            "10.9.8.7", srv.port, "ns2")
        assert e[name]["name"] == f"{name}-{srv.port}"
        assert e[name]["labels"]["llm-d.ai/engine-type"] == "kvpool"
        assert e[name]["labels"]["kvpool.io/state"] == "awake"
    assert sorted(p.name for p in out.parent.iterdir()) == ["endpoints.yaml"]  # no tmp left

    run = [sys.executable, "-m", "kvpool.cli.main"]
    slept = subprocess.run([*run, "sleep", "a", "--wait", "60", "--run-dir", str(d.run_dir)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert slept.returncode == 0, slept
    wait_for(lambda: entries(out)["a"]["labels"]["kvpool.io/state"] == "asleep",
             DEADLINE_S, 0.1, "a asleep in the file")

    b.kill(signal.SIGKILL)  # no goodbye: its session's end removes it
    b.proc.wait(30)
    wait_for(lambda: set(entries(out)) == {"a"}, DEADLINE_S, 0.1,
             f"b gone from the file: {out.read_text()}")

    stop_daemon(d)  # a clean stop: no endpoint left
    assert yaml.safe_load(out.read_text())["endpoints"] == []


def test_a_killed_daemons_file_is_known_dead_and_rewritten_at_the_next_start(
        tiny_model, start_daemon, servers, tmp_path) -> None:
    out = tmp_path / "endpoints.yaml"
    d = start_daemon(budget="16MiB", extra=("--endpoints-file", str(out)))
    servers.start("a", run_dir=d.run_dir, idle_timeout=3600)
    servers.wait_healthy()
    wait_for(lambda: set(entries(out)) == {"a"}, DEADLINE_S, 0.1, "a in the file")
    assert writer_of(out.read_text()).alive() is True
    d.proc.kill()  # SIGKILL: the daemon cannot empty its file
    d.proc.wait(30)
    assert set(entries(out)) == {"a"}  # its last entries stay...
    assert writer_of(out.read_text()).alive() is False  # ...known to be a dead writer's
    servers.close()
    run_dir = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))
    again = spawn_daemon(daemon_command(run_dir, "--endpoints-file", str(out)), run_dir,
                         run_dir.with_suffix(".log"), d.page_size, None, wait=False)
    try:
        wait_ready(again)
        wait_for(lambda: (w := writer_of(out.read_text())) is not None and w.pid != d.proc.pid,
                 DEADLINE_S, 0.05, "the file rewritten at the start")
        w = writer_of(out.read_text())
        assert w is not None and w.pid == again.proc.pid and w.alive() is True
        assert entries(out) == {}  # the dead daemon's entries went at the start
    finally:
        stop_daemon(again)


@pytest.mark.parametrize("flags, code, says", [
    (("--endpoints-address", "a b\nc"), 2, "--endpoints-address = 'a b\\nc': 'a b\\nc' is "
                                           "not an IP address or a DNS name"),
    (("--endpoints-namespace", "Not_A_Label"), 2, "--endpoints-namespace"),
    (("--endpoints-file", ""), 2, "--endpoints-file = '': must not be empty"),
    (("--endpoints-file", "/no/such/folder/endpoints.yaml"), 1,
     "cannot write the endpoints file /no/such/folder/endpoints.yaml"),
])
def test_hostile_flags_are_one_line(tmp_path, flags, code, says) -> None:
    run_dir = tmp_path / "run"
    cmd = daemon_command(run_dir, *flags)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={k: v for k, v in os.environ.items()
                              if not k.startswith("KVPOOL_")})
    assert out.returncode == code, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], out.stderr
