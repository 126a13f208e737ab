"""OpenAI-compatible HTTP server over an AsyncEngine (FastAPI).

Routes: POST /v1/completions, POST /v1/chat/completions (both stream with SSE when
``stream`` is true), GET /v1/models, GET /health, GET /metrics (Prometheus text with
vLLM's metric names, see :mod:`kvpool.engine.serving.metrics`) and GET /v1/stats (JSON engine
statistics; an elastic server adds ``kv_room``, what its ``/metrics``' elastic gauges
are made of). Every response's ``usage`` carries ``ttft_s`` and ``tpot_s`` (seconds)
and ``num_preemptions`` besides the token counts. Errors use OpenAI's
``{"error": {"message", "type", "code"}}`` shape with a 4xx status.

Extensions accepted in request bodies (as in vLLM): ``top_k``, ``stop_token_ids``,
``ignore_eos``. Every field is checked as vLLM checks it (:mod:`kvpool.engine.serving.api_bodies`):
a bad value is a 400 naming the field.

Chat prompts are the checkpoint's own chat template rendered in a sandbox
(:mod:`kvpool.engine.chat_template`; ChatML for a checkpoint without one, logged once at
start), encoded without added special tokens, and also stop on the template's end-of-turn
tokens. A chat's messages are untrusted: malformed messages, more text than the context
could hold, or a template that raises on them get a 400 with one line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpool.engine.serving.api_bodies import (ChatBody, CommonBody, CompletionBody, OpenAIPrompt,
                                      describe, problem)
from kvpool.engine.serving.async_engine import AsyncEngine
from kvpool.engine.serving.body_limit import BodyLimit, body_limit
from kvpool.engine.chat_template import ChatTemplateError
from kvpool.engine.config import EngineConfig
from kvpool.engine.errors import EngineUnavailable, RequestError
from kvpool.engine.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvpool.engine.serving.metrics import EngineMetrics, MemorySource
from kvpool.engine.request import RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.tokenizer import MAX_CHARS_PER_TOKEN

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status)


def create_app(aengine: AsyncEngine, memory: MemorySource | None = None) -> FastAPI:
    """The server's app over ``aengine``; ``memory``: an elastic server's view of its KV
    memory for ``/metrics`` (:mod:`kvpool.engine.serving.metrics`)."""
    engine = aengine.engine
    name = engine.served_model_name
    if engine.tokenizer is not None and engine.tokenizer.chat_template.is_fallback:
        log.warning("%s has no chat template (chat_template.jinja or tokenizer_config.json); "
                    "chat requests are formatted as ChatML", name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not aengine.alive:
            aengine.start()
        yield
        aengine.stop()
        close = getattr(engine, "close", None)  # an adapter's: ends its tenant and threads
        if close is not None:
            close()

    app = FastAPI(title="kvpool engine", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=body_limit(engine.max_model_len))  # 413 past it

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e.status, e.message, e.code)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return _error(400, str(e), "invalid_request")

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(_: Request, e: EngineUnavailable) -> JSONResponse:
        return _error(503, str(e), "unavailable")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        if e.status_code != 400:  # (a route's 404/405: FastAPI's own answer)
            return await http_exception_handler(request, e)
        # a body FastAPI could not parse (nested deeper than the parser goes, say)
        return _error(400, f"invalid request body: {str(e.detail).splitlines()[0][:200]}",
                      "invalid_request")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request body: {describe(e)}", "invalid_request")

    @app.get("/health")
    async def health() -> JSONResponse:
        if not aengine.alive:
            return _error(503, "engine thread is not running", "engine_dead")
        if aengine.broken is not None:
            return _error(503, str(aengine.broken), "engine_broken")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "kvpool",
            "max_model_len": engine.max_model_len}]}

    prometheus = EngineMetrics(aengine, memory)

    @app.get("/metrics")
    def metrics() -> Response:  # Prometheus text, vLLM's names (a thread: it takes the lock)
        return Response(prometheus.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/stats")
    def stats() -> dict[str, Any]:  # (a thread: it takes the lock)
        out = aengine.stats()
        view = None
        if memory is not None:
            try:
                view = memory.memory_view()
            except Exception:  # an adapter's failure: the engine's own figures only
                view = None
        if view is not None:  # what /metrics' elastic gauges are made of (a fleet reads it)
            out["kv_room"] = {"held": view.held, "grantable": view.grantable,
                              "asleep": view.asleep, **view.scalars}
        return out

    vocab = engine.model_config.vocab_size

    def check(body: CommonBody) -> None:
        if body.model is not None and body.model != name:
            raise APIError(404, f"model {body.model!r} not found; this server serves "
                           f"{name!r}", "model_not_found")
        why = problem(body, vocab)
        if why is not None:
            raise APIError(400, why)

    def encode(prompt: str | list[int]) -> list[int]:
        try:
            return engine.encode(prompt)
        except RequestError as e:
            raise APIError(400, f"prompt: {e}") from None

    def params(body: CommonBody, prompt: list[int], max_tokens: int | None,
               extra_stop_ids: tuple[int, ...] = ()) -> SamplingParams:
        if len(prompt) >= engine.max_model_len:
            raise APIError(400, f"prompt has {len(prompt)} tokens; the context holds "
                           f"{engine.max_model_len} (max_model_len), including the output",
                           "context_length_exceeded")
        room = engine.max_model_len - len(prompt)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return SamplingParams(
            max_tokens=min(max_tokens or room, room), temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=stop,
            stop_token_ids=[*(body.stop_token_ids or []), *extra_stop_ids],
            ignore_eos=body.ignore_eos)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Any:
        check(body)
        prompts = _prompt_list(body.prompt)
        # a thread: tokenizing a long prompt must not hold up the streams (each text is
        # bounded before it is tokenized: Engine.encode)
        ids = await asyncio.to_thread(lambda: [encode(p) for p in prompts])
        sps = [params(body, p, body.max_tokens if body.max_tokens is not None else 16)
               for p in ids]
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            if len(ids) != 1:
                raise APIError(400, "streaming supports a single prompt")
            await aengine.ready()  # a model that cannot wake: 503 before the stream
            return _sse(_stream_completion(aengine, rid, name, ids[0], sps[0],
                                           _include_usage(body), body.return_token_ids))
        outs = await asyncio.gather(*(_final(aengine, f"{rid}-{i}", p, sp)
                                      for i, (p, sp) in enumerate(zip(ids, sps))))
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": name,
                "choices": [{"index": i, "text": o.text, "finish_reason": o.finish_reason,
                             "logprobs": None,
                             **({"token_ids": o.output_token_ids} if body.return_token_ids
                                else {})} for i, o in enumerate(outs)],
                "usage": _usage(outs)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody) -> Any:
        max_tokens = body.max_completion_tokens or body.max_tokens
        check(body)
        if not body.messages:
            raise APIError(400, "messages must not be empty")
        tok = engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer.json; chat needs one")
        try:  # a thread: rendering and encoding a long chat must not hold up the streams
            ids = await asyncio.to_thread(tok.encode_chat, body.messages,
                                          MAX_CHARS_PER_TOKEN * engine.max_model_len)
        except ChatTemplateError as e:
            raise APIError(400, str(e)) from None
        sp = params(body, ids, max_tokens, tok.chat_stop_ids)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            await aengine.ready()
            return _sse(_stream_chat(aengine, rid, name, ids, sp, _include_usage(body)))
        out = await _final(aengine, rid, ids, sp)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "finish_reason": out.finish_reason, "logprobs": None}],
                "usage": _usage([out])}

    return app


def _prompt_list(prompt: OpenAIPrompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty")
    if all(isinstance(t, int) for t in prompt):
        return [cast(list[int], prompt)]  # mypy cannot narrow a list by its items
    return list(cast(list[str] | list[list[int]], prompt))


def _include_usage(body: CommonBody) -> bool:
    return bool(body.stream_options is not None and body.stream_options.include_usage)


async def _final(aengine: AsyncEngine, rid: str, ids: list[int], sp: SamplingParams
                 ) -> RequestOutput:
    out = None
    async for out in aengine.generate(rid, ids, sp):
        pass
    assert out is not None and out.finished
    return out


def _usage(outs: list[RequestOutput]) -> dict[str, Any]:
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(o.output_token_ids) for o in outs)
    ttfts = [o.ttft for o in outs if o.ttft is not None]
    tpots = [o.tpot for o in outs if o.tpot is not None]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "ttft_s": max(ttfts) if ttfts else None,
            "tpot_s": sum(tpots) / len(tpots) if tpots else None,
            "num_preemptions": sum(o.num_preemptions for o in outs)}


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
        except Exception as e:  # an error after the headers went out: report it in-band
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _stream_completion(aengine: AsyncEngine, rid: str, name: str, ids: list[int],
                             sp: SamplingParams, include_usage: bool, token_ids: bool = False
                             ) -> AsyncIterator[dict[str, Any]]:
    created, sent = int(time.time()), 0
    async for out in aengine.generate(rid, ids, sp):
        delta, sent = out.text[sent:], len(out.text)
        if delta or out.finished or (token_ids and out.new_token_ids):
            choice = {"index": 0, "text": delta, "logprobs": None,
                      "finish_reason": out.finish_reason}
            if token_ids:  # every token, even those whose text is still held back
                choice["token_ids"] = out.new_token_ids
            yield {"id": rid, "object": "text_completion", "created": created, "model": name,
                   "choices": [choice]}
        if out.finished and include_usage:
            yield {"id": rid, "object": "text_completion", "created": created, "model": name,
                   "choices": [], "usage": _usage([out])}


async def _stream_chat(aengine: AsyncEngine, rid: str, name: str, ids: list[int],
                       sp: SamplingParams, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    created, sent = int(time.time()), 0

    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                             "logprobs": None}]}

    yield chunk({"role": "assistant", "content": ""}, None)
    async for out in aengine.generate(rid, ids, sp):
        delta, sent = out.text[sent:], len(out.text)
        if delta:
            yield chunk({"content": delta}, None)
        if out.finished:
            yield chunk({}, out.finish_reason)
            if include_usage:
                yield {"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": name, "choices": [], "usage": _usage([out])}


def serve(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Load the model, start the step thread and serve until interrupted."""
    import uvicorn

    from kvpool.engine.engine import Engine

    aengine = AsyncEngine(Engine(engine_config))
    uvicorn.run(create_app(aengine), host=host, port=port, log_level=log_level)
