"""Passing one request through to a replica and its answer back: :func:`forward`.

* The request's body goes upstream as the client sent it (bytes), to the same path.
* A plain answer comes back whole, with the server's status and content type; a
  streamed one (``"stream": true`` and a 200) is passed through chunk by chunk as it
  arrives. A server's error answer (4xx, 503) is passed through unchanged.
* A client that hangs up aborts the upstream request: the connection to the server is
  closed (the bundled server and vLLM abort a request whose client is gone). While the
  answer streams, the ASGI server cancels the stream; before that, a watch on the
  client's connection (:func:`until_disconnect`) cancels the upstream call.
* A server that fails before answering: 502 (``upstream_error``). One that fails while
  streaming (it crashed, say): the client gets an SSE error event,
  ``data: {"error": {...}}``, then ``data: [DONE]``, and the stream ends; counted in
  ``kvpool_fleet_upstream_errors_total`` (``connect`` / ``broken``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvpool.fleet.member import Member
from kvpool.fleet.metrics import FleetMetrics

T = TypeVar("T")
CLIENT_GONE = 499  # counted for requests whose client hung up (nothing is sent)
#: upstream timeouts: connecting, and between two pieces of an answer
TIMEOUT = httpx.Timeout(connect=10.0, read=600.0, write=60.0, pool=None)
HEADERS = {"content-type": "application/json"}


def error(status: int, message: str, code: str,
          headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape, as a single bundled server answers
    (:func:`kvpool.engine.serving.server._error`)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status,
                        headers=headers)


async def _disconnected(request: Request) -> None:
    """Return once the client has hung up (the request's body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """``(True, result)`` of ``work``, or ``(False, None)`` when the client hung up first
    (``work`` is then cancelled). ``work``'s exceptions propagate."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return False, None
    return True, task.result()


async def forward(client: httpx.AsyncClient, member: Member, path: str, body: bytes,
                  stream: bool, request: Request, metrics: FleetMetrics,
                  done: Callable[[int], None]) -> Response:
    """Send the request to ``member`` and answer the client (see the module); ``done``
    is called once with the status counted, when the answer has ended."""
    url = f"{member.url}{path}"
    if not stream:
        try:
            answered, reply = await until_disconnect(
                request, client.post(url, content=body, headers=HEADERS, timeout=TIMEOUT))
        except httpx.HTTPError as e:
            done(502)
            return _upstream_failed(metrics, member, e)
        if not answered or reply is None:
            done(CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        done(reply.status_code)
        return Response(reply.content, reply.status_code,
                        media_type=reply.headers.get("content-type"))
    upstream = client.build_request("POST", url, content=body, headers=HEADERS,
                                    timeout=TIMEOUT)
    try:
        answered, resp = await until_disconnect(request, client.send(upstream, stream=True))
    except httpx.HTTPError as e:
        done(502)
        return _upstream_failed(metrics, member, e)
    if not answered or resp is None:
        done(CLIENT_GONE)
        return Response(status_code=CLIENT_GONE)
    if resp.status_code != 200:
        try:
            content = await resp.aread()
        except httpx.HTTPError as e:
            done(502)
            return _upstream_failed(metrics, member, e)
        finally:
            await resp.aclose()
        done(resp.status_code)
        return Response(content, resp.status_code, media_type=resp.headers.get("content-type"))
    relay = _Relay(resp, member, metrics, done)
    return _RelayedStream(relay, media_type=resp.headers.get("content-type"))


class _Relay:
    """One streamed answer on its way: the chunks, then :meth:`close` (once, however the
    stream ended: finished, broken, or cancelled before or while it ran)."""

    def __init__(self, resp: httpx.Response, member: Member, metrics: FleetMetrics,
                 done: Callable[[int], None]) -> None:
        self.resp, self.member, self.metrics, self.done = resp, member, metrics, done
        self.status = CLIENT_GONE  # until the stream ends otherwise
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        tail = b"\n\n"  # the end of what was passed on (an event cut short needs an end)
        try:
            async for chunk in self.resp.aiter_raw():
                if chunk:
                    tail = chunk[-2:]
                    yield chunk
        except httpx.HTTPError as e:
            self.status = 502
            m = self.member
            self.metrics.upstream_errors.labels(m.model, "broken").inc()
            event = {"error": {"message": f"the server of model {m.model!r} (replica "
                                          f"{m.index}) failed while answering: "
                                          f"{type(e).__name__}",
                               "type": "server_error", "code": "upstream_error"}}
            yield (b"" if tail == b"\n\n" else b"\n\n") + \
                f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
            return
        self.status = 200

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):  # close the upstream even when cancelled
            await self.resp.aclose()
        self.done(self.status)


class _RelayedStream(StreamingResponse):
    """A streamed answer that closes its :class:`_Relay` when the response ends, also
    when the client hung up before the stream began (its generator never ran)."""

    def __init__(self, relay: _Relay, media_type: str | None) -> None:
        super().__init__(relay.chunks(), 200, media_type=media_type)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


def _upstream_failed(metrics: FleetMetrics, member: Member, e: httpx.HTTPError) -> Response:
    kind = "connect" if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) else "broken"
    metrics.upstream_errors.labels(member.model, kind).inc()
    return error(502, f"the server of model {member.model!r} (replica {member.index}) "
                      f"failed: {type(e).__name__}", "upstream_error")
