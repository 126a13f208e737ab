"""`kvpool serve --elastic --handoff-from TENANT` as real processes: the new server finds
the running one through the daemon by its tenant name (the endpoint it registered,
``Locate``), takes its prefix cache over as pages and serves the repeated prompt with
cache hits; the old one is retired and the memory is accounted once. A name that cannot
be taken over (unknown, no endpoint, nothing listening, another process listening)
ends the new server with one line and a nonzero exit, the old one untouched."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from daemon.conftest import start_daemon  # noqa: F401  (fixture)
from daemon.helpers import PAGE, REPO
from daemon.test_locate import endpoints_of as endpoints  # tenant -> endpoint (ps --json)
from kvpool import launch
from kvpool.client_lib import KvpoolError

from .test_pd_handoff import accounted
from .test_pd_serve import free_port
from .test_warm_serve import complete, serve


def test_a_new_server_takes_over_by_tenant_name(start_daemon, tiny_dir, tmp_path):
    d = start_daemon(budget="8MiB")
    old, old_url = serve(d, tiny_dir, tmp_path / "old.log", tenant="tiny")
    first = complete(old_url, 130)
    assert endpoints(d) == {"tiny": old_url}  # the bridge registered where it serves
    new, url = serve(d, tiny_dir, tmp_path / "new.log", "--handoff-from", "tiny",
                     tenant="tiny-next")
    assert "tenant tiny (pid %d) serves at %s" % (old.pid, old_url) in (
        tmp_path / "new.log").read_text()
    # the old server is retired: no more requests, unhealthy
    assert httpx.get(f"{old_url}/health").status_code == 503
    r = httpx.post(f"{old_url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 400 and "retired" in r.text
    # the new one hits the old one's cache, same tokens
    assert complete(url, 130) == first
    stats = httpx.get(f"{url}/v1/stats").json()
    assert stats["prefix_hit_tokens"] >= 128 - 16, stats["prefix_hit_tokens"]
    # both tenants are there, the memory is accounted once; `kvpool check` is clean
    assert sorted(accounted(d)) == ["tiny", "tiny-next"]
    assert endpoints(d) == {"tiny": old_url, "tiny-next": url}
    assert d.check() == [] and d.cli("check").returncode == 0
    old.terminate()
    old.wait(30)
    assert complete(url, 130) == first
    assert sorted(accounted(d)) == ["tiny-next"] and d.check() == []


def failed_start(d, tiny_dir, log, source: str) -> str:
    """Start a server taking over ``source``; it must exit nonzero. Its one-line error."""
    with pytest.raises(launch.ChildStartError, match="exited with code [1-9]"):
        serve(d, tiny_dir, log, "--handoff-from", source, tenant="tiny-next")
    text = log.read_text()
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, text
    return errors[0]


def test_a_name_that_cannot_be_taken_over_ends_the_new_server(start_daemon, tiny_dir,
                                                              tmp_path):
    d = start_daemon(budget="8MiB")
    old, old_url = serve(d, tiny_dir, tmp_path / "old.log", tenant="tiny")
    first = complete(old_url, 130)
    with pytest.raises(KvpoolError, match="one endpoint per live tenant"):
        d.connect("liar", endpoint=old_url)  # a live tenant's endpoint: refused at register
    other = listener(d)  # a server of another process, no tenant: the liar names it
    with d.connect("bare"), d.connect("dead", endpoint=f"http://127.0.0.1:{free_port()}"), \
            d.connect("liar", endpoint=other[1]):  # (this test's pid, not the server's)
        cases = {"ghost": "no tenant 'ghost' that may hand pages to 'tiny-next'",
                 "bare": "registered no endpoint", "dead": "nothing listens on port",
                 "liar": f"is served by pid {other[0].pid}, not by tenant 'liar'"}
        for source, why in cases.items():
            line = failed_start(d, tiny_dir, tmp_path / f"{source}.log", source)
            assert f"--handoff-from {source}: " in line and why in line, line
            assert "tiny-next" not in accounted(d)  # its tenant is gone, nothing adopted
    # the old server was never asked: it serves on, from its cache
    assert httpx.get(f"{old_url}/health").status_code == 200
    assert complete(old_url, 130) == first
    assert httpx.get(f"{old_url}/v1/stats").json()["prefix_hit_tokens"] >= 128 - 16
    assert sorted(accounted(d)) == ["tiny"] and d.check() == []


def listener(d) -> tuple[subprocess.Popen, str]:
    """An HTTP server in a process of its own (no tenant) and its endpoint."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    d.workers.append(proc)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "no listener"
            time.sleep(0.05)


# ---- who may ask a server to retire (kvpool.elastic_server.retire_auth) ------
HOLDER = """
import sys
from kvpool.client_lib import connect
with connect(name=sys.argv[2], run_dir=sys.argv[1]):
    print("ready", flush=True)
    sys.stdin.read()
"""


def hold_tenant(d, name: str) -> subprocess.Popen:
    """A tenant called ``name`` in a process of its own (not this test's)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(d.run_dir), name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    d.workers.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def retire(server: str, to: str, **kw) -> httpx.Response:
    return httpx.post(f"{server}/pd/retire", json={"to": to, "in_flight": False, **kw},
                      timeout=60)


def test_only_the_named_tenant_may_ask_a_server_to_retire(start_daemon, tiny_dir, tmp_path):
    d = start_daemon(budget="8MiB")
    old, old_url = serve(d, tiny_dir, tmp_path / "old.log", tenant="tiny")
    first = complete(old_url, 130)
    hold_tenant(d, "other")  # a real tenant, in another process than the one asking
    with d.connect("asker"):  # this test's own process is tenant "asker"
        refused = {"other": "did not come from tenant 'other'",
                   "ghost": "no tenant 'ghost' that 'tiny' may hand pages to"}
        for to, why in refused.items():
            r = retire(old_url, to)
            assert r.status_code == 403 and why in r.text, r.text
        # even the right process may not have this server relay its clients elsewhere
        r = retire(old_url, "asker", ttl_s=1, url="http://127.0.0.1:9")
        assert r.status_code == 403 and "is not the endpoint" in r.text, r.text
        for ttl in (0.5, 61, 3600):  # even from the right process: the ttl is bounded
            r = retire(old_url, "asker", ttl_s=ttl)
            assert r.status_code == 400 and "is not in 1..60 s" in r.text, r.text
        # untouched: it serves new requests at once, from its cache
        assert httpx.get(f"{old_url}/health").status_code == 200
        assert complete(old_url, 130) == first
        assert httpx.get(f"{old_url}/v1/stats").json()["prefix_hit_tokens"] >= 128 - 16
        # the named tenant's own process is let through: an offer to it, which expires
        r = retire(old_url, "asker", ttl_s=1)
        assert r.status_code == 200 and r.json()["cache"]["ticket"], r.text
        assert complete(old_url, 130) == first  # (waits for the expiry, then serves on)
    assert httpx.get(f"{old_url}/health").status_code == 200
    assert sorted(accounted(d)) == ["other", "tiny"] and d.check() == []


def test_a_cache_offered_by_another_tenant_than_the_located_one_is_refused(
        start_daemon, tiny_dir, tmp_path):
    """Tenant "liar" serves its registered endpoint itself (this test's process), so the
    listener check passes, and answers /pd/retire with a ticket tenant "other" offered
    to the new server: the claim is refused (it names liar's tenant id), nothing is
    adopted, other keeps its pages and its ticket."""
    from kvpool.client_lib import handoff

    d = start_daemon(budget="8MiB")
    port = free_port()
    with d.connect("liar", endpoint=f"http://127.0.0.1:{port}"), d.connect("other") as other:
        g = other.region_group(1, 4 * PAGE)  # the tiny engine's layout on CPU: one region,
        g.grant([0])  # 16-token blocks of 16 KiB, 4 blocks in a 64 KiB page
        ticket = handoff.offer(g, [0], to="tiny-next", ttl_s=120)
        cache = {"ticket": ticket.id, "chunks": [0], "blocks_per_chunk": PAGE // (16 << 10),
                 "pages_per_chunk": 1, "entries": [], "requests": []}
        server = answer_retire({"cache": cache}, port)
        try:
            line = failed_start(d, tiny_dir, tmp_path / "new.log", "liar")
        finally:
            server.shutdown()
        assert "cannot be claimed" in line and "offered by tenant 'other'" in line, line
        assert "tiny-next" not in accounted(d)
        assert not ticket.settled and 0 in g.mapped  # other's offer stands, its pages too
        assert handoff.cancel(other, ticket) and 0 in g.mapped
        assert accounted(d) == {"liar": 0, "other": PAGE} and d.check() == []


def answer_retire(reply: dict, port: int) -> ThreadingHTTPServer:
    """A loopback HTTP server in this process answering POST /pd/retire with ``reply``."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


PEEK = """
import json, sys
from kvpool.elastic_server import retire_auth
pid, cport, sport = map(int, sys.argv[1:4])
try:
    retire_auth.check_connection("new", pid, ("127.0.0.1", cport), ("127.0.0.1", sport))
    print(json.dumps({"ok": True}))
except retire_auth.Refused as e:
    print(json.dumps({"ok": False, "status": e.status, "line": e.line}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv")
def test_a_server_that_cannot_see_the_askers_sockets_refuses():
    """The connection check as root (it sees this process's sockets: the real connection
    passes, another port does not) and as uid 65534 (it cannot: refused, one line, never
    guessed)."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    sport, cport = listener.getsockname()[1], client.getsockname()[1]

    def peek(*prefix: str, port: int = cport) -> dict:
        out = subprocess.run([*prefix, sys.executable, "-c", PEEK, str(os.getpid()),
                              str(port), str(sport)], capture_output=True, text=True,
                             timeout=120, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO), "HOME": "/tmp"})
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    try:
        assert peek() == {"ok": True}
        other = peek(port=free_port())
        assert other["status"] == 403 and "did not come from tenant 'new'" in other["line"]
        blind = peek("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")
        assert blind["status"] == 403 and "runs as another user" in blind["line"], blind
        assert "\n" not in blind["line"]
    finally:
        for s in (accepted, client, listener):
            s.close()
