"""The fleet's one OpenAI-compatible endpoint: :func:`create_app`.

Routes:

* ``POST /v1/completions``, ``POST /v1/chat/completions``: routed by the body's
  ``model`` to that model's :class:`~kvpool.fleet.admission.ModelQueue` (a replica, or a
  bounded wait for one), then passed through (:func:`kvpool.fleet.proxy.forward`).
  The body is untrusted: more than ``MAX_BODY`` bytes is a 413, a body that is not a
  JSON object (or nests deeper than the parser goes) a 400, a ``model`` that is
  missing or names no model of the fleet a 404 in the shape a single server answers (``{"error": {"message", "type", "code":
  "model_not_found"}}``); the model's name is echoed at most ``SHOWN`` characters long
  and never becomes a metric label. Everything else in the body is the server's to check
  (its 400s pass through). A full queue: 429 with ``Retry-After``; no replica can serve
  (failed to start, could not wake, hung): 503 with ``Retry-After``.
* ``GET /v1/models``: every model (OpenAI's list) with its ``state`` (``awake`` if a
  replica is, else ``asleep``, ``starting``, ``hung``, ``failed``, ``stopped`` in that
  order: a member that stopped answering shows ``hung``) and
  its ``replicas`` (``index``, ``state``, ``url``: the loopback address of its server,
  null when it has none).
* ``GET /health``: 200 ``{"status": "ok", "models": {name: state}}`` while the fleet serves.
* ``GET /metrics``: Prometheus text (:mod:`kvpool.fleet.metrics`), with the router's
  model-server protocol for the fleet's own queue (:mod:`kvpool.fleet.router_protocol`).

The app's lifespan starts the supervisor (eager members, the watch) and the task that
keeps the endpoints file current (when asked for) and, at shutdown, stops every member,
closes the upstream client and empties the endpoints file.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpool.fleet import proxy
from kvpool.fleet.admission import ModelQueue, QueueFull, Unavailable
from kvpool.fleet.balance import prompt_of
from kvpool.fleet.endpoints_file import EndpointsFile, EndpointsFileError
from kvpool.fleet.member import (ASLEEP, AWAKE, FAILED, HUNG, STARTING, STOPPED, Member,
                                 MemberState)
from kvpool.fleet.metrics import CONTENT_TYPE, UNKNOWN, FleetMetrics
from kvpool.fleet.supervisor import Supervisor

MAX_BODY = 32 << 20  # bytes of one request body
SHOWN = 64  # characters of a client's model name echoed in a 404
STATE_ORDER: tuple[MemberState, ...] = (AWAKE, ASLEEP, STARTING, HUNG, FAILED, STOPPED)


class BodyTooLarge(Exception):
    pass


def model_state(members: Sequence[Member]) -> MemberState:
    """The state a model shows: its replicas' best (see the module)."""
    states = {m.state for m in members}
    return next((s for s in STATE_ORDER if s in states), STOPPED)


def create_app(queues: Mapping[str, ModelQueue], supervisor: Supervisor,
               metrics: FleetMetrics, client: httpx.AsyncClient,
               eager: Sequence[str] = (), endpoints: EndpointsFile | None = None) -> FastAPI:
    """The fleet's app over ``queues`` (one per model, in the fleet file's order);
    ``endpoints``: the endpoints file it keeps current (:mod:`kvpool.fleet.endpoints_file`)."""
    created = int(time.time())

    def states() -> dict[str, str]:
        return {name: model_state(q.members) for name, q in queues.items()}

    async def keep_endpoints(file: EndpointsFile) -> None:
        """Rewrite the file at every change of a member's state (and each poll)."""
        said = ""
        while True:
            try:
                file.update(states())
                said = ""
            except EndpointsFileError as e:
                if str(e) != said:  # once per new problem, not every poll
                    said = str(e)
                    supervisor.say(f"fleet: {e}")
            await supervisor.wait_change(supervisor.poll_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        supervisor.start(eager)
        keeper = None if endpoints is None else asyncio.create_task(
            keep_endpoints(endpoints), name="fleet-endpoints")
        try:
            yield
        finally:
            if keeper is not None:
                keeper.cancel()
            await supervisor.close()
            await client.aclose()
            if endpoints is not None:
                try:
                    endpoints.close()  # no endpoint left
                except EndpointsFileError as e:
                    supervisor.say(f"fleet: {e}")

    app = FastAPI(title="kvpool fleet", lifespan=lifespan)

    def served() -> str:
        return ", ".join(repr(name) for name in queues)

    def not_found(message: str) -> JSONResponse:
        metrics.requests.labels(UNKNOWN, UNKNOWN, "404").inc()
        return proxy.error(404, message, "model_not_found")

    async def handle(request: Request, path: str) -> Response:
        try:
            body = await _read_body(request)
        except BodyTooLarge:
            metrics.requests.labels(UNKNOWN, UNKNOWN, "413").inc()
            return proxy.error(413, f"the request body is larger than {MAX_BODY} bytes",
                               "invalid_request")
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            metrics.requests.labels(UNKNOWN, UNKNOWN, "400").inc()
            return proxy.error(400, f"invalid request body: not JSON ({str(e)[:80]})",
                               "invalid_request")
        except RecursionError:  # deeper than the parser goes: no request nests so
            metrics.requests.labels(UNKNOWN, UNKNOWN, "400").inc()
            return proxy.error(400, "invalid request body: JSON nested too deeply",
                               "invalid_request")
        if not isinstance(parsed, dict):
            metrics.requests.labels(UNKNOWN, UNKNOWN, "400").inc()
            return proxy.error(400, "invalid request body: expected a JSON object",
                               "invalid_request")
        name = parsed.get("model")
        if name is None:
            return not_found(f"the request names no model; this fleet serves {served()}")
        if not isinstance(name, str):
            metrics.requests.labels(UNKNOWN, UNKNOWN, "400").inc()
            return proxy.error(400, "invalid request body: model: expected a string",
                               "invalid_request")
        queue = queues.get(name)
        if queue is None:
            shown = name if len(name) <= SHOWN else name[:SHOWN] + "..."
            return not_found(f"model {shown!r} not found; this fleet serves {served()}")
        try:
            answered, got = await proxy.until_disconnect(
                request, queue.acquire(prompt_of(parsed)))
        except QueueFull as e:
            metrics.requests.labels(name, UNKNOWN, "429").inc()
            return proxy.error(429, str(e), "queue_full",
                               {"Retry-After": str(e.retry_after_s)})
        except Unavailable as e:
            metrics.requests.labels(name, UNKNOWN, "503").inc()
            return proxy.error(503, str(e), "unavailable",
                               {"Retry-After": str(e.retry_after_s)})
        if not answered or got is None:
            metrics.requests.labels(name, UNKNOWN, str(proxy.CLIENT_GONE)).inc()
            return Response(status_code=proxy.CLIENT_GONE)
        member, reason = got
        metrics.routed.labels(name, str(member.index), reason).inc()
        released = False

        def done(status: int) -> None:
            nonlocal released
            if not released:
                released = True
                queue.release(member)
                metrics.requests.labels(name, str(member.index), str(status)).inc()

        try:
            return await proxy.forward(client, member, path, body,
                                       parsed.get("stream") is True, request, metrics, done)
        except BaseException:
            done(500)
            raise

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "kvpool",
            "state": model_state(q.members),
            "replicas": [{"index": m.index, "state": m.state,
                          "url": None if m.state == STOPPED else m.url} for m in q.members],
        } for name, q in queues.items()]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok",
                "models": {name: model_state(q.members) for name, q in queues.items()}}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _read_body(request: Request) -> bytes:
    """The whole body, refused past ``MAX_BODY`` (by its declared length, or as read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise BodyTooLarge
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise BodyTooLarge
        parts.append(chunk)
    return b"".join(parts)
