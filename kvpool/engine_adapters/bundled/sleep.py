"""Sleep and wake of an elastic bundled server: what it releases, and its HTTP routes.

:class:`BundledSleep` is the bundled engine's :class:`~kvpool.engine_adapters.sleep.
SleepTarget`: asleep, the tenant holds nothing in the pool. ``release_all`` (under the
engine's ``step_lock``, refused if a request is in the engine) evicts the prefix cache,
frees the null block and suspends the allocator (every chunk released, no refill: the
pool's :meth:`~kvpool.engine_adapters.elastic.ElasticPolicy.sleep`), then releases the weight set
(:meth:`~kvpool.engine_adapters.bundled.weights.PoolWeights.release`: unmapped and
detached, the virtual range kept, so the parameters keep their addresses). ``restore``
re-attaches the weights (warm when the daemon still caches the set, else reloaded from
the checkpoint) and takes the null block's chunk back; the rest of the KV comes back
lazily as requests allocate. With ``--weights local`` (no pool weights) only the KV goes.

:func:`attach` builds the :class:`~kvpool.engine_adapters.sleep.SleepController` of a
built engine (its tenant's sleep handler, the idle timer of ``KVPOOL_SLEEP_AFTER``) and
:func:`add_routes` serves vLLM's routes over it: ``POST /sleep`` (``{"status":
"sleeping", "level": L}``; 409 while requests run), ``POST /wake_up`` (``{"status":
"awake", "tags": null}``; 503 when the memory did not come), ``GET /is_sleeping``
(``{"is_sleeping": bool}``). ``level`` (0-2) and ``mode`` are accepted as vLLM does;
every level releases everything here, and a busy server refuses whatever the mode.
``GET /kvpool/sleep`` adds the counts: ``{"is_sleeping", "state", "sleeps": {reason: n},
"wakes"}`` (reasons ``idle``, ``pressure``, ``operator``, ``http``; read by a fleet,
:mod:`kvpool.fleet.supervisor`). ``/sleep`` and ``/wake_up`` change the server's state:
they answer only what :mod:`kvpool.control_token` admits (the bearer token of
``KVPOOL_CONTROL_TOKEN``; without one, a server on a loopback address alone), checked
before the query is read; the two ``GET`` routes are open.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Query
from fastapi.responses import JSONResponse

from kvpool.control_token import ControlGate
from kvpool.engine_adapters.bundled import control_auth
from kvpool.engine_adapters.bundled.block_pool import elastic_pool
from kvpool.engine_adapters.sleep import SleepController, SleepRefused

if TYPE_CHECKING:
    from kvpool.engine.engine import Engine
    from kvpool.engine_adapters.bundled.block_pool import ElasticBlockPool

log = logging.getLogger("kvpool.sleep")


class Weights(Protocol):
    """The engine's weights in the pool (:class:`~.weights.PoolWeights`)."""

    held: bool

    def release(self) -> None: ...

    def restore(self) -> bool: ...


class BundledSleep:
    """What a bundled engine gives back asleep and takes back awake (see the module)."""

    def __init__(self, engine: Engine, pool: ElasticBlockPool, weights: Weights | None
                 ) -> None:
        self.engine = engine
        self.pool = pool
        self.weights = weights
        self.warm_wakes = self.cold_wakes = 0

    def busy(self) -> bool:
        return self.engine.has_unfinished() or bool(self.engine.detached)

    def release_all(self) -> None:
        with self.engine.step_lock:  # between steps; no request is admitted meanwhile
            if self.busy():
                raise SleepRefused("requests are running")
            self.pool.policy.sleep()
            if self.weights is not None and self.weights.held:
                self.weights.release()

    def restore(self) -> None:
        if self.weights is not None and not self.weights.held:
            if self.weights.restore():
                self.warm_wakes += 1
            else:
                self.cold_wakes += 1
        self.pool.policy.wake()


def attach(engine: Engine) -> SleepController | None:
    """The sleep controller of an elastic engine built from an enabled config, registered
    as its tenant's sleep handler and kept by its bridge (closed with it); its idle timer
    runs with ``KVPOOL_SLEEP_AFTER``. None when the engine is not elastic."""
    from kvpool.engine_adapters.bundled.bridge import bridge_of

    bridge = bridge_of(engine)
    if bridge is None or bridge.tenant is None:
        return None
    tenant = bridge.tenant
    controller = SleepController(BundledSleep(engine, elastic_pool(engine), bridge.weights),
                                 tenant, sleep_after_s=bridge.settings.sleep_after_s)
    bridge.sleep = controller
    tenant.set_sleep_handler(controller)
    controller.start()
    return controller


def add_routes(app: FastAPI, controller: SleepController, gate: ControlGate) -> None:
    """``POST /sleep``, ``POST /wake_up`` (for whom ``gate`` admits), ``GET /is_sleeping``
    (vLLM's shapes)."""
    admitted = [Depends(control_auth.guard(app, gate))]

    @app.post("/sleep", dependencies=admitted)
    async def sleep(level: Annotated[int, Query(ge=0, le=2)] = 1,
                    mode: Annotated[str, Query(pattern="^(abort|wait|keep)$")] = "abort"
                    ) -> Any:
        if not await asyncio.to_thread(controller.sleep, "http"):
            return JSONResponse({"error": {
                "message": "the model is serving requests; it sleeps only when idle",
                "type": "invalid_request_error", "code": "busy"}}, 409)
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up", dependencies=admitted)
    async def wake_up() -> Any:
        if not await asyncio.to_thread(controller.wake, "http"):
            return JSONResponse({"error": {
                "message": f"the model cannot wake: {controller.last_error}",
                "type": "server_error", "code": "wake_failed"}}, 503)
        return {"status": "awake", "tags": None}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": controller.is_sleeping}

    @app.get("/kvpool/sleep")
    async def sleep_counts() -> dict[str, Any]:
        """The state and what the controller counted (a fleet reads the causes here)."""
        return {"is_sleeping": controller.is_sleeping, "state": controller.state,
                "sleeps": dict(controller.sleeps_by_reason), "wakes": controller.wakes}
