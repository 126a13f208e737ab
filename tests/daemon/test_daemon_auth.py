"""Issue 9 defect 5: a client authenticates its daemon before it maps anything.

The "fake daemon" is a real kvpool daemon run by another user (uid 65534, ``setpriv``)
in a run directory of its own under ``/tmp``: exactly what a local attacker can start.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest

from kvpool import paths
from kvpool.client_lib import Monitor, connect
from kvpool.client_lib.connection import UntrustedDaemon

from .helpers import PAGE, daemon_command, spawn_daemon, stop_daemon, wait_ready

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv")


@pytest.fixture
def fake_daemon():
    """A real daemon run by uid 65534 in ``/tmp/kvp-fake-*`` (it creates the directory)."""
    run_dir = Path("/tmp") / f"kvp-fake-{uuid.uuid4().hex[:8]}"
    log = Path(f"{run_dir}.log")
    setpriv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
               sys.executable, "-m", "kvpool.cli.main"]
    d = spawn_daemon(daemon_command(run_dir, launcher=setpriv), run_dir, log,
                     env={"PYTHONDONTWRITEBYTECODE": "1"}, wait=False)
    try:
        wait_ready(d)
        assert run_dir.stat().st_uid == NOBODY
        yield d
    finally:
        stop_daemon(d)
        shutil.rmtree(run_dir, ignore_errors=True)
        log.unlink(missing_ok=True)


def test_a_daemon_run_by_another_user_is_refused(fake_daemon, monkeypatch):
    monkeypatch.delenv("KVPOOL_DAEMON_UID", raising=False)
    with pytest.raises(UntrustedDaemon, match=f"owned by uid {NOBODY}"):
        connect(name="victim", run_dir=fake_daemon.run_dir)
    with pytest.raises(UntrustedDaemon):
        Monitor(fake_daemon.run_dir)
    out = fake_daemon.cli("ps", check=False)
    assert out.returncode != 0 and "not trusting the daemon" in out.stderr
    assert "Traceback" not in out.stderr
    # the refusal is the uid check: trusting that uid explicitly lets the same client in
    monkeypatch.setenv("KVPOOL_DAEMON_UID", str(NOBODY))
    with connect(name="consenting", run_dir=fake_daemon.run_dir) as t:
        t.region_group(1, 2 * PAGE).grant([0])


def test_the_peer_uid_is_checked_even_in_a_trusted_directory(fake_daemon, tmp_path, monkeypatch):
    """Hard links of the other user's sockets, re-owned to root, in a root-owned directory:
    every file looks trusted; only SO_PEERCRED tells who listens."""
    monkeypatch.delenv("KVPOOL_DAEMON_UID", raising=False)
    trusted_dir = tmp_path / "run"
    trusted_dir.mkdir(mode=0o750)
    for name in (paths.CONTROL_SOCKET, paths.PAGES_SOCKET):
        os.link(fake_daemon.run_dir / name, trusted_dir / name)
        os.chown(trusted_dir / name, 0, 0)
    with pytest.raises(UntrustedDaemon, match=f"runs as uid {NOBODY}"):
        connect(name="victim", run_dir=trusted_dir)
    with pytest.raises(UntrustedDaemon, match=f"runs as uid {NOBODY}"):
        Monitor(trusted_dir)


def test_a_bad_kvpool_daemon_uid_is_one_clear_error(daemon, monkeypatch):
    monkeypatch.setenv("KVPOOL_DAEMON_UID", "no-such-user-here")
    with pytest.raises(UntrustedDaemon, match="no user named"):
        Monitor(daemon.run_dir)


def test_trusted_uids_come_from_root_self_and_kvpool_daemon_uid():
    got = paths.trusted_daemon_uids({"KVPOOL_DAEMON_UID": "nobody, 1234"})
    assert {0, os.getuid(), NOBODY, 1234} <= got
    assert NOBODY not in paths.trusted_daemon_uids({}) or _kvpool_user_is(NOBODY)
    with pytest.raises(ValueError, match="no user named"):
        paths.trusted_daemon_uids({"KVPOOL_DAEMON_UID": "no-such-user-here"})


def _kvpool_user_is(uid: int) -> bool:
    import pwd

    try:
        return pwd.getpwnam(paths.SYSTEM_USER).pw_uid == uid
    except KeyError:
        return False
