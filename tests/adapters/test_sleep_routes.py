"""The sleep routes and request gating of the bundled server, in-process (no daemon):
an Engine of the tiny model behind ``create_app`` with a SleepController over a fake
target, so a wake that cannot get memory can be forced. What the real servers do with
real memory is tests/adapters/test_sleep_bundled.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpool.control_token import ControlGate
from kvpool.demo.cluster import free_port
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine_adapters.sleep_controller import SleepController

from .test_sleep_controller import FakeTarget

PROMPT = list(range(20, 52))


@pytest.fixture(scope="module")
def served(tiny_model) -> Iterator[tuple[str, SleepController, FakeTarget]]:
    import uvicorn

    from kvpool.engine.serving.async_engine import AsyncEngine
    from kvpool.engine.serving.server import create_app
    from kvpool.elastic_server.sleep_routes import add_routes

    engine = Engine(EngineConfig(model=str(tiny_model), kv_cache_size="2MiB"))
    target = FakeTarget()
    controller = SleepController(target, None)
    app = create_app(AsyncEngine(engine, gate=controller))
    add_routes(app, controller, ControlGate(None, "127.0.0.1"))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                        log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    with httpx.Client() as c:
        for _ in range(600):
            try:
                if c.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                threading.Event().wait(0.05)
    yield url, controller, target
    srv.should_exit = True
    t.join(30)


def complete(url: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw})


def test_a_wake_that_gets_no_memory_is_a_503_of_one_line(served) -> None:
    url, controller, target = served
    want = complete(url).json()["choices"][0]["text"]
    assert httpx.post(f"{url}/sleep", timeout=60).json() == {"status": "sleeping",
                                                            "level": 1}
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    target.fail_restore = RuntimeError("NO_MEMORY: 2 pages not freed within 5 s")
    for r in (complete(url), complete(url, stream=True)):
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "unavailable" and "\n" not in err["message"]
        assert err["message"] == ("the model is asleep and cannot wake: NO_MEMORY: 2 pages "
                                  "not freed within 5 s"), err
    r = httpx.post(f"{url}/wake_up", timeout=60)
    assert r.status_code == 503 and "NO_MEMORY" in r.json()["error"]["message"], r.text
    assert controller.is_sleeping and controller.active == 0
    target.fail_restore = None  # the memory came: the next request wakes it, is served
    r = complete(url)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert not controller.is_sleeping and controller.active == 0
    assert httpx.post(f"{url}/wake_up").json() == {"status": "awake", "tags": None}


def test_sleep_while_a_request_is_admitted_is_409(served) -> None:
    url, controller, target = served
    controller.enter_blocking()
    try:
        r = httpx.post(f"{url}/sleep", timeout=60)
        assert r.status_code == 409 and r.json()["error"]["code"] == "busy", r.text
    finally:
        controller.leave()
    assert httpx.post(f"{url}/sleep", timeout=60).status_code == 200
    assert complete(url).status_code == 200  # woken again


@pytest.mark.parametrize("query", ["level=3", "level=-1", "level=x", "mode=nap"])
def test_bad_sleep_parameters_are_a_400(served, query) -> None:
    url, controller, _ = served
    r = httpx.post(f"{url}/sleep?{query}", timeout=60)
    assert r.status_code == 400 and "\n" not in r.json()["error"]["message"], r.text
    assert not controller.is_sleeping
