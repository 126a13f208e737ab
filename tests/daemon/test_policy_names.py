"""Issue 9 (8): names are not identities. A configured tenant may say which uids or which
group may claim its name (and so its policy); a name a live session holds cannot be
taken by another session. Monitor and admin sessions claim no name."""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import sys

import pytest

from kvpool import protocol as p

from .helpers import PAGE, REPO
from .policy_helpers import code, session, stats


def test_a_name_held_by_a_live_session_cannot_be_taken(start_daemon):
    d = start_daemon(budget=str(16 * PAGE))
    first = session(d, "llama")
    second = session(d, None)
    try:
        got = code(lambda: second.call(p.Register(name="llama")))
        assert got == p.UNAUTHORIZED
        assert [t.name for t in stats(d).tenants if t.registered] == ["llama"]
        # monitors claim no name: two of them at once are fine, and so is one called llama
        with d.monitor(), d.monitor():
            watcher = session(d, "llama", kind="monitor")
            watcher.close()
        first.call(p.Bye())
        first.close()
        # once the holder is gone the name is free again
        third = session(d, "llama")
        third.close()
    finally:
        first.close()
        second.close()


CLAIM = """
import sys
from kvpool import protocol as p
from kvpool.client_lib.connection import Connection
from kvpool.client_lib.errors import KvpoolError
c = Connection(__import__("pathlib").Path(sys.argv[1]), timeout_s=20)
try:
    c.call(p.Register(name=sys.argv[2]))
    print("ok")
except KvpoolError as e:
    print(e.code)
c.close()
"""


def _group(name: str) -> int:
    if subprocess.run(["getent", "group", name], capture_output=True).returncode != 0:
        subprocess.run(["groupadd", name], check=True)
    return grp.getgrnam(name).gr_gid


def _claim_as_nobody(d, name: str, gids: list[int]) -> str:
    cmd = ["setpriv", "--reuid=65534", "--regid=65534",
           f"--groups={','.join(map(str, gids))}", "--", sys.executable, "-c", CLAIM,
           str(d.run_dir), name]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/tmp",
                         env={**os.environ, "PYTHONPATH": str(REPO), "HOME": "/tmp"})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_a_configured_name_is_claimed_only_by_its_uids_or_group(start_daemon, tmp_path):
    sockets = _group("kvpooltest")
    team = _group("kvpoolvip")
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text(f'[tenants.vip]\nmin = "50%"\nshares = 5\nuids = [{os.getuid()}]\n'
                   f'[tenants.team]\ngroup = "kvpoolvip"\n')
    d = start_daemon(budget=str(16 * PAGE), extra=("--config", str(cfg),
                                                   "--socket-group", "kvpooltest"))
    # an impostor that can connect registers first: refused, the policy is not its
    assert _claim_as_nobody(d, "vip", [sockets]) == p.UNAUTHORIZED
    assert _claim_as_nobody(d, "team", [sockets]) == p.UNAUTHORIZED
    # a member of the named group may claim "team"; anyone may claim an unconfigured name
    assert _claim_as_nobody(d, "team", [sockets, team]) == "ok"
    assert _claim_as_nobody(d, "someone", [sockets]) == "ok"
    # the real vip (a listed uid) gets its name and its policy
    vip = session(d, "vip")
    try:
        (t,) = [t for t in stats(d).tenants if t.name == "vip"]
        assert t.min == 8 * PAGE and t.shares == 5
    finally:
        vip.close()


def test_a_returning_tenants_name_is_kept_for_it_during_recovery(start_daemon, tmp_path):
    from .policy_helpers import restart

    cfg = tmp_path / "kvpool.toml"
    cfg.write_text("recover_timeout_s = 120\n")
    d = start_daemon(budget=str(16 * PAGE), extra=("--config", str(cfg)))
    before = session(d, "llama")
    restart(d, os.getpid())
    before.close()
    # another process grabs the name while the daemon waits for the real llama: refused
    out = subprocess.run([sys.executable, "-c", CLAIM, str(d.run_dir), "llama"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.stdout.strip() == p.UNAUTHORIZED, out
    back = session(d, "llama")  # the returning pid gets it
    back.close()


def test_set_limit_says_how_many_tenants_of_that_name_are_connected(start_daemon):
    d = start_daemon(budget=str(16 * PAGE))
    t = session(d, "engine1")
    try:
        with d.monitor() as m:
            assert m.set_limit("nosuch", 4 * PAGE).tenants == 0  # stored for later
            assert m.set_limit("monitor", 4 * PAGE).tenants == 0  # a monitor is no tenant
            got = m.set_limit("engine1", 4 * PAGE)
            assert got.tenants == 1 and got.applied
    finally:
        t.close()
    late = session(d, "nosuch")  # the stored limit applies when one registers
    try:
        (info,) = [x for x in stats(d).tenants if x.name == "nosuch"]
        assert info.max == 4 * PAGE
    finally:
        late.close()
