"""The HTTP route that publishes a new checkpoint to an elastic bundled server whose
weights are in the pool: ``POST /kvpool/weights`` ``{"checkpoint": DIR}``
(:func:`kvpool.engine_adapters.bundled.weight_publish.publish`: the engine switches weight
sets between steps, its KV stays).

Answers ``{"key", "bytes", "bytes_copied", "loaded", "deferred", "evicted", "seconds"}``;
400 for a checkpoint that is missing or does not match the model, or an engine whose
weights are not in the pool; 409 while requests run; 503 when the daemon cannot give the
new set its memory (the old weights serve on). It changes the server's state, so it
answers only what :mod:`kvpool.control_token` admits, as ``/sleep`` does.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from kvpool.client_lib.errors import KvpoolError
from kvpool.control_token import ControlGate
from kvpool.elastic_server import control_auth
from kvpool.engine_adapters.bundled.weight_publish import PublishError, publish

if TYPE_CHECKING:
    from kvpool.engine.engine import Engine


class PublishBody(BaseModel):
    """``POST /kvpool/weights``: the checkpoint folder to serve from the next step on."""

    checkpoint: str


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status)


def add_routes(app: FastAPI, engine: Engine, gate: ControlGate) -> None:
    """``POST /kvpool/weights`` on ``app`` for ``engine`` (for whom ``gate`` admits)."""
    admitted = [Depends(control_auth.guard(app, gate))]

    @app.post("/kvpool/weights", dependencies=admitted)
    async def publish_weights(body: PublishBody) -> Any:
        try:
            done = await asyncio.to_thread(publish, engine, body.checkpoint)
        except PublishError as e:
            return _error(409 if e.busy else 400, str(e), "busy" if e.busy else "bad_checkpoint")
        except KvpoolError as e:
            return _error(503, f"the new weight set was not made ({e}); the last one serves",
                          "no_memory")
        return {"key": done.key, "bytes": done.nbytes, "bytes_copied": done.bytes_copied,
                "loaded": done.loaded, "deferred": done.deferred, "evicted": done.evicted,
                "seconds": done.seconds}
