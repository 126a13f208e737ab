"""Replays a workload against OpenAI-compatible servers and records what clients see.

Each request streams, so time to first token and time per output token are measured at
the client, queueing included: that is what a burst does to users. Tiny models get
token-id prompts on ``/v1/completions`` (``ignore_eos``: every answer has the workload's
length); real models (``chat=True``) get a real question on ``/v1/chat/completions``
(:mod:`kvpool.demo.prompts`), answer until their end of turn or ``max_tokens``, and the
answer's text is kept. Memory is sampled alongside by a caller-given function. A
request for a model ``urls`` has no server for fails at once ("no server for this
model"): a run that serves only the models that fit counts the others' requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import httpx

from kvpool.demo.prompts import chat_messages
from kvpool.demo.workload import Arrival, prompt_tokens


@dataclass
class Outcome:
    """What one request got. ``error`` is set when it did not finish."""

    index: int
    model: str
    arrival: float
    prompt_len: int
    max_tokens: int
    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # the answer (chat requests)
    error: str | None = None


@dataclass
class Replay:
    outcomes: list[Outcome]
    memory: list[dict[str, Any]]  # {"t": seconds, model: bytes, ...}
    wall_s: float
    start_wall: float = 0.0  # time.time() when the replay started (arrivals are offsets)
    events: list[dict[str, Any]] = field(default_factory=list)  # the daemon's events (elastic runs)

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "outcomes": [asdict(o) for o in self.outcomes],
            "memory": self.memory,
        }


def _request(arrival: Arrival, index: int, vocab: int, chat: bool
             ) -> tuple[str, dict[str, Any]]:
    """(path, body) of request ``index``: token ids to /v1/completions, or (``chat``) a
    real question to /v1/chat/completions."""
    common = {"model": arrival.model, "max_tokens": arrival.max_tokens, "temperature": 0.0,
              "stream": True}
    if chat:
        return "/v1/chat/completions", {**common, "messages": chat_messages(index),
                                        "stream_options": {"include_usage": True}}
    return "/v1/completions", {**common, "prompt": prompt_tokens(arrival, vocab, index),
                               "ignore_eos": True, "return_token_ids": True}


def _take(out: Outcome, chunk: dict[str, Any], stamps: list[float]) -> None:
    """Record one streamed chunk: a stamp per token that arrived, the text, the usage."""
    if "error" in chunk:  # the server's in-band error after the headers went out
        out.error = f"server error: {chunk['error'].get('message', chunk['error'])}"
        return
    usage = chunk.get("usage")
    if usage:  # chat: the true token counts (a text delta may hold several tokens)
        out.prompt_len = int(usage.get("prompt_tokens", out.prompt_len))
        out.output_tokens = int(usage.get("completion_tokens", 0))
    if not chunk.get("choices"):
        return
    choice = chunk["choices"][0]
    if "delta" in choice:
        text = choice["delta"].get("content") or ""
        if text:
            stamps.append(time.perf_counter())
            out.text += text
        return
    ids = choice.get("token_ids") or []
    if choice.get("text") or ids:
        stamps.extend([time.perf_counter()] * max(1, len(ids)))
        out.output_ids.extend(ids)


async def _one(client: httpx.AsyncClient, url: str, arrival: Arrival, index: int, vocab: int,
               start: float, chat: bool = False) -> Outcome:
    out = Outcome(index, arrival.model, arrival.at, arrival.prompt_len, arrival.max_tokens)
    await asyncio.sleep(max(0.0, start + arrival.at - time.perf_counter()))
    path, body = _request(arrival, index, vocab, chat)
    sent = time.perf_counter()
    stamps: list[float] = []
    try:
        async with client.stream("POST", f"{url}{path}", json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                _take(out, json.loads(data), stamps)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, AttributeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    if out.error:
        return out
    done = time.perf_counter()
    tokens = out.output_tokens if chat and out.output_tokens else len(stamps)
    out.output_tokens = tokens
    if stamps:
        out.ttft = stamps[0] - sent
        out.latency = done - sent
        if tokens > 1:
            out.tpot = (stamps[-1] - stamps[0]) / (tokens - 1)
    else:
        out.error = "no tokens"
    return out


async def _sample(sample: Callable[[], dict[str, Any]], every: float, start: float, stop: asyncio.Event,
                  into: list[dict[str, Any]]) -> None:
    while not stop.is_set():
        row = await asyncio.to_thread(sample)
        row["t"] = time.perf_counter() - start
        into.append(row)
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def replay_async(
    arrivals: list[Arrival],
    urls: dict[str, str],
    vocab: int,
    sample_memory: Callable[[], dict[str, Any]] | None = None,
    sample_every: float = 0.25,
    timeout_s: float = 600.0,
    on_done: Callable[[Outcome], None] | None = None,
    chat: bool = False,
) -> Replay:
    memory: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start, start_wall = time.perf_counter(), time.time()
        stop = asyncio.Event()
        sampler = (
            asyncio.create_task(_sample(sample_memory, sample_every, start, stop, memory))
            if sample_memory
            else None
        )

        async def run(i: int, a: Arrival) -> Outcome:
            url = urls.get(a.model)
            if url is None:  # no server for this model (it did not fit): a failure
                o = Outcome(i, a.model, a.at, a.prompt_len, a.max_tokens,
                            error="no server for this model")
            else:
                o = await _one(client, url, a, i, vocab, start, chat)
            if on_done:
                on_done(o)
            return o

        outcomes = await asyncio.gather(*(run(i, a) for i, a in enumerate(arrivals)))
        stop.set()
        if sampler:
            await sampler
    return Replay(list(outcomes), memory, time.perf_counter() - start, start_wall)


def replay(arrivals: list[Arrival], urls: dict[str, str], vocab: int, **kw: Any) -> Replay:
    return asyncio.run(replay_async(arrivals, urls, vocab, **kw))


def warm_up(url: str, model: str, timeout_s: float = 300.0) -> None:
    """One one-token request to ``model`` at ``url`` (a server's first request pays its
    kernels' first-use costs; a fleet's starts a lazy member). Raises
    :class:`httpx.HTTPError` when it fails."""
    body = {"model": model, "prompt": [8, 9, 10, 11], "max_tokens": 1, "temperature": 0.0}
    httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s).raise_for_status()


def warm_up_all(urls: dict[str, str], timeout_s: float = 300.0) -> None:
    """:func:`warm_up` each model of ``urls`` ({model: url}) at once (threads); the
    first error is raised."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(urls))) as pool:
        for f in [pool.submit(warm_up, u, m, timeout_s) for m, u in urls.items()]:
            f.result()
