"""The request-body limit of the engine's HTTP server (:class:`BodyLimit`, an ASGI
middleware): a body past the limit is a 413 in OpenAI's error shape, one line — by its
declared ``Content-Length`` before a byte of it is read, or, without one (chunked), as
soon as what was read passes the limit — so no client makes the server hold or parse
more than the limit.

:func:`body_limit` derives the limit from the context: a prompt of ``max_model_len``
tokens is at most :data:`~kvpool.engine.tokenizer.MAX_CHARS_PER_TOKEN` characters a
token (longer text is refused before tokenizing anyway), written with
:data:`BYTES_PER_CHAR` bytes of JSON a character; never under :data:`MIN_BODY` (a
small model still takes a batch of prompts) nor over :data:`MAX_BODY` (the fleet's
own limit: nothing larger gets through a fleet).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvpool.engine.tokenizer import MAX_CHARS_PER_TOKEN

MIN_BODY = 1 << 20
MAX_BODY = 32 << 20
BYTES_PER_CHAR = 4  # room for JSON escapes and multi-byte UTF-8

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


def body_limit(max_model_len: int) -> int:
    """The largest request body (bytes) a server of this context length reads."""
    return max(MIN_BODY, min(MAX_BODY, BYTES_PER_CHAR * MAX_CHARS_PER_TOKEN * max_model_len))


class BodyLimit:
    """Refuses request bodies past ``max_bytes`` (413) before the app sees them.

    A body with a declared length within the limit passes through untouched (the HTTP
    parser holds the client to its length); a body without one is read here, at most
    ``max_bytes`` of it, and handed to the app whole."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive,
                       send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None:
            if declared.strip().isdigit() and int(declared) > self.max_bytes:
                await self.refuse(send)
                return
            await self.app(scope, receive, send)
            return
        body = await self._read(receive)
        if body is None:
            await self.refuse(send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body (None: past the limit, or the client left)."""
        parts: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return None  # http.disconnect
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts)

    async def refuse(self, send: Send) -> None:
        payload = json.dumps({"error": {
            "message": f"the request body is larger than {self.max_bytes} bytes (this "
                       f"server's limit, from its max_model_len)",
            "type": "invalid_request_error", "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that yields ``body`` once, then the client's own messages (a
    streaming response listens there for the client's hang-up)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
