"""A member whose port another process takes before its server binds it (issue 36: the
fleet picks a free port, the server binds it later; under load someone else got there
first and the member failed "address already in use").

A real fleet in this process (its router app and supervisor, :func:`kvpool.fleet.service.
build`) over a real daemon, with real ``kvpool serve`` members of a tiny model. The fleet's
port chooser is passed in (``ports``): it hands out ports that listening sockets of this
test hold, then free ones, so each taken port is taken when the server binds it; the
first is held by a server that answers ``/health`` (not the member's, though 200).

* ``m`` (eager) gets two taken ports, then a free one: it comes up serving on the third,
  requests through the router succeed, and the counts say one start (one ``fleet:
  starting`` line, no restart, no start error), with one log line per retry;
* ``all`` gets only taken ports: three processes, then ``failed``, its request a 503 with
  one line saying the address was in use; no fourth port asked for;
* ``broken`` (a flag its server refuses) fails as before: no retry, a 503 with one line,
  the fleet serving on;
* a vLLM member (vLLM's CPU build, the kvpool plugin) whose first port is taken: its
  server's ``OSError: [Errno 98]`` is told the same way, and it serves on the second.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvpool.fleet.entries import FleetConfig, ModelEntry
from kvpool.fleet.member import AWAKE, FAILED, PORT_TRIES, Member, free_port
from kvpool.fleet.router import create_app
from kvpool.fleet.service import build

from daemon.helpers import PAGE

from .prom import metric

PROMPT = [17, 301, 44, 5, 230, 99, 12, 480]
START_LINE = re.compile(r"^fleet: starting (\S+) ")  # what a fleet's starts are counted by
TIMEOUT_S = 300.0


class Ports:
    """The fleet's port chooser here: the ports of ``script`` in turn (None: a free port),
    then free ports; ``given`` records every port handed out."""

    def __init__(self, script: list[int | None]) -> None:
        self.script = list(script)
        self.given: list[int] = []

    def __call__(self) -> int:
        scripted = self.script.pop(0) if self.script else None
        port = free_port() if scripted is None else scripted
        self.given.append(port)
        return port


def listener() -> socket.socket:
    """A socket listening on a loopback port (another process's server, as far as a
    member binding that port can tell)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


class Impostor(BaseHTTPRequestHandler):
    """Another server: ``GET /health`` 200, whatever else a 404."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.do_GET()

    def log_message(self, format: str, *args: object) -> None:
        pass


def impostor() -> ThreadingHTTPServer:
    """Another server on a loopback port, serving (on a thread) until shut down."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def entry(name: str, checkpoint: Path, eager: bool, args: tuple[str, ...]) -> ModelEntry:
    return ModelEntry(name=name, checkpoint=checkpoint, eager=eager, kv_cache_size=2 << 20,
                      max_num_seqs=4, args=args)


def said_of(lines: list[str], tenant: str) -> tuple[list[str], list[str]]:
    """(``tenant``'s ``fleet: starting`` lines, its port retry lines) among ``lines``."""
    starts = [x for x in lines if (s := START_LINE.match(x)) and s.group(1) == tenant]
    retries = [x for x in lines if x.startswith(f"fleet: {tenant}: port ")]
    return starts, retries


async def complete(router: httpx.AsyncClient, name: str) -> httpx.Response:
    body = {"model": name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    return await router.post("/v1/completions", json=body, timeout=TIMEOUT_S)


async def settled(m: Member) -> None:
    """Until ``m`` is up or failed (at most ``TIMEOUT_S``)."""
    for _ in range(int(TIMEOUT_S / 0.2)):
        if m.state in (AWAKE, FAILED):
            return
        await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.engine.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("port-model") / "tiny", layers=2,
                           hidden=128, heads=4, kv_heads=2, vocab=512, seed=1)


def test_a_member_whose_port_is_taken_starts_on_another(model, tmp_path, start_daemon) -> None:
    daemon = start_daemon(budget=f"{200 * PAGE // 1024}KiB")
    other = impostor()  # its /health answers 200 while m's first server loads
    held = [listener() for _ in range(1 + PORT_TRIES)]
    taken = [other.server_address[1], *(s.getsockname()[1] for s in held)]
    # m: two taken (the first by a server that answers), then free; all: every one
    # taken; broken: free
    ports = Ports([taken[0], taken[1], None, *taken[2:]])
    good = ("--max-model-len", "256")
    config = FleetConfig(path=tmp_path / "f.toml", name="ports", start_timeout_s=150,
                         models=(entry("m", model, True, good), entry("all", model, False, good),
                                 entry("broken", model, False, ("--no-such-flag",))))
    lines: list[str] = []
    supervisor, queues, metrics, client = build(config, daemon.run_dir, tmp_path / "logs",
                                                log=lines.append, ports=ports)
    app = create_app(queues, supervisor, metrics, client, eager=["m"])
    (m,), (every,), (broken,) = (queues[n].members for n in ("m", "all", "broken"))

    def said(tenant: str) -> tuple[list[str], list[str]]:
        return said_of(lines, tenant)

    def waited(r: httpx.Response) -> str:
        """The 503's message, once (one line)."""
        assert r.status_code == 503, r.text
        message: str = r.json()["error"]["message"]
        assert "\n" not in message and "within" not in message, message  # (not a timeout)
        return message

    async def go() -> None:
        async with app.router.lifespan_context(app):
            router = httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                       base_url="http://fleet")
            async with router:
                await settled(m)
                assert m.state == AWAKE, lines
                # the third port, the free one (the impostor's 200 was not taken for
                # m's); the requests succeed there
                assert ports.given[:2] == taken[:2] and len(ports.given) == 3, \
                    (ports.given, lines)
                assert ports.given[2] not in taken
                assert m.url == f"http://127.0.0.1:{ports.given[2]}"
                for _ in range(3):
                    r = await complete(router, "m")
                    assert r.status_code == 200 and r.json()["choices"][0]["text"] != "", \
                        r.text
                starts, retries = said("m")
                assert len(starts) == 1 and m.starts == 1, lines
                assert len(retries) == 2, lines
                for port, n, line in zip(taken[:2], (2, 3), retries):
                    assert f"port {port} was taken" in line and "address already in use" in line
                    assert f"on port {ports.given[n - 1]} instead (try {n} of {PORT_TRIES})" \
                        in line, line
                # every port taken: failed after PORT_TRIES processes, one 503 line
                # (the request waits for the start: it gets the failure's reason at once)
                message = waited(await complete(router, "all"))
                assert "address already in use" in message, message
                assert f"each of {PORT_TRIES} ports taken" in message, message
                assert every.state == FAILED and every.starts == 1
                assert ports.given[3:] == taken[2:], ports.given  # no fourth port asked
                starts, retries = said("all")
                assert (len(starts), len(retries)) == (1, PORT_TRIES - 1), lines
                # another failure to start is no port retry: as before
                message = waited(await complete(router, "broken"))
                assert "no-such-flag" in message, message
                assert broken.state == FAILED and broken.starts == 1
                starts, retries = said("broken")
                assert (len(starts), len(retries)) == (1, 0), lines
                assert len(ports.given) == 2 + PORT_TRIES + 2
                # the fleet serves on, and counted no restart and only the real failures
                assert (await complete(router, "m")).status_code == 200
                text = (await router.get("/metrics")).text
                for name, errors, retries in (("m", 0, 2), ("all", 1, PORT_TRIES - 1),
                                              ("broken", 1, 0)):
                    assert metric(text, "kvpool_fleet_port_retries_total",
                                  model=name) == retries, (name, text)
                    assert metric(text, "kvpool_fleet_restarts_total", model=name) == 0, text
                    assert metric(text, "kvpool_fleet_upstream_errors_total", model=name,
                                  kind="start") == errors, (name, text)
                assert metric(text, "kvpool_fleet_requests_total", model="m", replica="0",
                              code="200") == 4, text
                for name, state in (("m", "awake"), ("all", "failed"), ("broken", "failed")):
                    assert metric(text, "kvpool_fleet_replica_up", model=name, replica="0",
                                  state=state) == 1, (name, text)
                assert not any("Traceback" in x for x in lines), lines

    try:
        asyncio.run(go())
    finally:
        supervisor.stop_all()
        other.shutdown()
        other.server_close()
        for s in held:
            s.close()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_vllm_member_whose_port_is_taken_starts_on_another(model, tmp_path, start_daemon,
                                                             monkeypatch) -> None:
    pytest.importorskip("vllm")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (what its members inherit)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    daemon = start_daemon(budget="8MiB")
    held = listener()
    ports = Ports([held.getsockname()[1], None])
    vl = ModelEntry(name="vl", engine="vllm", checkpoint=model, eager=True, max_num_seqs=8,
                    args=("--enforce-eager", "--max-model-len", "512", "--dtype", "float32"))
    config = FleetConfig(path=tmp_path / "f.toml", name="vports", start_timeout_s=400,
                         models=(vl,))
    lines: list[str] = []
    supervisor, queues, metrics, client = build(config, daemon.run_dir, tmp_path / "logs",
                                                log=lines.append, ports=ports)
    app = create_app(queues, supervisor, metrics, client, eager=["vl"])
    (m,) = queues["vl"].members

    async def go() -> None:
        async with app.router.lifespan_context(app):
            router = httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                       base_url="http://fleet")
            async with router:
                await settled(m)
                assert m.state == AWAKE, lines
                assert len(ports.given) == 2 and m.url == f"http://127.0.0.1:{ports.given[1]}"
                r = await complete(router, "vl")
                assert r.status_code == 200, r.text
                starts, retries = said_of(lines, "vl")
                assert (len(starts), len(retries), m.starts) == (1, 1, 1), lines
                assert f"port {ports.given[0]} was taken" in retries[0], retries
                assert f"on port {ports.given[1]} instead (try 2 of {PORT_TRIES})" in retries[0]
                text = (await router.get("/metrics")).text
                assert metric(text, "kvpool_fleet_restarts_total", model="vl") == 0, text
                assert metric(text, "kvpool_fleet_port_retries_total", model="vl") == 1, text
                assert metric(text, "kvpool_fleet_upstream_errors_total", model="vl",
                              kind="start") == 0, text

    try:
        asyncio.run(go())
    finally:
        supervisor.stop_all()
        held.close()
