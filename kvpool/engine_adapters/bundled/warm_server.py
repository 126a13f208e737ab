"""Warm restart of an elastic bundled server (``kvpool serve MODEL --elastic
--handoff-from TENANT`` — located through the daemon, :mod:`.locate` — or ``URL``): the
new server asks the running one (``POST URL/pd/retire``) for
its prefix cache, which comes over as pages (:mod:`.handoff_cache`), then serves.

The old server (:class:`RetiringEngine`, every ``--elastic`` server) on ``/pd/retire``:
refuses new requests, lets the running ones finish, offers its cache's units to the
caller's tenant and answers with the :class:`~.handoff_cache.CacheHandover`; when the
new server claims them it is *retired* (every request is refused, ``/health`` says 503;
stop it). If nobody claims before the ticket expires it serves on with its cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel

from kvpool.engine.async_engine import AsyncEngine, _Add
from kvpool.engine.config import EngineConfig
from kvpool.engine.errors import RequestError
from kvpool.engine_adapters.bundled import handoff_cache

log = logging.getLogger("kvpool.warm")


@dataclass
class _Retire:
    to: str
    ttl_s: float
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]


class RetireBody(BaseModel):
    """``POST /pd/retire``: the tenant name of the engine taking over, the ticket's ttl."""

    to: str
    ttl_s: float = 10.0


class RetiringEngine(AsyncEngine):
    """An AsyncEngine that can hand its prefix cache to a successor and retire."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self._retire: _Retire | None = None
        self._offer: tuple[handoff_cache.CacheHandover, Any] | None = None
        self.retired = False

    async def retire(self, to: str, ttl_s: float) -> dict[str, Any]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._inbox.put(_Retire(to, ttl_s, asyncio.get_running_loop(), q))
        item = await q.get()
        if isinstance(item, BaseException):
            raise item
        return {"cache": asdict(item)}

    @property
    def alive(self) -> bool:
        return super().alive and not self.retired

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, _Retire):
            if self._retire is not None or self.retired:
                cmd.loop.call_soon_threadsafe(
                    cmd.out.put_nowait, RequestError("this server is retiring already"))
            else:
                self._retire = cmd
            return
        if isinstance(cmd, _Add) and (self._retire is not None or self.retired):
            why = "retired" if self.retired else "retiring"
            cmd.loop.call_soon_threadsafe(cmd.out.put_nowait, RequestError(
                f"this server is {why}: its cache went to the engine that replaces it"))
            return
        super()._handle(cmd)

    def _drain(self, block: bool) -> list[Any]:
        if self._retire is not None:
            self._step_retire()
            if block and self._retire is not None:
                time.sleep(0.002)
                block = False
        return super()._drain(block)

    def _step_retire(self) -> None:
        r = self._retire
        assert r is not None
        if self._offer is None:
            if self.engine.has_unfinished():
                return  # the running requests finish first (no new ones are admitted)
            try:
                with self._lock:
                    self._offer = handoff_cache.offer_cache(self.engine, r.to, r.ttl_s)
            except Exception as e:  # noqa: BLE001 - the caller hears of it
                self._retire = None
                r.loop.call_soon_threadsafe(r.out.put_nowait, RequestError(str(e)))
                return
            r.loop.call_soon_threadsafe(r.out.put_nowait, self._offer[0])
            return
        c, ticket = self._offer
        if not ticket.settled:
            return
        with self._lock:
            state = handoff_cache.settle_cache(self.engine, c, ticket, 0)
        self._offer, self._retire = None, None
        self.retired = state == "claimed"
        log.warning("cache handoff to %s: %s%s", r.to, state,
                    "; this server is retired" if self.retired else "")


def take_over(engine: Any, url: str, to: str, timeout_s: float = 120.0) -> int:
    """Ask the server at ``url`` for its prefix cache and adopt it; returns the entries.
    Raises RuntimeError (one line) when it cannot."""
    import httpx

    try:
        reply = httpx.post(f"{url.rstrip('/')}/pd/retire", json={"to": to},
                           timeout=timeout_s)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach {url} for its cache: {e}") from None
    if reply.status_code != 200:
        raise RuntimeError(f"{url} did not hand its cache over: {reply.text[:200]}")
    c = handoff_cache.CacheHandover.from_json(reply.json()["cache"])
    return handoff_cache.adopt_cache(engine, c)


def serve_elastic(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
                  log_level: str = "info", handoff_from: str | None = None) -> None:
    """``kvpool serve --elastic`` (the config enabled already): like the plain server,
    plus ``/pd/retire``; with ``handoff_from`` it first takes that server's cache over."""
    import uvicorn

    from kvpool.engine.engine import Engine
    from kvpool.engine.server import create_app
    from kvpool.engine_adapters.bundled import bridge_of, locate

    locate.announce(config, host, port)  # our tenant registers where it serves
    engine = Engine(config)
    if handoff_from:
        bridge = bridge_of(config)
        name = bridge.tenant.name if bridge is not None and bridge.tenant else ""
        try:  # a tenant name is located through the daemon (locate.resolve)
            n = take_over(engine, locate.resolve(bridge, handoff_from), name)
            log.warning("took over %d cached blocks from %s", n, handoff_from)
        except Exception:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
            raise
    aengine = RetiringEngine(engine)
    app = create_app(aengine)

    @app.post("/pd/retire")
    async def retire(body: RetireBody) -> dict[str, Any]:
        return await aengine.retire(body.to, body.ttl_s)

    uvicorn.run(app, host=host, port=port, log_level=log_level)
