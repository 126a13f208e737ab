"""``locate`` and registered endpoints: a tenant finds another by name only when that one
may hand pages to it (same uid, or a configured pairing across uids), unknown names and
unpaired tenants get the same NOT_FOUND line, monitors may not ask, and a hostile
endpoint string is refused at register while the daemon keeps serving everyone else.
Real daemon processes (the cross-uid cases also on the arbiter alone, so they run
without root)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from kvpool import protocol as p
from kvpool.client_lib import KvpoolError
from kvpool.daemon.arbiter import Arbiter
from kvpool.daemon.config import Config, TenantPolicy
from kvpool.daemon.pool import Pool
from kvpool.vmm.host import HostBackend

from .helpers import PAGE, REPO
from .rawpeer import RawPeer
from .test_handoff import _other_uid_daemon

OLD_URL = "http://127.0.0.1:18123"


def test_a_tenant_of_the_same_uid_is_located_with_its_endpoint(daemon):
    d = daemon
    with d.connect("old", endpoint=OLD_URL) as old, d.connect("new") as new:
        got = new.locate("old")
        assert (got.name, got.tenant, got.pid, got.endpoint) == ("old", old.id, os.getpid(),
                                                                 OLD_URL)
        assert old.locate("new").endpoint == ""  # registered without one
        with pytest.raises(KvpoolError, match="no tenant 'ghost'") as err:
            new.locate("ghost")
        assert err.value.code == p.NOT_FOUND
        with pytest.raises(KvpoolError, match="own name") as err:
            new.locate("new")
        assert err.value.code == p.NOT_FOUND
        # ps shows it: the JSON and the table
        assert endpoints_of(d) == {"old": OLD_URL, "new": ""}
        table = d.cli("ps").stdout
        assert "ENDPOINT" in table and OLD_URL in table, table
    assert d.check() == []


def test_a_monitor_may_not_locate(daemon):
    with daemon.connect("old", endpoint=OLD_URL):
        peer = RawPeer(daemon.run_dir)
        try:
            peer.register("new", kind="monitor")
            reply = peer.call(p.Locate(name="old"))
            assert isinstance(reply, p.Error) and reply.code == p.UNAUTHORIZED, reply
            assert "monitor" in reply.message
        finally:
            peer.close()


HOSTILE = [
    "http://10.0.0.1:8000", "http://example.com:80", "https://127.0.0.1:8000",
    "http://127.0.0.1", "http://127.0.0.1:0", "http://127.0.0.1:70000",
    "http://127.0.0.1:8000/pd/retire", "http://user@127.0.0.1:8000", "http://[::2]:80",
    "http://127.999.0.1:80", "http://localhost.evil:80", "file:///etc/passwd",
    "ftp://127.0.0.1:21", "", " http://127.0.0.1:80", "http://127.0.0.1:80\n",
    "http://127.0.0.1:8000?x=1", "\x00", "\u00e9\u00e9", "unix:/run/x.sock",
]


def test_hostile_endpoints_are_refused_at_register(daemon):
    d = daemon
    with d.connect("bystander") as bystander:
        g = bystander.region_group(1, 4 * PAGE)
        for bad in HOSTILE:
            peer = RawPeer(d.run_dir)
            try:
                reply = peer.call(p.Register(name="liar", endpoint=bad))
                assert isinstance(reply, p.Error), (bad, reply)
                assert reply.code == p.BAD_REQUEST and "\n" not in reply.message.strip(), reply
                assert "loopback" in reply.message or "port" in reply.message \
                    or "address" in reply.message, (bad, reply.message)
                # the session is not registered: it may register again, honestly
                assert isinstance(peer.call(p.Register(name="liar")), p.Registered)
            finally:
                peer.close()
        for frame in (  # what a typed client cannot send: overlong, not a string
            {"endpoint": "http://127.0.0.1:1" + "0" * p.MAX_ENDPOINT},
            {"endpoint": 8000}, {"endpoint": ["http://127.0.0.1:1"]}, {"endpoint": b"\xff"},
        ):
            peer = RawPeer(d.run_dir)
            try:
                peer.sock.send(p.encode({"op": "register", "id": 1, "token": peer.token,
                                         "name": "liar", **frame}))
                reply = peer.recv()
                assert isinstance(reply, p.Error) and reply.code == p.BAD_REQUEST, (frame, reply)
            finally:
                peer.close()
        peer = RawPeer(d.run_dir)  # a monitor serves nothing
        try:
            reply = peer.call(p.Register(name="m", kind="monitor", endpoint=OLD_URL))
            assert isinstance(reply, p.Error) and "serves nothing" in reply.message, reply
        finally:
            peer.close()
        g.grant([0, 1])  # the daemon kept serving
        assert g.mapped == {0, 1}
        for good in ("http://[::1]:1", "http://localhost:65535", "http://127.1.2.3:8000"):
            with d.connect("honest", endpoint=good) as t:
                assert t.locate("bystander").name == "bystander"
                assert bystander.locate("honest").endpoint == good
    assert d.check() == []


# ---- across uids: on the arbiter alone (any user), then with real processes (root) ----
def _sessions(pairs: dict[str, TenantPolicy]):
    backend = HostBackend(page_size=PAGE)
    pool = Pool(backend, 16)
    arb = Arbiter(Config(budget=16 * PAGE, tenants=pairs), pool, 16 * PAGE)
    socks: list[socket.socket] = []

    def session(name: str, uid: int, kind: str = "engine", endpoint: str | None = None):
        x, y = socket.socketpair()
        socks.extend((x, y))
        t = arb.open_session(x, 4000 + len(socks), uid, uid, None)
        out = arb.handle(name.encode(), p.Register(id=1, token=t.token, name=name, kind=kind,
                                                   endpoint=endpoint))
        assert isinstance(out.reply, p.Registered), out.reply
        return lambda req: arb.handle(name.encode(), _with(req, t.token)).reply

    def close() -> None:
        for s in socks:
            s.close()
        pool.close()
        backend.close()

    return session, close


def _with(req: p.Request, token: str) -> p.Request:
    req.id, req.token = 2, token
    return req


@pytest.mark.parametrize("paired", [False, True])
def test_across_uids_only_a_configured_pairing_locates(paired):
    policy = {"old": TenantPolicy(handoff_to=["new"], uids=[1000])} if paired else {}
    session, close = _sessions(policy)
    try:
        session("old", uid=1000, endpoint=OLD_URL)
        new = session("new", uid=2000)
        other = session("other", uid=2000)  # the pairing names "new" only
        got = new(p.Locate(name="old"))
        if paired:
            assert isinstance(got, p.Located) and got.endpoint == OLD_URL, got
        else:
            assert isinstance(got, p.Error) and got.code == p.NOT_FOUND, got
            unknown = new(p.Locate(name="nobody"))  # the same line as a name nobody holds
            assert got.message == unknown.message.replace("'nobody'", "'old'"), (got, unknown)
        refused = other(p.Locate(name="old"))
        assert isinstance(refused, p.Error) and refused.code == p.NOT_FOUND, refused
        assert isinstance(other(p.Locate(name="new")), p.Located)  # same uid
    finally:
        close()


@pytest.mark.parametrize("paired", [False, True])
def test_as_giver_the_direction_turns(paired):
    """``Locate(as_giver=True)``: the asker is the giver (a retiring server checking who
    asks it): "old" finds "new" with its pid and uid only when it may hand pages to it,
    and the pairing old -> new does not let "new" find "old" that way."""
    policy = {"old": TenantPolicy(handoff_to=["new"], uids=[1000])} if paired else {}
    session, close = _sessions(policy)
    try:
        old = session("old", uid=1000, endpoint=OLD_URL)
        new = session("new", uid=2000)
        got = old(p.Locate(name="new", as_giver=True))
        if paired:
            assert isinstance(got, p.Located) and (got.name, got.uid) == ("new", 2000), got
            assert got.pid > 4000, got  # the session's pid (SO_PEERCRED; here made up)
        else:
            assert isinstance(got, p.Error) and got.code == p.NOT_FOUND, got
            assert "that 'old' may hand pages to" in got.message, got
        back = new(p.Locate(name="old", as_giver=True))  # new may not give to old
        assert isinstance(back, p.Error) and back.code == p.NOT_FOUND, back
    finally:
        close()


def test_a_claim_naming_its_giver_takes_only_that_tenants_offer(daemon):
    """``Claim.giver``: a ticket another tenant offered is refused (UNAUTHORIZED), nothing
    moves and the ticket stays claimable; naming the real giver (or none) claims it."""
    from kvpool.client_lib import handoff

    d = daemon
    with d.connect("real") as real, d.connect("other") as other, d.connect("new") as new:
        gr, go = real.region_group(1, 4 * PAGE), other.region_group(1, 4 * PAGE)
        gr.grant([0])
        go.grant([0])
        ticket = handoff.offer(go, [0], to="new", ttl_s=60)
        gn = new.region_group(1, 4 * PAGE)
        handoff.of(new).expect_giver(real.id)  # as a successor that located "real"
        with pytest.raises(KvpoolError, match="offered by tenant 'other'") as err:
            handoff.claim(gn, ticket, [0])
        assert err.value.code == p.UNAUTHORIZED
        assert not ticket.settled and 0 in go.mapped and 0 not in gn.mapped
        mapped = {t.name: t.mapped for t in d.stats().tenants}
        assert mapped == {"real": PAGE, "other": PAGE, "new": 0}, mapped
        with pytest.raises(KvpoolError, match="offered by tenant 'other'"):
            handoff.claim(gn, ticket, [0], giver=real.id)  # explicit, same
        assert handoff.claim(gn, ticket, [0], giver=other.id) == [0]  # the real giver
        assert ticket.wait(30) == "claimed" and 0 in gn.mapped
        mapped = {t.name: t.mapped for t in d.stats().tenants}
        assert mapped == {"real": PAGE, "other": 0, "new": PAGE}, mapped
    assert d.check() == []


LOCATE = """
import json, sys
from kvpool.client_lib import KvpoolError, connect
with connect(name="decode", run_dir=sys.argv[1]) as t:
    try:
        r = t.locate("prefill")
        print(json.dumps({"ok": True, "endpoint": r.endpoint, "pid": r.pid}))
    except KvpoolError as e:
        print(json.dumps({"ok": False, "code": e.code, "message": str(e)}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
@pytest.mark.parametrize("paired", [False, True])
def test_another_uid_locates_only_with_a_pairing(start_daemon, tmp_path, paired):
    """uid 65534's ``decode`` locates root's ``prefill`` only when the config pairs them
    (``[tenants.prefill] handoff_to = ["decode"]``)."""
    d, nobody = _other_uid_daemon(start_daemon, tmp_path, pairing=paired)
    with d.connect("prefill", endpoint=OLD_URL):
        out = subprocess.run([*nobody, sys.executable, "-c", LOCATE, str(d.run_dir)],
                             capture_output=True, text=True, timeout=60, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO), "HOME": "/tmp"})
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        if paired:
            assert got == {"ok": True, "endpoint": OLD_URL, "pid": os.getpid()}, got
        else:
            assert got["ok"] is False and got["code"] == p.NOT_FOUND, got
            assert "no tenant 'prefill'" in got["message"], got
    assert d.check() == []


def test_the_endpoint_survives_a_daemon_restart(daemon):
    """A tenant re-registers with its endpoint after the daemon restarts (the client keeps
    the whole Register), so a successor still finds it."""
    from .policy_helpers import restart
    from .test_handoff import wait_for

    d = daemon
    with d.connect("old", endpoint=OLD_URL) as old:
        restart(d, os.getpid())
        wait_for(lambda: old.reconnects == 1, "the tenant re-registered")
        with d.connect("new") as new:
            assert new.locate("old").endpoint == OLD_URL
        assert endpoints_of(d) == {"old": OLD_URL}
    assert d.check() == []


def endpoints_of(d) -> dict[str, str]:
    """tenant -> endpoint, as `kvpool ps --json` shows them."""
    return {t["name"]: t["endpoint"] for t in d.cli_json("ps")["tenants"]}
