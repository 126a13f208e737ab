"""The relay routes of a new server (``/pd/adopt``, ``/pd/follow``; issue 24, defect 4),
past their gate (who may call them is :mod:`relay_auth`'s, tested against real servers
in test_warm_serve.py): only the public sampling parameters (``return_logits`` is a 400),
bad input a 400 in one line, an id in use refused at once (409) while the first stream
goes on, and a forwarded request's lines send each token once.

The app is the real one (create_app + add_routes over a RetiringEngine of the tiny
model) served by uvicorn on a loopback port in this process; the gate lets everyone in."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpool.engine import Engine, EngineConfig, SamplingParams
from kvpool.elastic_server import warm_relay

from .served import free_port
from .test_pd_handoff import prompt

TOKENS = 40


class OpenGate:
    async def refusal(self, request: Any, route: str) -> Any:
        return None


@pytest.fixture(scope="module")
def engines() -> list[Engine]:
    return []


@pytest.fixture(scope="module")
def server(tiny_dir, engines) -> Iterator[str]:
    import uvicorn

    from kvpool.engine.serving.server import create_app
    from kvpool.elastic_server.warm_engine import RetiringEngine
    from kvpool.elastic_server.app import add_routes

    engine = Engine(EngineConfig(model=str(tiny_dir), kv_cache_size="2MiB"))
    engines.append(engine)
    aengine = RetiringEngine(engine)
    app = create_app(aengine)
    add_routes(app, aengine, OpenGate())
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                        log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    with httpx.Client() as c:  # up when /health answers (uvicorn sets started first)
        for _ in range(600):
            try:
                if c.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                threading.Event().wait(0.05)
    yield url
    srv.should_exit = True
    t.join(30)


def params(**kw: Any) -> dict:
    d = dataclasses.asdict(SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                          ignore_eos=True))
    d.pop("detokenize"), d.pop("return_logits")
    return {**d, **kw}


@pytest.mark.parametrize("why,body", [
    ("return_logits", {"id": "x", "prompt": [9], "params": params(return_logits=True)}),
    ("detokenize", {"id": "x", "prompt": [9], "params": params(detokenize=False)}),
    ("unknown parameter", {"id": "x", "prompt": [9], "params": {"bogus": 1}}),
    ("bad max_tokens", {"id": "x", "prompt": [9], "params": params(max_tokens=-1)}),
    ("NaN temperature", {"id": "x", "prompt": [9], "params": params(temperature="NaN")}),
    ("seed out of range", {"id": "x", "prompt": [9], "params": params(seed=2 ** 70)}),
    ("top_k beyond the vocabulary", {"id": "x", "prompt": [9], "params": params(top_k=10 ** 9)}),
    ("token outside the vocabulary", {"id": "x", "prompt": [10 ** 6], "params": params()}),
    ("empty prompt", {"id": "x", "prompt": [], "params": params()}),
    ("wrong types", {"id": 5, "prompt": "abc", "params": []}),
    ("params not an object", {"id": "x", "prompt": [9], "params": [1]}),
])
def test_bad_adopt_bodies_are_one_line_400s(server, why, body):
    r = httpx.post(f"{server}/pd/adopt", json=body, timeout=30)
    assert r.status_code == 400, (why, r.text)
    msg = r.json()["error"]["message"]
    assert "\n" not in msg, why
    if why in ("return_logits", "detokenize"):
        assert why in msg and "public" in msg, msg


def adopt_lines(server: str, rid: str, started: threading.Event | None = None
                ) -> tuple[list[dict], int]:
    """POST /pd/adopt of ``rid``: its lines (or the error body) and status; ``started``
    is set once the answer's headers came."""
    lines: list[dict] = []
    with httpx.stream("POST", f"{server}/pd/adopt", timeout=120,
                      json={"id": rid, "prompt": prompt(100), "params": params()}) as r:
        if started is not None:
            started.set()
        if r.status_code != 200:
            r.read()
            return [r.json()], r.status_code
        for line in r.iter_lines():
            if line:
                lines.append(json.loads(line))
    return lines, 200


def test_a_second_adopt_of_an_id_in_use_is_refused_at_once(server, engines):
    """The engine is held (its step_lock) while the first is open, so it is surely still
    running when the second comes: no timing assumed."""
    first = threading.Event()
    done: dict[str, Any] = {}
    t = threading.Thread(target=lambda: done.update(a=adopt_lines(server, "dup", first)))
    with engines[0].step_lock:
        t.start()
        assert first.wait(120), "the first adopt is answered"
        second, status = adopt_lines(server, "dup")  # while the first is open
        assert status == 409 and "in use" in second[0]["error"]["message"], second
    t.join(120)
    lines, status = done["a"]
    assert status == 200 and lines[-1]["finished"], "the first went on, untouched"
    assert sum(len(x["tokens"]) for x in lines) == TOKENS
    again, status = adopt_lines(server, "dup")  # once it is over, the id is free again
    assert status == 200 and again[-1]["finished"]


def test_a_forwarded_request_streams_each_token_once(server, tiny_dir):
    e = Engine(EngineConfig(model=str(tiny_dir), kv_cache_size="2MiB"))
    e.add_request(prompt(100), SamplingParams(**params()), "ref")
    ref = None
    while e.has_unfinished():
        for o in e.step():
            ref = o if o.finished else ref
    dec = warm_relay.Decoder("fwd", prompt(100), [], None)
    sent, out = 0, None
    lines, status = adopt_lines(server, "fwd")
    assert status == 200
    for msg in lines:
        assert msg["at"] == sent, "a line repeats or skips tokens"
        sent += len(msg["tokens"])
        out = dec.output(msg) or out
    assert out is not None and out.finished and ref is not None
    assert (out.output_token_ids, out.text) == (ref.output_token_ids, ref.text)
