"""The streams of a warm restart's in-flight requests: their clients stay connected to the
old server, which relays what the new server generates for them.

The new server streams one adopted request's outputs on ``GET /pd/follow/{id}`` (and
those of a request the old one forwards to it, ``POST /pd/adopt``) as JSON lines, each a
delta against the previous line of the same stream (:class:`Encoder`)::

    {"at": 0, "tokens": [...], "text_at": 0, "text": "...", "finished": false, ...}

``tokens`` are the output tokens from index ``at`` on (the first line has them all,
those generated on the old server too), ``text`` the output text from ``text_at`` on. An
error ends a stream with ``{"error": "...", "kind": "request" | "server"}``.

The old server (:func:`relay`) rebuilds each :class:`RequestOutput` (:class:`Decoder`)
and checks that the tokens extend exactly what its client already has; the client's
``new_token_ids`` are only those beyond, so every token reaches it exactly once and in
order whatever the new server buffered before the old one connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from kvpool.engine.errors import RequestError
from kvpool.engine.request import RequestOutput

CONNECT_S = 120.0  # how long the old server tries to reach a new one still starting
READ_S = 300.0  # a new server silent this long (frozen) fails the relay: none waits forever


class Encoder:
    """One stream's lines: each output as a delta against the previous line."""

    def __init__(self) -> None:
        self.tokens = 0
        self.text = ""

    def line(self, out: RequestOutput) -> str:
        toks, text = out.output_token_ids, out.text
        at = min(self.tokens, len(toks))
        text_at = len(self.text) if text.startswith(self.text) else 0
        self.tokens, self.text = len(toks), text
        return json.dumps({
            "at": at, "tokens": toks[at:], "text_at": text_at, "text": text[text_at:],
            "finished": out.finished, "finish_reason": out.finish_reason,
            "num_preemptions": out.num_preemptions,
            "num_prefix_hit_tokens": out.num_prefix_hit_tokens, "ttft": out.ttft,
            "tpot": out.tpot}) + "\n"


async def lines(outs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[str]:
    """A stream of outputs as lines; an error as its last line. Closing this closes
    ``outs`` (which aborts the request if it had not finished)."""
    enc = Encoder()
    async with contextlib.aclosing(outs) as it:
        try:
            async for out in it:
                yield enc.line(out)
        except RequestError as e:
            yield json.dumps({"error": str(e), "kind": "request"}) + "\n"
        except Exception as e:  # noqa: BLE001 - reported in-band, the headers went out
            yield json.dumps({"error": f"engine error: {e}", "kind": "server"}) + "\n"


class Decoder:
    """The old server's side of one stream: ``delivered`` is what its client has."""

    def __init__(self, request_id: str, prompt: list[int], delivered: list[int],
                 ttft: float | None) -> None:
        self.request_id, self.prompt, self.ttft = request_id, list(prompt), ttft
        self.delivered = list(delivered)
        self.got: list[int] = []
        self.text = ""

    def output(self, d: dict[str, Any]) -> RequestOutput | None:
        """The client's next output for line ``d`` (None if it adds nothing). Raises
        RequestError / RuntimeError for an error line, RuntimeError if the tokens do not
        extend what the client has."""
        if "error" in d:
            kind = RequestError if d.get("kind") == "request" else RuntimeError
            raise kind(str(d["error"]))
        self.got = self.got[:int(d["at"])] + [int(t) for t in d["tokens"]]
        self.text = self.text[:int(d["text_at"])] + str(d["text"])
        n = len(self.delivered)
        if self.got[:n] != self.delivered:
            raise RuntimeError("the relayed tokens do not continue the request's")
        new = self.got[n:]
        if not new and not d["finished"]:
            return None
        self.delivered = list(self.got)
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt,
            output_token_ids=list(self.got), new_token_ids=new, text=self.text,
            finished=bool(d["finished"]), finish_reason=d.get("finish_reason"),
            num_preemptions=int(d.get("num_preemptions") or 0),
            num_prefix_hit_tokens=int(d.get("num_prefix_hit_tokens") or 0),
            ttft=self.ttft if self.ttft is not None else d.get("ttft"), tpot=d.get("tpot"))


async def relay(url: str, dec: Decoder, put: Callable[[Any], None],
                forward: dict[str, Any] | None = None, connect_s: float = CONNECT_S) -> None:
    """Pass request ``dec.request_id``'s outputs from the server at ``url`` to ``put``
    until it finishes: an adopted request's (``GET /pd/follow``), or, with ``forward``
    (``{id, prompt, params}``), a new request's (``POST /pd/adopt``). Retries the
    connection while the new server is starting (``connect_s``). Raises on failure."""
    import httpx

    loop = asyncio.get_running_loop()
    deadline = loop.time() + connect_s
    base = url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=READ_S)) as client:
        while True:
            req = (client.build_request("POST", f"{base}/pd/adopt", json=forward)
                   if forward is not None
                   else client.build_request("GET", f"{base}/pd/follow/{dec.request_id}"))
            try:
                resp = await client.send(req, stream=True)
                break
            except httpx.ConnectError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.1)
        try:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                kind = RequestError if resp.status_code == 400 else RuntimeError
                raise kind(f"{base} answered {resp.status_code}: {body[:200]}")
            async for text in resp.aiter_lines():
                if not text.strip():
                    continue
                out = dec.output(json.loads(text))
                if out is not None:
                    put(out)
                    if out.finished:
                        return
            raise RuntimeError(f"{base} ended the stream before the request finished")
        finally:
            await resp.aclose()


async def drop(url: str, request_id: str) -> None:
    """Tell the new server an adopted request's client is gone (it aborts it)."""
    import httpx

    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONNECT_S
    async with httpx.AsyncClient(timeout=10.0) as client:
        while True:
            try:
                await client.delete(f"{url.rstrip('/')}/pd/follow/{request_id}")
                return
            except httpx.ConnectError:
                if loop.time() > deadline:
                    return  # it never came up; it drops unfollowed requests itself
                await asyncio.sleep(0.1)
            except httpx.HTTPError:
                return
