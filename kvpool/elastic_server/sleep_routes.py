"""The HTTP routes of an elastic bundled server's sleep and wake, over its
:class:`~kvpool.engine_adapters.sleep_controller.SleepController` (built by
:func:`kvpool.engine_adapters.bundled.engine_sleep.attach`).

:func:`add_routes` serves vLLM's routes: ``POST /sleep`` (``{"status":
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
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query
from fastapi.responses import JSONResponse

from kvpool.control_token import ControlGate
from kvpool.elastic_server import control_auth
from kvpool.engine_adapters.sleep_controller import SleepController


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
