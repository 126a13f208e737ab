"""The control routes' check as the server answers it (:mod:`kvpool.control_token`
decides): :func:`guard` is a route dependency that refuses, before the route's query
or body is read, in OpenAI's error shape (401 with ``WWW-Authenticate: Bearer``, or
403), one line."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvpool.control_token import ControlGate


class ControlRefused(Exception):
    """A control request ``gate`` refused; ``response`` is the answer."""

    def __init__(self, response: JSONResponse) -> None:
        super().__init__("control request refused")
        self.response = response


def refusal(gate: ControlGate, request: Request) -> JSONResponse | None:
    """The answer to a control ``request`` that ``gate`` refuses, or None."""
    refused = gate.refusal(request.headers.get("authorization"))
    if refused is None:
        return None
    status, message = refused
    code = "unauthorized" if status == 401 else "forbidden"
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "code": code}}, status,
                        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


def guard(app: FastAPI, gate: ControlGate) -> Callable[[Request], Awaitable[None]]:
    """The dependency of ``app``'s control routes (``dependencies=[Depends(...)]``);
    installs the handler that answers its refusals."""

    async def answer(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ControlRefused)
        return exc.response

    app.add_exception_handler(ControlRefused, answer)

    async def check(request: Request) -> None:
        response = refusal(gate, request)
        if response is not None:
            raise ControlRefused(response)

    return check
