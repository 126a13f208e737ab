"""Daemon behaviour through its real sockets: sessions, limits, errors, config, CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import zmq

from kvpool import fdchannel, paths
from kvpool import protocol as p
from kvpool.client_lib import NoMemory, OverLimit, connect
from kvpool.client_lib.connection import Connection

from .helpers import PAGE, REPO, daemon_command, read_line, wait_for


def raw_session(d):
    """An fd-channel session plus a DEALER, without registering."""
    fd = fdchannel.connect(str(paths.pages_path(d.run_dir)))
    hello = p.decode_hello(fd.recv(4096))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(paths.control_endpoint(d.run_dir))
    return fd, hello, sock


def rpc(sock, req: p.Request) -> p.Reply:
    sock.send(p.encode(req))
    assert sock.poll(5000)
    return p.decode_reply(sock.recv())


def test_handshake_version_and_device_checks(daemon):
    fd, hello, sock = raw_session(daemon)
    assert hello.backend == "host" and hello.page_size == PAGE and len(hello.token) == 32
    r = rpc(sock, p.Register(id=1, token=hello.token, name="x", version=p.VERSION + 1))
    assert isinstance(r, p.Error) and r.code == p.VERSION_MISMATCH and r.id == 1
    r = rpc(sock, p.Register(id=2, token=hello.token, name="x", device=3))
    assert isinstance(r, p.Error) and r.code == p.NOT_FOUND
    r = rpc(sock, p.Register(id=3, token="0" * 32, name="x"))
    assert isinstance(r, p.Error) and r.code == p.UNAUTHORIZED
    r = rpc(sock, p.Grant(id=4, token=hello.token, group=1, units=[0]))
    assert isinstance(r, p.Error) and r.code == p.UNAUTHORIZED  # not registered yet
    r = rpc(sock, p.Register(id=5, token=hello.token, name="x"))
    assert isinstance(r, p.Registered) and r.page_size == PAGE
    r = rpc(sock, p.Register(id=6, token=hello.token, name="x"))
    assert isinstance(r, p.Error) and r.code == p.BAD_REQUEST
    sock.close()
    fd.close()


def test_no_memory_and_over_limit_leave_others_alone(start_daemon):
    d = start_daemon(budget=str(16 * PAGE))
    with connect(name="a", run_dir=d.run_dir) as a, connect(name="b", run_dir=d.run_dir) as b:
        ga = a.region_group(2, 16 * PAGE)
        gb = b.region_group(1, 16 * PAGE)
        ga.grant(range(6))  # 12 pages
        with pytest.raises(NoMemory):
            gb.grant(range(5))  # 5 > 4 left
        assert not gb.mapped
        gb.grant(range(4))
        d.cli("limit", "a", str(12 * PAGE))
        ga.release([0])
        with pytest.raises(OverLimit):
            ga.grant([0, 7])  # 10 + 4 > 12 pages
        ga.grant([0])
        ps = {t["name"]: t for t in d.cli_json("ps")["tenants"]}
        assert ps["a"]["max"] == 12 * PAGE and ps["a"]["mapped"] == 12 * PAGE
        assert ps["b"]["mapped"] == 4 * PAGE
        assert d.check() == []
    s = d.stats()
    assert s.pool.granted == 0 and s.pool.created <= 16


def test_bye_and_close_return_everything(daemon):
    t = connect(name="closer", run_dir=daemon.run_dir)
    g = t.region_group(3, 8 * PAGE)
    g.grant(range(8))
    assert daemon.stats().pool.granted == 24 * PAGE
    t.close()
    t.close()  # idempotent
    s = daemon.stats()
    assert s.pool.granted == 0 and not s.tenants


def test_unregistered_sessions_time_out(start_daemon, tmp_path):
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text('register_timeout_s = 1.0\nliveness_s = 0.05\nwarm_min = "4p"\n')
    d = start_daemon(extra=("--config", str(cfg)))
    with d.monitor() as m:  # in-process: a CLI start-up could outlast the timeout
        fd, hello, sock = raw_session(d)
        assert [t.registered for t in m.ps().tenants] == [False]
        wait_for(lambda: not m.ps().tenants, 20.0, what="the unregistered session dropped")
    assert d.cli_json("ps")["tenants"] == []
    assert fd.recv(16) == b""  # the daemon hung up
    assert d.stats().pool.warm == 4 * PAGE  # warm_min honoured
    sock.close()
    fd.close()


def test_stolen_token_from_another_socket_is_refused(daemon):
    with connect(name="owner", run_dir=daemon.run_dir) as t:
        g = t.region_group(1, 4 * PAGE)
        thief = zmq.Context.instance().socket(zmq.DEALER)
        thief.setsockopt(zmq.LINGER, 0)
        thief.connect(paths.control_endpoint(daemon.run_dir))
        r = rpc(thief, p.Grant(id=9, token=t.conn.token, group=g.id, units=[0]))
        assert isinstance(r, p.Error) and r.code == p.UNAUTHORIZED
        thief.close()
        g.grant([0])  # the owner is unaffected


def test_fd_channel_junk_is_ignored_and_fds_closed(daemon):
    with connect(name="junk", run_dir=daemon.run_dir) as t:
        r, w = os.pipe()
        fdchannel.send_fds(t.conn.fdsock, b"hello daemon", [r, w])
        os.close(r)
        os.close(w)
        t.ping()
        g = t.region_group(1, 2 * PAGE)
        g.grant([1])
    assert daemon.check() == []


def test_second_daemon_refuses_the_same_run_dir(daemon):
    out = subprocess.run(
        daemon_command(daemon.run_dir, budget="1MiB"),
        capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode != 0 and "already serves" in out.stderr
    assert daemon.stats().pool.budget == 8 << 20  # the first one still serves


@pytest.mark.parametrize("args,needle", [
    (["--budget", "12XB"], "unknown size unit"),
    (["--budget", "lots"], "cannot parse size"),
    (["--page-size", "10%"], "percentage is not allowed"),
    (["--budget", "150%"], "more than 100%"),
])
def test_daemon_rejects_bad_sizes(args, needle, tmp_path):
    out = subprocess.run(
        daemon_command(tmp_path / "rd", *args, budget=None, page_size=None),
        capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


def test_cli_errors_without_daemon_and_bad_limit(daemon, tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "ps", "--run-dir",
                          str(tmp_path / "none")], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1 and "no kvpool daemon" in out.stderr
    out = daemon.cli("limit", "x", "lots", check=False)
    assert out.returncode == 2 and "cannot parse size" in out.stderr
    assert daemon.cli("limit", "x", "25%").stdout.strip() == (
        "no tenant named x is connected: limit of x set to 2 MiB, to apply when one registers")
    assert daemon.cli_json("limit", "x", "1MiB") == {"tenant": "x", "max": 1 << 20,
                                                      "connected": 0, "applied": True,
                                                      "pending": 0}


def test_ps_and_check_human_output(daemon):
    with connect(name="shown", run_dir=daemon.run_dir) as t:
        g = t.region_group(2, 4 * PAGE)
        g.grant([0, 1])
        text = daemon.cli("ps").stdout
        assert "shown" in text and "256 KiB" in text
        assert daemon.cli("check").stdout.strip() == "ok"
        assert daemon.cli_json("check") == {"ok": True, "problems": []}


def test_tenant_death_by_pid_without_eof(start_daemon):
    """A child that inherited the fd channel keeps it open: the pidfd still tells."""
    d = start_daemon()
    code = (
        "import os, sys, time\n"
        "from kvpool.client_lib import connect\n"
        f"t = connect(name='parent', run_dir={str(d.run_dir)!r})\n"
        "g = t.region_group(1, 8 * 65536); g.grant(range(4))\n"
        "os.set_inheritable(t.conn.fdsock.fileno(), True)\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(30); os._exit(0)\n"
        "print('ready', child, flush=True); time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    child = None
    try:
        word, child = (read_line(proc) or "").split()
        assert word == "ready"
        assert d.stats().pool.granted == 4 * PAGE
        proc.kill()
        proc.wait()
        # generous: the latency is benchmarked, not tested
        wait_for(lambda: d.stats().pool.granted == 0, 20.0,
                 what="the dead parent's pages back")
    finally:
        proc.kill()
        proc.stdout.close()
        if child is not None:
            os.kill(int(child), signal.SIGKILL)


def test_connection_demultiplexes_unsolicited_and_stale_replies(tmp_path):
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(paths.control_endpoint(tmp_path))
    conn = Connection(tmp_path, timeout_s=5, fd_channel=False)
    import threading

    def serve():
        ident, frame = router.recv_multipart()
        req = p.decode_request(frame)
        router.send_multipart([ident, p.encode(p.Reclaim(bytes=1 << 20, reason="test"))])
        router.send_multipart([ident, p.encode(p.Done(id=req.id + 100))])  # stale
        router.send_multipart([ident, p.encode(p.Done(id=req.id))])
        router.send_multipart([ident, p.encode(p.Reclaim(bytes=2 << 20))])

    th = threading.Thread(target=serve)
    th.start()
    reply, fds = conn.call(p.Ping())
    th.join()
    assert isinstance(reply, p.Done) and fds == []
    msgs: list = []  # the Reclaim sent after the Done may still be on its way
    wait_for(lambda: msgs.extend(conn.poll()) or len(msgs) >= 2, 10.0,
             what="both unsolicited messages")
    assert [m.bytes for m in msgs] == [1 << 20, 2 << 20]
    conn.close()
    router.close()


def test_the_daemon_process_never_loads_torch(daemon):
    with connect(name="probe", run_dir=daemon.run_dir) as t:
        t.region_group(1, 2 * PAGE).grant([0])
        maps = open(f"/proc/{daemon.pid}/maps").read()
    assert "libtorch" not in maps and "torch/_C" not in maps
