"""The HTTP route that publishes new weights to an elastic bundled server whose weights
are in the pool: ``POST /kvpool/weights`` ``{"checkpoint": DIR}`` (a copy:
:func:`kvpool.engine_adapters.bundled.weight_publish.publish`, the engine switches weight
sets between steps, its KV stays) or ``{"mutable": NONCE, "version": V}`` (in place:
:func:`~kvpool.engine_adapters.bundled.weight_publish.follow`, the engine reads version
``V``, default the current one, of the trainer's mutable set named by ``NONCE``, 32 to
64 lower-case hex digits; no byte copied).

Answers ``{"key", "bytes", "bytes_copied", "loaded", "deferred", "evicted", "seconds",
"version"}``; 400 for a body that names neither or both, a checkpoint that is missing or
does not match the model, a nonce of no set of this engine's layout, a version that is
not the current one, or an engine whose weights are not in the pool; 409 while requests
run; 503 when the daemon cannot give the new set its memory (the old weights serve on). It changes the server's state, so it
answers only what :mod:`kvpool.control_token` admits, as ``/sleep`` does.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from kvpool.client_lib.errors import KvpoolError
from kvpool.control_token import ControlGate
from kvpool.elastic_server import control_auth
from kvpool.engine_adapters.bundled.weight_publish import PublishError, follow, publish

if TYPE_CHECKING:
    from kvpool.engine.engine import Engine


class PublishBody(BaseModel):
    """``POST /kvpool/weights``: the checkpoint folder to serve from the next step on,
    or a trainer's mutable set (its nonce) and the version to read."""

    checkpoint: str | None = None
    mutable: str | None = None
    version: int | None = None


NONCE = re.compile(r"[0-9a-f]{32,64}")
MAX_VERSION = (1 << 63) - 1


def _body_problem(body: PublishBody) -> str | None:
    """Why ``body`` is refused before anything runs (one line), or None."""
    if (body.checkpoint is None) == (body.mutable is None):
        return 'give one of "checkpoint" (a folder) and "mutable" (a nonce)'
    if body.mutable is not None and not NONCE.fullmatch(body.mutable):
        return '"mutable" is a nonce of 32 to 64 lower-case hex digits'
    if body.version is not None and (body.mutable is None
                                     or not 1 <= body.version <= MAX_VERSION):
        return '"version" is a positive integer, with "mutable" only'
    return None


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status)


def add_routes(app: FastAPI, engine: Engine, gate: ControlGate) -> None:
    """``POST /kvpool/weights`` on ``app`` for ``engine`` (for whom ``gate`` admits)."""
    admitted = [Depends(control_auth.guard(app, gate))]

    @app.post("/kvpool/weights", dependencies=admitted)
    async def publish_weights(body: PublishBody) -> Any:
        problem = _body_problem(body)
        if problem is not None:
            return _error(400, problem, "bad_request")
        try:
            if body.mutable is not None:
                done = await asyncio.to_thread(follow, engine, body.mutable, body.version)
            else:
                assert body.checkpoint is not None
                done = await asyncio.to_thread(publish, engine, body.checkpoint)
        except PublishError as e:
            return _error(409 if e.busy else 400, str(e), "busy" if e.busy else "bad_checkpoint")
        except KvpoolError as e:
            return _error(503, f"the new weight set was not made ({e}); the last one serves",
                          "no_memory")
        return {"key": done.key, "bytes": done.nbytes, "bytes_copied": done.bytes_copied,
                "loaded": done.loaded, "deferred": done.deferred, "evicted": done.evicted,
                "seconds": done.seconds, "version": done.version}
