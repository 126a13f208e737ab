"""Who may publish weights to a vLLM tenant (``POST /kvpool/weights``,
:mod:`kvpool.engine_adapters.vllm.weight_routes`): :mod:`kvpool.control_token` for the
address vLLM listens on, checked before the body is read or the engine is reached (the
route itself, on a bare FastAPI app: no engine behind it)."""

from __future__ import annotations

from argparse import Namespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

pytest.importorskip("vllm")

from kvpool.engine_adapters.vllm.weight_routes import router  # noqa: E402

TOKEN = "t0ken-of-sixteen-chars"


def client(host: str | None) -> TestClient:
    app = FastAPI()
    app.include_router(router())
    app.state.args = Namespace(host=host)
    return TestClient(app)


@pytest.mark.parametrize("host, token, header, status, says", [
    ("127.0.0.1", TOKEN, None, 401, "Authorization: Bearer"),
    ("127.0.0.1", TOKEN, "Bearer wrong-token-of-16chars", 403, "wrong token"),
    (None, None, None, 403, "without KVPOOL_CONTROL_TOKEN"),
    ("0.0.0.0", None, None, 403, "without KVPOOL_CONTROL_TOKEN"),
    ("127.0.0.1", "short", None, 403, "control routes are off"),
])
def test_refused_before_anything(monkeypatch, host, token, header, status, says):
    monkeypatch.delenv("KVPOOL_CONTROL_TOKEN_FILE", raising=False)
    if token is None:
        monkeypatch.delenv("KVPOOL_CONTROL_TOKEN", raising=False)
    else:
        monkeypatch.setenv("KVPOOL_CONTROL_TOKEN", token)
    headers = {"Authorization": header} if header else {}
    r = client(host).post("/kvpool/weights", json={"checkpoint": "/nonexistent"},
                          headers=headers)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert says in message and "\n" not in message, message
