"""The elastic bundled server (``kvpool serve MODEL --elastic``): the plain server's
routes, sleep and wake (:mod:`.sleep`: ``/sleep``, ``/wake_up``, ``/is_sleeping``, every
request admitted through the sleep controller, which wakes a sleeping model first), a new
checkpoint published between steps (:mod:`.weight_routes`: ``/kvpool/weights``), and
warm restart (``kvpool serve MODEL --elastic
--handoff-from TENANT`` — located through the daemon, :mod:`.locate` — or ``URL``): the
new server asks the running one (``POST URL/pd/retire``) for
its prefix cache, which comes over as pages (:mod:`.handoff_cache`), then serves.

The old server (:class:`~.warm_engine.RetiringEngine`, every ``--elastic`` server) on
``/pd/retire``: by default detaches every request at once and offers them with its
cache's units to the caller's tenant, answering with the
:class:`~.handoff_cache.CacheHandover`; the new server claims them and its engine goes on
with the requests where they were, while the old one relays their streams from the new
one's ``/pd/follow/{id}`` and forwards requests that arrive meanwhile to its
``/pd/adopt`` (:mod:`.warm_relay`); the old one ends *retired* (requests refused,
``/health`` 503; stop it). With ``{"in_flight": false}`` it drains first (new requests
wait), then hands over the cache alone. If nobody claims before the ticket expires it
serves on with its cache and requests.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel

from kvpool.control_token import ControlGate, ControlTokenError
from kvpool.engine.errors import RequestError
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.serving.api_bodies import public_sampling
from kvpool.engine_adapters.bundled import handoff_cache
from kvpool.elastic_server import relay_auth
from kvpool.elastic_server import retire_auth
from kvpool.elastic_server import warm_relay
from kvpool.engine_adapters.bundled.bridge import BundledBridge
from kvpool.engine_adapters.bundled.memory_view import ElasticMemory
from kvpool.elastic_server.warm_engine import RetiringEngine

log = logging.getLogger("kvpool.warm")


class RetireBody(BaseModel):
    """``POST /pd/retire``: the tenant name of the engine taking over, the ticket's ttl,
    whether the in-flight requests move too, and then where the new server serves."""

    to: str
    ttl_s: float = 10.0
    in_flight: bool = True
    url: str | None = None


class AdoptBody(BaseModel):
    """``POST /pd/adopt``: a request the old server forwards (token ids, its params)."""

    id: str
    prompt: list[int]
    params: dict[str, Any]


def take_over(engine: Any, url: str, to: str, timeout_s: float = 120.0,
              follow_url: str | None = None) -> tuple[int, str | None]:
    """Ask the server at ``url`` for its prefix cache and adopt it; returns the entries
    and the name of the tenant whose offer it was (the daemon's word, ``Claimed``). With ``follow_url`` (where this server will serve) its in-flight requests come too
    and run in ``engine`` (the old server relays their streams from there); without, it
    drains them first. Raises RuntimeError (one line) when it cannot."""
    import httpx

    body = {"to": to, "in_flight": follow_url is not None, "url": follow_url}
    try:
        reply = httpx.post(f"{url.rstrip('/')}/pd/retire", json=body, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach {url} for its cache: {e}") from None
    if reply.status_code != 200:
        raise RuntimeError(f"{url} did not hand its cache over: {reply.text[:200]}")
    c = handoff_cache.CacheHandover.from_json(reply.json()["cache"])
    from kvpool.client_lib import KvpoolError

    try:  # (a refused claim, e.g. not the located tenant's offer: one line, no trace)
        entries = handoff_cache.adopt_cache(engine, c)
    except KvpoolError as e:
        raise RuntimeError(f"the cache {url} handed over cannot be claimed: {e}") from None
    from kvpool.client_lib import handoff
    from kvpool.engine_adapters.bundled import bridge_of

    bridge = bridge_of(engine)
    tenant = bridge.tenant if bridge is not None else None
    return entries, (handoff.of(tenant).giver_of(c.ticket) if tenant is not None else None)


def serve_elastic(bridge: BundledBridge, host: str = "127.0.0.1", port: int = 8000,
                  log_level: str = "info", handoff_from: str | None = None) -> None:
    """``kvpool serve --elastic`` (``bridge``: what ``enable`` returned, its engine not
    built yet): like the plain server,
    plus ``/pd/retire`` and the sleep routes; with ``handoff_from`` it first takes that
    server's cache over."""
    import uvicorn

    from kvpool import paths
    from kvpool.client_lib.connection import probe
    from kvpool.engine.engine import Engine
    from kvpool.engine.serving.server import create_app
    from kvpool.elastic_server import locate, sleep_routes, weight_routes
    from kvpool.engine_adapters.bundled import engine_sleep

    try:  # who may use /sleep and /wake_up (kvpool.control_token): checked before loading
        gate = ControlGate.of(host, os.environ)
    except ControlTokenError as e:
        raise RuntimeError(str(e)) from None
    # a missing daemon is one line (DaemonUnavailable) before any TP rank starts
    probe(paths.run_dir(bridge.settings.run_dir))
    locate.announce(bridge, host, port)  # our tenant registers where it serves
    engine = Engine(bridge.config, bridge.seams)
    giver = None
    if handoff_from:
        name = bridge.tenant.name if bridge.tenant else ""
        try:  # a tenant name is located through the daemon (locate.resolve)
            n, giver = take_over(engine, locate.resolve(bridge, handoff_from), name,
                                 follow_url=_own_url(host, port))
            log.warning("took over %d cached blocks and %d requests from %s", n,
                        len(engine.requests), handoff_from)
        except Exception:
            engine.close()
            raise
    controller = engine_sleep.attach(engine)
    aengine = RetiringEngine(engine, adopted=list(engine.requests), gate=controller)
    # /metrics: KV use over what it holds plus what the daemon would grant at once
    app = create_app(aengine, memory=ElasticMemory(engine, bridge))
    add_routes(app, aengine, relay_auth.RelayAuth(engine, giver))
    if controller is not None:
        sleep_routes.add_routes(app, controller, gate)
    weight_routes.add_routes(app, engine, gate)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def add_routes(app: FastAPI, aengine: RetiringEngine, relay: relay_auth.RelayGate) -> None:
    """``/pd/retire`` (as the old server), ``/pd/follow/{id}`` and ``/pd/adopt`` (as the
    new one: the streams the old server relays, JSON lines of :mod:`.warm_relay`). The
    relay routes answer only the server this one took over from (``relay``, 403 to
    anyone else); ``/pd/adopt`` takes only the public sampling parameters, and an id in
    use is refused at once (409)."""
    from fastapi.responses import JSONResponse, StreamingResponse

    adopting: set[str] = set()  # ids of /pd/adopt streams open now (the loop's)
    vocab = aengine.engine.model_config.vocab_size

    @app.post("/pd/retire")
    async def retire(body: RetireBody, request: Request) -> Any:
        refused = await retire_auth.refusal(aengine.engine, body.to, body.ttl_s, request,
                                             body.url)
        if refused is not None:  # only tenant `to` itself, a bounded ttl (retire_auth)
            return refused
        return await aengine.retire(body.to, body.ttl_s, body.in_flight, body.url)

    @app.get("/pd/follow/{rid}")
    async def follow(rid: str, request: Request) -> Any:
        refused = await relay.refusal(request, "follow")
        if refused is not None:
            return refused
        try:
            outs = await aengine.follow(rid)
        except LookupError as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error",
                                           "code": "not_found"}}, 404)
        return StreamingResponse(warm_relay.lines(outs), media_type="application/x-ndjson")

    @app.delete("/pd/follow/{rid}")
    async def drop(rid: str, request: Request) -> Any:
        refused = await relay.refusal(request, "drop")
        if refused is not None:
            return refused
        aengine.drop_soon(rid)  # only an adopted request nobody follows
        return {"dropped": rid}

    @app.post("/pd/adopt")
    async def adopt(body: AdoptBody, request: Request) -> Any:
        refused = await relay.refusal(request, "adopt")
        if refused is not None:
            return refused
        try:
            params = SamplingParams(**public_sampling(body.params, vocab))
        except (TypeError, ValueError) as e:
            raise RequestError(f"sampling parameters: {e}") from None
        ids = aengine.engine.encode(body.prompt)
        if body.id in adopting or body.id in aengine.engine.requests:  # no await since
            return JSONResponse({"error": {"message": f"request id {body.id[:80]!r} is in "
                                           f"use", "type": "invalid_request_error",
                                           "code": "conflict"}}, 409)
        adopting.add(body.id)

        async def stream() -> Any:
            try:
                async for line in warm_relay.lines(aengine.generate(body.id, ids, params)):
                    yield line
            finally:
                adopting.discard(body.id)

        return StreamingResponse(stream(), media_type="application/x-ndjson")


def _own_url(host: str, port: int) -> str:
    """Where this server will listen, as a loopback client reaches it."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
