"""`kvpool serve --elastic --handoff-from URL` as real processes: the new server takes the
running one's prefix cache over as pages, serves the repeated prompts with cache hits and
the same tokens; the old one is retired (refuses requests, /health 503) and the memory is
accounted once.

With generations in flight (streaming and not, and one sent during the handover): every
client, still connected to the old server, gets exactly an uninterrupted engine's greedy
tokens and text, computed on the new server; a client that hangs up on the old server
stops its request on the new one; a new server killed while the offer is out loses
nothing: the old one serves everything on. The relay endpoints answer only the server
taken over from (403 to anyone else; their input checks: test_pd_route_attacks.py).

The old server is held with SIGSTOP while the new one starts, so the takeover surely
comes mid-generation (no timing is assumed): the new server's connection to it shows
that /pd/retire is on its way."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from daemon.conftest import start_daemon  # noqa: F401  (fixture)
from daemon.helpers import REPO
from kvpool.engine import Engine, EngineConfig, SamplingParams

from .test_pd_handoff import GREEDY, KV, accounted, prompt, wait_for
from .test_pd_serve import body, free_port, healthy, stream_choices


def serve(d, model, log, *args: str, tenant: str = "tiny", kv: str = KV
          ) -> tuple[subprocess.Popen, str]:
    proc, url = launch(d, model, log, *args, tenant=tenant, kv=kv)
    healthy(proc, url, log)
    return proc, url


def launch(d, model, log, *args: str, tenant: str = "tiny", kv: str = KV
           ) -> tuple[subprocess.Popen, str]:
    """Start an elastic server without waiting for it."""
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")},
           "KVPOOL_RUN_DIR": str(d.run_dir), "KVPOOL_IDLE_TIMEOUT": "600",  # keep the cache
           "KVPOOL_TENANT": tenant, "PYTHONPATH": str(REPO),
           "PYTHONFAULTHANDLER": "1"}  # SIGABRT writes every thread's stack to its log
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "serve", str(model), "--elastic",
             "--port", str(port), "--kv-cache-size", kv, "--served-model-name", "tiny",
             "--log-level", "warning", *args],
            stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    d.workers.append(proc)
    return proc, f"http://127.0.0.1:{port}"


def complete(url: str, n: int) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", json=body(n), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_a_new_server_takes_over_the_cache(start_daemon, tiny_dir, tmp_path):
    d = start_daemon(budget="8MiB")
    old, old_url = serve(d, tiny_dir, tmp_path / "old.log")
    first = complete(old_url, 130)
    assert httpx.get(f"{old_url}/v1/stats").json()["prefix_hit_tokens"] == 0
    new, url = serve(d, tiny_dir, tmp_path / "new.log", "--handoff-from", old_url,
                     tenant="tiny-next")  # tenant names are unique while both run
    # the old server is retired: no more requests, unhealthy
    assert httpx.get(f"{old_url}/health").status_code == 503
    r = httpx.post(f"{old_url}/v1/completions", json=body(5), timeout=60)
    assert r.status_code == 400 and "retired" in r.text
    # the new one hits the old one's cache, same tokens
    assert complete(url, 130) == first
    stats = httpx.get(f"{url}/v1/stats").json()
    assert stats["prefix_hit_tokens"] >= 128 - 16, stats["prefix_hit_tokens"]
    # only the old server may relay to the new one, not this process (issue 24)
    refuses_relays(url, "tiny")
    # both tenants are there, the memory is accounted once
    assert sorted(accounted(d)) == ["tiny", "tiny-next"]
    assert d.check() == []
    old.terminate()
    old.wait(30)
    assert complete(url, 130) == first  # nothing of the new one's went with the old
    assert d.check() == []


# --- in-flight requests ----------------------------------------------------------------

LONG_TOKENS = 400  # long enough that none ends before the takeover reaches the old
LONG_KV = "4MiB"  # room for all of them at once (no preemption)
CLIENTS = [("stream", 130), ("stream", 70), ("whole", 200)]  # (how, prompt length)


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir) -> dict[int, tuple[list[int], str]]:
    """One engine, never interrupted: each prompt's greedy tokens and text."""
    e = Engine(EngineConfig(model=str(tiny_dir), kv_cache_size=LONG_KV))
    params = SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)
    for n in {n for _, n in CLIENTS} | {100}:
        e.add_request(prompt(n), params, str(n))
    out = {}
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                out[int(o.request_id)] = (o.output_token_ids, o.text)
    return out


class Client(threading.Thread):
    """One long greedy completion against ``url``: streamed (``progress`` is set after
    its second token; with ``quit_after`` it hangs up after that many tokens) or whole;
    ``result`` is (token ids, text) or the failure."""

    def __init__(self, url: str, n: int, stream: bool, quit_after: int | None = None
                 ) -> None:
        super().__init__(daemon=True)
        self.url, self.n, self.stream, self.quit_after = url, n, stream, quit_after
        self.progress = threading.Event()
        self.result: tuple[list[int], str] | str | None = None

    def run(self) -> None:
        try:
            self.result = self._streamed() if self.stream else self._whole()
        except Exception as e:  # noqa: BLE001 - the test reports it
            self.result = f"{type(e).__name__}: {e}"

    def _whole(self) -> tuple[list[int], str]:
        r = httpx.post(f"{self.url}/v1/completions",
                       json=body(self.n, max_tokens=LONG_TOKENS), timeout=300)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["token_ids"], c["text"]

    def _streamed(self) -> tuple[list[int], str]:
        tokens: list[int] = []
        text = ""
        with httpx.stream("POST", f"{self.url}/v1/completions",
                          json=body(self.n, max_tokens=LONG_TOKENS, stream=True),
                          timeout=300) as r:
            for choices in stream_choices(r):
                for c in choices:
                    tokens += c.get("token_ids", [])
                    text += c["text"]
                if len(tokens) >= 2:
                    self.progress.set()
                if self.quit_after is not None and len(tokens) >= self.quit_after:
                    break  # the client goes away mid-stream
        return tokens, text

    def outcome(self) -> tuple[list[int], str]:
        self.join(200)
        assert isinstance(self.result, tuple), f"prompt of {self.n}: {self.result}"
        return self.result


def outcomes(clients: list[Client], server: subprocess.Popen, log, timeout: float = 240
             ) -> dict[Client, tuple[list[int], str]]:
    """Every client's result within one deadline; if one is not done the server's
    threads' stacks (faulthandler, SIGABRT) and log go in the failure, not a hang."""
    deadline = time.monotonic() + timeout
    for c in clients:
        c.join(max(0.0, deadline - time.monotonic()))
    stuck = [c.n for c in clients if c.is_alive()]
    if stuck:
        os.kill(server.pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(30)
        raise AssertionError(f"prompts {stuck}: no answer within {timeout} s; the server's "
                             f"log and stacks:\n{log.read_text()[-6000:]}")
    return {c: c.outcome() for c in clients}


def start_clients(url: str, quitter: Client | None = None) -> list[Client]:
    clients = [Client(url, n, how == "stream") for how, n in CLIENTS]
    if quitter is not None:
        clients.append(quitter)
    for c in clients:
        c.start()
    for c in clients:
        if c.stream:
            assert c.progress.wait(120), f"prompt of {c.n}: no tokens"
    return clients


def connected_to(proc: subprocess.Popen, url: str) -> bool:
    """``proc`` has a connection to the (stopped) server at ``url`` and its request's
    bytes are there, unread: /pd/retire is on its way whenever the server runs again."""
    port = int(url.rsplit(":", 1)[1])
    try:
        conns = psutil.Process(proc.pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return False
    mine = {c.laddr.port for c in conns
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED}
    return any(unread_bytes(port, p) > 0 for p in mine)


def unread_bytes(server_port: int, peer_port: int) -> int:
    """The receive queue of the server's end of the loopback connection from
    ``peer_port`` (/proc/net/tcp{,6}: rx_queue, hex)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, remote, queues = cols[1], cols[2], cols[4]
                if (int(local.rsplit(":", 1)[1], 16) == server_port
                        and int(remote.rsplit(":", 1)[1], 16) == peer_port):
                    return int(queues.split(":")[1], 16)
    return 0


def test_in_flight_requests_finish_on_the_new_server_as_if_uninterrupted(
        start_daemon, tiny_dir, tmp_path, uninterrupted):
    d = start_daemon(budget="16MiB")
    old, old_url = serve(d, tiny_dir, tmp_path / "old.log", kv=LONG_KV)
    quitter = Client(old_url, 130, stream=True, quit_after=LONG_TOKENS * 3 // 4)
    clients = start_clients(old_url, quitter)
    os.kill(old.pid, signal.SIGSTOP)  # mid-generation: it stays there until SIGCONT
    try:
        new, url = launch(d, tiny_dir, tmp_path / "new.log", "--handoff-from", old_url,
                          tenant="tiny-next", kv=LONG_KV)
        wait_for(lambda: connected_to(new, old_url), "the new server asks to take over",
                 timeout=120)
        late = Client(old_url, 100, stream=False)  # arrives during the handover
        late.start()
    finally:
        os.kill(old.pid, signal.SIGCONT)
    healthy(new, url, tmp_path / "new.log")
    got = outcomes([*clients, late], old, tmp_path / "old.log")
    for c in [*clients, late]:
        if c is not quitter:
            assert got[c] == uninterrupted[c.n], f"prompt of {c.n} ({c.stream=})"
    tokens, text = got[quitter]
    assert len(tokens) >= quitter.quit_after and tokens == uninterrupted[130][0][:len(tokens)]
    # all of them were generated by the new server, none by the old one; the client that
    # hung up on the old server stopped its request on the new one
    wait_for(lambda: "abort" in httpx.get(f"{url}/v1/stats").json()["finish_reasons"],
             "the quitter's request is aborted on the new server", timeout=120.0)
    stats, old_stats = (httpx.get(f"{u}/v1/stats").json() for u in (url, old_url))
    assert stats["finish_reasons"] == {"length": len(clients), "abort": 1}, stats
    assert old_stats["finished_requests"] == 0, old_stats
    # the old server ends retired; the memory is accounted once
    assert httpx.get(f"{old_url}/health").status_code == 503
    r = httpx.post(f"{old_url}/v1/completions", json=body(5), timeout=60)
    assert r.status_code == 400 and "retired" in r.text
    assert sorted(accounted(d)) == ["tiny", "tiny-next"]
    assert d.check() == []
    old.terminate()
    old.wait(30)
    wait_for(lambda: "tiny" not in accounted(d), "the old tenant goes")
    assert list(accounted(d)) == ["tiny-next"]
    assert d.check() == []
    assert complete(url, 130) == uninterrupted[130][0][:GREEDY["max_tokens"]]


def test_a_new_server_killed_mid_handover_loses_nothing(start_daemon, tiny_dir, tmp_path,
                                                        uninterrupted):
    d = start_daemon(budget="16MiB")
    old, old_url = serve(d, tiny_dir, tmp_path / "old.log", kv=LONG_KV)
    clients = start_clients(old_url)
    os.kill(old.pid, signal.SIGSTOP)
    try:
        new, _ = launch(d, tiny_dir, tmp_path / "new.log", "--handoff-from", old_url,
                        tenant="tiny-next", kv=LONG_KV)
        wait_for(lambda: connected_to(new, old_url), "the new server asks to take over",
                 timeout=120)
        os.kill(new.pid, signal.SIGSTOP)  # it will not claim
    finally:
        os.kill(old.pid, signal.SIGCONT)
    # the offer is out: every request is detached from the old engine, waiting on it
    wait_for(lambda: (lambda s: s["running"] + s["waiting"] + s["finished_requests"] == 0)(
        httpx.get(f"{old_url}/v1/stats").json()), "the old server offers its requests")
    assert all(c.result is None for c in clients), "they wait for the handover"
    late = Client(old_url, 100, stream=False)  # arrives while the offer is out
    late.start()
    new.kill()
    new.wait(30)
    # the ticket expires: the old server takes everything back and serves on
    for c, got in outcomes([*clients, late], old, tmp_path / "old.log").items():
        assert got == uninterrupted[c.n], f"prompt of {c.n} ({c.stream=})"
    assert httpx.get(f"{old_url}/health").status_code == 200
    assert httpx.get(f"{old_url}/v1/stats").json()["finish_reasons"] == {
        "length": len(clients) + 1}
    wait_for(lambda: list(accounted(d)) == ["tiny"], "the dead new server's tenant goes")
    assert d.check() == []


def refuses_relays(url: str, giver: str | None) -> None:
    """Every relay route of the server at ``url`` refuses this test process (not the
    server it took over from, or it took nothing over): a 403 in one line, before the
    body is looked at (a generation with return_logits, a follow, a drop)."""
    params = dataclasses.asdict(SamplingParams(max_tokens=4, temperature=0.0))
    calls = {"adopt": ("POST", "/pd/adopt", {"id": "x", "prompt": [9],
                                             "params": {**params, "return_logits": True}}),
             "follow": ("GET", "/pd/follow/x", None), "drop": ("DELETE", "/pd/follow/x", None)}
    for route, (method, path, body) in calls.items():
        r = httpx.request(method, f"{url}{path}", json=body, timeout=30)
        assert r.status_code == 403, (route, r.text)
        msg = r.json()["error"]["message"]
        assert msg.startswith(f"{route} refused") and "\n" not in msg, msg
        want = "took nothing over" if giver is None else f"tenant {giver!r}'s process"
        assert want in msg, msg


def test_the_relay_endpoints_answer_only_the_server_taken_over_from(start_daemon, tiny_dir,
                                                                    tmp_path):
    d = start_daemon(budget="8MiB")
    _, url = serve(d, tiny_dir, tmp_path / "s.log")
    refuses_relays(url, None)
    assert httpx.get(f"{url}/v1/stats").json()["finish_reasons"] == {}
    assert d.check() == []
