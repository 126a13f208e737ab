"""Issue 9 defect 4: the daemon never serves from a run directory someone else controls.

Real daemon processes; "another user" is uid 65534 through ``setpriv`` (we run as root).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from kvpool import paths

from .helpers import REPO, DaemonProc, daemon_command, spawn_daemon, stop_daemon, wait_ready

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv")


def as_nobody(*cmd: str) -> None:
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    "--", *cmd], check=True, timeout=30)


def daemon_cmd(run_dir: Path) -> list[str]:
    return daemon_command(run_dir)


def refused(run_dir: Path) -> str:
    """Start a daemon on ``run_dir``; it must exit at once with one clear line."""
    out = subprocess.run(daemon_cmd(run_dir), capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode != 0, f"daemon served from {run_dir}:\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture
def scratch():
    made: list[Path] = []

    def make(prefix: str) -> Path:
        p = Path("/tmp") / f"{prefix}-{uuid.uuid4().hex[:8]}"
        made.append(p)
        return p

    yield make
    for p in made:
        if p.is_symlink():
            p.unlink()
        else:
            shutil.rmtree(p, ignore_errors=True)


@pytest.fixture
def daemon_on():
    """``daemon_on(run_dir)`` -> a running :class:`DaemonProc` on an existing directory."""
    started: list[DaemonProc] = []

    def start(run_dir: Path) -> DaemonProc:
        d = spawn_daemon(daemon_cmd(run_dir), run_dir, run_dir.with_suffix(".log"), wait=False)
        started.append(d)
        wait_ready(d)
        return d

    yield start
    for d in started:
        stop_daemon(d)
        d.log.unlink(missing_ok=True)


def test_root_never_falls_back_to_tmp(monkeypatch):
    monkeypatch.delenv("KVPOOL_RUN_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    if os.geteuid() != 0:
        pytest.skip("root's default")
    assert paths.run_dir() == Path("/run/kvpool")


def test_a_created_run_dir_is_0750_and_ours(tmp_path):
    target = tmp_path / "a" / "kvpool"
    paths.ensure_run_dir(target)
    st = target.lstat()
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_uid == os.geteuid()


@needs_root
def test_a_run_dir_precreated_by_another_user_is_refused(scratch):
    run_dir = scratch("kvp-planted")
    as_nobody("mkdir", "-m", "0755", str(run_dir))
    line = refused(run_dir)
    assert f"owned by uid {NOBODY}" in line
    assert list(run_dir.iterdir()) == []  # no socket was ever created there
    assert run_dir.stat().st_uid == NOBODY and stat.S_IMODE(run_dir.stat().st_mode) == 0o755


@needs_root
def test_a_run_dir_under_another_users_directory_is_refused(scratch):
    parent = scratch("kvp-parent")
    as_nobody("mkdir", "-m", "0755", str(parent))
    line = refused(parent / "kvpool")
    assert "owned by uid 65534" in line
    assert not (parent / "kvpool").exists()


def test_a_symlinked_run_dir_is_not_followed(scratch):
    target = Path(tempfile.mkdtemp(prefix="kvp-target-"))
    try:
        os.chmod(target, 0o700)
        link = scratch("kvp-link")
        link.symlink_to(target)
        line = refused(link)
        assert "symlink" in line
        assert stat.S_IMODE(target.stat().st_mode) == 0o700  # never chmod'ed through the link
        assert list(target.iterdir()) == []
    finally:
        shutil.rmtree(target)


def test_a_world_writable_run_dir_is_refused(scratch):
    run_dir = scratch("kvp-open")
    run_dir.mkdir()
    os.chmod(run_dir, 0o1777)
    line = refused(run_dir)
    assert "writable by group or others" in line
    assert list(run_dir.iterdir()) == []


def test_planted_state_symlinks_are_replaced_not_followed(scratch, daemon_on, tmp_path):
    secret = tmp_path / "root-only"
    secret.write_text("root only")
    os.chmod(secret, 0o600)
    run_dir = scratch("kvp-state")
    run_dir.mkdir(mode=0o700)
    (run_dir / "state.tmp").symlink_to(secret)
    (run_dir / "state.json").symlink_to(secret)
    d = daemon_on(run_dir)
    with d.connect("writer"):  # registering saves state.json
        deadline = time.monotonic() + 20
        while not ((run_dir / "state.json").exists() and not (run_dir / "state.json").is_symlink()):
            assert time.monotonic() < deadline, d.logs()
            time.sleep(0.02)
        state = json.loads((run_dir / "state.json").read_text())
        assert [t["name"] for t in state["tenants"]] == ["writer"]
    assert secret.read_text() == "root only"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_write_private_replaces_a_symlink_and_read_private_refuses_one(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"keep")
    dest = tmp_path / "state.json"
    dest.symlink_to(secret)
    with pytest.raises(paths.UnsafePath):
        paths.read_private(dest)
    paths.write_private(dest, b"{}")
    assert secret.read_bytes() == b"keep"
    assert not dest.is_symlink() and paths.read_private(dest) == b"{}"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(paths.UnsafePath):
        paths.read_private(fifo)  # and does not block on it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "secret", "state.json"]
