"""The sleep routes kvpool puts before vLLM's own (API server): ``POST /wake_up`` that answers for the wake, ``GET /kvpool/sleep`` with the counts.

vLLM serves ``/sleep``, ``/wake_up`` and ``/is_sleeping`` with ``VLLM_SERVER_DEV_MODE=1``
(its ``dev.sleep.api_router``); patches.py has :func:`attach_first` include these two
routes first, so they answer their paths:

* ``POST /wake_up`` calls the engine's ``wake_up`` as vLLM's route does (patched in the
  engine core to wake a sleep of kvpool's too: the answer comes once awake), through the
  engine core's utility ``kvpool_wake``, which returns a failure rather than raising it,
  and answers ``{"status": "awake" | "sleeping", "tags": ...}``; a wake that cannot get
  its memory is a 503 of one line (``{"error": {"message": "the model cannot wake: ...",
  "code": "wake_failed"}}``, the bundled server's answer) where vLLM's would be a bare
  500 (and a traceback in the log);
* ``GET /kvpool/sleep``: ``{"is_sleeping", "state", "sleeps": {reason: n}, "wakes"}``, the
  shape of the bundled server's route (:mod:`kvpool.elastic_server.sleep_routes`), read by
  a fleet for each sleep's cause (reasons ``idle``, ``pressure``, ``operator``, ``http``).
  The engine core's utility ``kvpool_sleep_state`` (:func:`sleep_state`) answers it.

Neither route is guarded: vLLM's dev routes are not either (a fleet's members listen on
loopback).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# (at the top: FastAPI reads the routes' annotations from this module's names)
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from kvpool.engine_adapters.sleep_controller import SleepController

STATE_UTILITY = "kvpool_sleep_state"  # the engine core's methods (patches.py)
WAKE_UTILITY = "kvpool_wake"
#: what vLLM's client puts before the message of a utility call that raised
_FAILED = "Call to wake_up method failed: "
_KVPOOL = "kvpool: cannot wake: "


def sleep_state(controller: SleepController | None, is_sleeping: bool) -> dict[str, Any]:
    """The body of ``GET /kvpool/sleep`` (engine core side): ``is_sleeping`` is the
    engine's (vLLM's sleep or kvpool's); no controller (no elastic KV): no counts."""
    if controller is None:
        return {"is_sleeping": is_sleeping, "state": "asleep" if is_sleeping else "awake",
                "sleeps": {}, "wakes": 0}
    return {"is_sleeping": is_sleeping, "state": controller.state,
            "sleeps": dict(controller.sleeps_by_reason), "wakes": controller.wakes}


def wake_failure(e: BaseException) -> str:
    """The one line a failed wake answers (vLLM's and kvpool's prefixes taken off)."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else type(e).__name__
    for prefix in (_FAILED, _KVPOOL):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return f"the model cannot wake: {text}"[:300]


def attach_first(original: Callable[[FastAPI], None]) -> Callable[[FastAPI], None]:
    """vLLM's ``attach_router`` that includes kvpool's routes before vLLM's."""

    def attach_router(app: FastAPI) -> None:
        app.include_router(_router())
        original(app)

    return attach_router


def _router() -> APIRouter:
    router = APIRouter()

    @router.post("/wake_up")
    async def wake_up(raw_request: Request) -> JSONResponse:
        tags = raw_request.query_params.getlist("tags") or None
        engine = raw_request.app.state.engine_client
        try:
            awake, why = await engine.engine_core.call_utility_async(WAKE_UTILITY, tags)
        except Exception as e:  # the engine core did not answer (it died, say)
            awake, why = False, wake_failure(e)
        if why:
            return JSONResponse({"error": {"message": why, "type": "server_error",
                                           "code": "wake_failed"}}, 503)
        stats = getattr(engine, "logger_manager", None)
        if awake and stats is not None:  # (what vLLM's AsyncLLM.wake_up records)
            stats.record_sleep_state(0, 0)
        return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags})

    @router.get("/kvpool/sleep")
    async def kvpool_sleep(raw_request: Request) -> JSONResponse:
        client = raw_request.app.state.engine_client.engine_core
        return JSONResponse(await client.call_utility_async(STATE_UTILITY))

    return router
