"""The fleet's router in-process (no server process: members whose state the test sets,
an in-process stand-in for their servers): routing by ``model``, hostile bodies, the
bounded queue (429 + Retry-After; a flood stays bounded), the wake before a request to
an asleep replica, pass-through of answers and streams, the metrics' names."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvpool.control_token import ControlGate
from kvpool.elastic_server import control_auth
from kvpool.fleet.config import FleetConfig, ModelEntry
from kvpool.fleet.member import ASLEEP, AWAKE, STARTING
from kvpool.fleet.router import MAX_BODY, create_app
from kvpool.fleet.service import FleetError, build

from .prom import metric

QUEUE = 3


class Upstream:
    """Stands in for the members' servers (every member's url reaches it)."""

    def __init__(self, gate: ControlGate = ControlGate(None, "127.0.0.1")) -> None:
        self.app = FastAPI()
        admitted = [Depends(control_auth.guard(self.app, gate))]  # the servers' own check
        self.wakes = 0
        self.wake_status = 200
        self.bodies: list[dict[str, Any]] = []

        @self.app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            self.bodies.append(body)
            if body.get("stream"):
                async def chunks():
                    for i in range(3):
                        yield f"data: {json.dumps({'i': i, 'host': request.url.hostname})}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(chunks(), media_type="text/event-stream")
            if body.get("max_tokens") == 0:  # the server's own 400 passes through
                return JSONResponse({"error": {"message": "max_tokens: too small",
                                               "type": "invalid_request_error",
                                               "code": "invalid_request"}}, 400)
            return {"model": body["model"], "host": request.url.hostname}

        @self.app.post("/wake_up", dependencies=admitted)
        async def wake_up() -> Any:
            self.wakes += 1
            if self.wake_status != 200:
                return JSONResponse({"error": {"message": "the model cannot wake: no memory",
                                               "type": "server_error"}}, self.wake_status)
            return {"status": "awake", "tags": None}


@pytest.fixture
def fleet(tmp_path: Path):
    """(router client, queues, supervisor, upstream): model ``a`` with 2 replicas and
    ``b`` with one; every member starting (no process is ever spawned)."""
    return make_fleet(tmp_path, Upstream())


def make_fleet(tmp_path: Path, upstream: Upstream):
    models = (ModelEntry(name="a", checkpoint=tmp_path, replicas=2),
              ModelEntry(name="b", checkpoint=tmp_path))
    config = FleetConfig(path=tmp_path / "f.toml", name="t", queue=QUEUE, models=models)
    supervisor, queues, metrics, client = build(config, tmp_path, tmp_path, log=lambda _: None)
    supervisor.client = client = httpx.AsyncClient(transport=httpx.ASGITransport(upstream.app))
    for q in queues.values():
        for m in q.members:
            m.url = f"http://{m.tenant}"
            supervisor.set_state(m, STARTING)
    app = create_app(queues, supervisor, metrics, client)
    router = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://fleet")
    return router, queues, supervisor, upstream


def post(router: httpx.AsyncClient, body: Any, **kw: Any):
    return router.post("/v1/completions", json=body, **kw)


async def until(pred, what: str) -> None:
    for _ in range(10000):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what} never happened")


def test_unknown_or_missing_model_is_the_single_server_404(fleet) -> None:
    router = fleet[0]

    async def go() -> None:
        for body, piece in (({"model": "nope", "prompt": "x"}, "model 'nope' not found"),
                            ({"prompt": "x"}, "names no model"),
                            ({"model": "x" * 5000}, "model 'xxxx")):
            r = await post(router, body)
            err = r.json()["error"]
            assert r.status_code == 404 and set(err) == {"message", "type", "code"}, r.text
            assert (err["type"], err["code"]) == ("invalid_request_error", "model_not_found")
            assert piece in err["message"] and "'a', 'b'" in err["message"]
            assert len(err["message"]) < 200  # a hostile name is not echoed whole
        text = (await router.get("/metrics")).text
        assert metric(text, "kvpool_fleet_requests_total", model="-", replica="-", code="404") == 3
        assert "xxxx" not in text  # a client's text never becomes a label

    asyncio.run(go())


def test_hostile_bodies_are_4xx(fleet) -> None:
    router = fleet[0]

    async def go() -> None:
        for content, status in ((b"{not json", 400), (b"[1, 2]", 400), (b"\xff\xfe", 400),
                                (b'{"model": 5}', 400), (b'{"model": ["a"]}', 400)):
            r = await router.post("/v1/completions", content=content)
            assert r.status_code == status and "error" in r.json(), (content, r.text)
        r = await router.post("/v1/completions", content=b"x" * (MAX_BODY + 1))
        assert r.status_code == 413, r.text
        # nesting deeper than the parser recurses (issue 33 item 10: was a 500 and a
        # traceback), bare or inside a routed body
        for content in (b"[" * 100_000, b'{"model": "a", "prompt": ' + b"[" * 100_000,
                        b'{"model": "a", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
            r = await router.post("/v1/completions", content=content)
            error = r.json()["error"]
            assert r.status_code == 400 and len(error["message"].splitlines()) == 1, r.text

    asyncio.run(go())


def test_a_full_queue_is_429_with_retry_after_and_a_flood_stays_bounded(fleet) -> None:
    router, queues, supervisor, upstream = fleet
    q = queues["b"]

    async def go() -> None:
        waiting = [asyncio.create_task(post(router, {"model": "b", "i": i}))
                   for i in range(QUEUE)]
        await until(lambda: q.waiting == QUEUE, "the queue filling")
        r = await post(router, {"model": "b"})
        assert r.status_code == 429 and r.headers["retry-after"] == "2", r.text
        assert r.json()["error"]["code"] == "queue_full"
        flood = await asyncio.gather(*(post(router, {"model": "b"}) for _ in range(300)))
        assert {x.status_code for x in flood} == {429}
        assert q.waiting == QUEUE  # the flood cost nothing that stays
        text = (await router.get("/metrics")).text
        assert metric(text, "kvpool_fleet_queue_depth", model="b") == 3
        assert metric(text, "kvpool_fleet_requests_total", model="b", replica="-",
                      code="429") == 301
        supervisor.set_state(q.members[0], AWAKE)  # the server is up: the waiters go
        done = await asyncio.gather(*waiting)
        assert [x.status_code for x in done] == [200] * QUEUE
        assert q.waiting == 0 and q.members[0].inflight == 0
        assert sorted(b["i"] for b in upstream.bodies) == list(range(QUEUE))

    asyncio.run(go())


def test_routes_by_model_and_passes_answers_through(fleet) -> None:
    router, queues, supervisor, upstream = fleet

    async def go() -> None:
        for q in queues.values():
            for m in q.members:
                supervisor.set_state(m, AWAKE)
        r = await post(router, {"model": "b", "prompt": "hi"})
        assert r.json() == {"model": "b", "host": "b"}
        r = await post(router, {"model": "a", "prompt": "hi", "max_tokens": 0})
        assert r.status_code == 400 and "max_tokens" in r.text  # the server's own 400
        r = await post(router, {"model": "a", "prompt": "hi", "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.text.count("data: {") == 3
        listed = (await router.get("/v1/models")).json()["data"]
        assert [(m["id"], m["state"], [x["state"] for x in m["replicas"]]) for m in listed] \
            == [("a", "awake", ["awake", "awake"]), ("b", "awake", ["awake"])]
        assert listed[0]["replicas"][1] == {"index": 1, "state": "awake", "url": "http://a-1"}
        text = (await router.get("/metrics")).text
        for name in ("kvpool_fleet_requests_total", "kvpool_fleet_queue_depth",
                     "kvpool_fleet_inflight", "kvpool_fleet_wakes_total",
                     "kvpool_fleet_wake_seconds_bucket", "kvpool_fleet_sleeps_total",
                     "kvpool_fleet_upstream_errors_total", "kvpool_fleet_restarts_total",
                     "kvpool_fleet_replica_up", "kvpool_fleet_routed_total"):
            assert name in text, name
        assert metric(text, "kvpool_fleet_replica_up", model="a", replica="1", state="awake") == 1
        assert metric(text, "kvpool_fleet_replica_up", model="a", replica="1", state="asleep") == 0
        assert 'kvpool_fleet_inflight{model="a",replica="0"} 0.0' in text

    asyncio.run(go())


def test_an_asleep_replica_is_woken_first_and_a_failed_wake_is_503(fleet) -> None:
    router, queues, supervisor, upstream = fleet
    b = queues["b"].members[0]

    async def go() -> None:
        supervisor.set_state(b, ASLEEP)
        rs = await asyncio.gather(*(post(router, {"model": "b"}) for _ in range(3)))
        assert [r.status_code for r in rs] == [200] * 3 and b.state == AWAKE
        assert upstream.wakes == 1  # one wake for every waiting request
        text = (await router.get("/metrics")).text
        assert metric(text, "kvpool_fleet_wake_seconds_count", model="b") == 1
        supervisor.set_state(b, ASLEEP)
        upstream.wake_status = 503
        r = await post(router, {"model": "b"})
        assert r.status_code == 503 and "no memory" in r.json()["error"]["message"], r.text
        assert "retry-after" in r.headers
        text = (await router.get("/metrics")).text
        assert metric(text, "kvpool_fleet_upstream_errors_total", model="b", kind="wake") == 1

    asyncio.run(go())


def test_the_wake_carries_the_control_token(tmp_path: Path, monkeypatch) -> None:
    """Members inherit KVPOOL_CONTROL_TOKEN and want it on /wake_up; the router sends it
    (a member behind the same check refuses a wake without it: 503, no wake)."""
    token = "fleet-control-token-0123456789"
    monkeypatch.setenv("KVPOOL_CONTROL_TOKEN", token)
    router, queues, supervisor, upstream = make_fleet(tmp_path,
                                                      Upstream(ControlGate(token, "0.0.0.0")))
    b = queues["b"].members[0]

    async def go() -> None:
        supervisor.set_state(b, ASLEEP)
        r = await post(router, {"model": "b"})
        assert r.status_code == 200 and b.state == AWAKE and upstream.wakes == 1, r.text

    asyncio.run(go())
    monkeypatch.setenv("KVPOOL_CONTROL_TOKEN", "short")  # one line, before it serves
    with pytest.raises(FleetError, match="KVPOOL_CONTROL_TOKEN"):
        make_fleet(tmp_path, Upstream())


def test_awake_replicas_are_preferred_to_waking_one(fleet) -> None:
    router, queues, supervisor, upstream = fleet
    a0, a1 = queues["a"].members

    async def go() -> None:
        supervisor.set_state(a0, ASLEEP)
        supervisor.set_state(a1, AWAKE)
        a1.inflight = 50  # busy, but awake
        r = await post(router, {"model": "a"})
        assert r.json()["host"] == "a-1" and upstream.wakes == 0
        a1.inflight = 0

    asyncio.run(go())


def prefix_fleet(tmp_path: Path):
    """(router client, queues): model ``a`` with two awake replicas, ``routing = "prefix"``."""
    models = (ModelEntry(name="a", checkpoint=tmp_path, replicas=2, routing="prefix"),)
    config = FleetConfig(path=tmp_path / "f.toml", name="t", queue=QUEUE, models=models)
    supervisor, queues, metrics, _ = build(config, tmp_path, tmp_path, log=lambda _: None)
    upstream = Upstream()
    supervisor.client = client = httpx.AsyncClient(transport=httpx.ASGITransport(upstream.app))
    for m in queues["a"].members:
        m.url = f"http://{m.tenant}"
        supervisor.set_state(m, AWAKE)
    router = httpx.AsyncClient(transport=httpx.ASGITransport(
        create_app(queues, supervisor, metrics, client)), base_url="http://fleet")
    return router, queues


def test_prefix_routing_sends_a_shared_prefix_to_one_replica_and_says_why(tmp_path: Path
                                                                          ) -> None:
    """``routing = "prefix"``: requests sharing a prompt prefix follow the first one to
    its replica, and ``routed_total`` counts them with reason ``prefix``."""
    router, queues = prefix_fleet(tmp_path)
    shared = "You are a careful assistant. " * 20

    async def go() -> None:
        first = (await post(router, {"model": "a", "prompt": shared + "q0"})).json()["host"]
        hosts = {(await post(router, {"model": "a", "prompt": shared + f"q{i}"})).json()["host"]
                 for i in range(1, 6)}
        assert hosts == {first}
        text = (await router.get("/metrics")).text
        index = "0" if first == "a" else "1"
        assert metric(text, "kvpool_fleet_routed_total", model="a", replica=index,
                      reason="prefix") == 5

    asyncio.run(go())


def test_a_restarted_replica_is_forgotten_by_the_prefix_picker(tmp_path: Path) -> None:
    """A replica whose server started again has an empty cache: the prefix picker stops
    sending the prefix's requests there by memory (the next one goes by load)."""
    router, queues = prefix_fleet(tmp_path)
    shared = "You are a careful assistant. " * 20

    async def go() -> None:
        first = (await post(router, {"model": "a", "prompt": shared + "q0"})).json()["host"]
        member = next(m for m in queues["a"].members if m.tenant == first)
        member.starts += 1  # the supervisor spawned its server again
        await post(router, {"model": "a", "prompt": shared + "q1"})
        text = (await router.get("/metrics")).text
        assert metric(text, "kvpool_fleet_routed_total", model="a", replica=str(member.index),
                      reason="prefix") == 0
        assert sum(metric(text, "kvpool_fleet_routed_total", model="a", replica=str(i),
                          reason="load") for i in (0, 1)) == 2

    asyncio.run(go())
