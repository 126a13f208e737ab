"""AsyncEngine: runs an Engine's step loop in one background thread for asyncio callers.

HTTP handlers never touch the Engine: they put commands on a thread-safe queue and read
their request's outputs from an ``asyncio.Queue`` that the step thread feeds through
``loop.call_soon_threadsafe``.

Extending it (the adapters' prefill/decode and warm-restart servers do): a subclass
posts commands of its own (:meth:`~AsyncEngine.post`) and handles them by overriding
``_handle`` (passing :class:`AddRequest` / :class:`AbortRequest` and anything else it
does not know to ``super()._handle``); everything in ``_handle`` runs on the step thread.

Admission (``gate``, a :class:`RequestGate`, e.g. an adapter's sleep controller): every
request passes ``gate.enter()`` before it reaches the step thread and ``gate.leave()``
when it ends, however it ends; a gate that refuses makes the request raise
:class:`~kvpool.engine.errors.EngineUnavailable` (the server's 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.engine.engine import Engine
from kvpool.engine.errors import EngineBroken, EngineUnavailable
from kvpool.engine.request import RequestOutput
from kvpool.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class AddRequest:
    """Command: start ``request_id``; its outputs (or the exception it raised) go to
    ``out`` on ``loop``."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[RequestOutput | BaseException]
    arrival_time: float


@dataclass
class AbortRequest:
    """Command: abort ``request_id`` (its client went away)."""

    request_id: str


class RequestGate(Protocol):
    """Admission of requests (e.g. wake a sleeping model first).

    ``enter`` is awaited once per request before it is queued; it may wait (a wake) and
    raises (one-line message) when the request cannot be served. Every ``enter`` that
    returned is paired with exactly one ``leave`` (called on the event loop's thread,
    never blocking)."""

    async def enter(self) -> None: ...

    def leave(self) -> None: ...


class AsyncEngine:
    def __init__(self, engine: Engine, gate: RequestGate | None = None) -> None:
        self.engine = engine
        self.gate = gate
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._streams: dict[str, AddRequest] = {}
        self._lock = threading.Lock()  # guards engine state read by stats()
        self._thread = threading.Thread(target=self._run, name="kvpool-engine", daemon=True)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.broken: EngineBroken | None = None  # set once: the engine can never serve

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def post(self, cmd: object) -> None:
        """Queue a command for the step thread (thread-safe); it reaches ``_handle``."""
        self._inbox.put(cmd)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs until it finishes; aborts it if the consumer stops
        early (client disconnect). Raises the engine's RequestError/exception if any, and
        EngineUnavailable when the gate refuses it."""
        arrival = time.perf_counter()  # before the gate: a wake counts in the TTFT
        if self.broken is not None:
            raise self.broken
        await self._enter()
        try:
            q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
            self.post(AddRequest(request_id, prompt, params, asyncio.get_running_loop(), q,
                                 arrival))
            async with contextlib.aclosing(self._relay(request_id, q)) as outs:
                async for out in outs:
                    yield out
        finally:
            if self.gate is not None:
                self.gate.leave()

    async def _enter(self) -> None:
        if self.gate is None:
            return
        try:
            await self.gate.enter()
        except Exception as e:
            raise EngineUnavailable(str(e) or type(e).__name__) from None

    async def ready(self) -> None:
        """Pass the gate once and leave (a streaming route calls this before its response
        starts, so a request that cannot be served gets a 503, not an error in the
        stream)."""
        await self._enter()
        if self.gate is not None:
            self.gate.leave()

    async def _relay(self, request_id: str, q: asyncio.Queue[RequestOutput | BaseException]
                     ) -> AsyncGenerator[RequestOutput, None]:
        """Yield what the step thread puts in ``q`` for ``request_id`` until it finishes
        (re-raising an exception put there); abort the request if the consumer stops
        early. Callers close it at once (``contextlib.aclosing``) so the abort is not
        left to garbage collection."""
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.post(AbortRequest(request_id))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self.engine.stats()

    # --- the step thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            for cmd in self._drain(block=not self.engine.has_unfinished()):
                self._handle(cmd)
            if self._stop.is_set():
                break
            if not self.engine.has_unfinished():
                continue
            steps = self.engine.num_steps
            try:
                with self._lock:
                    outputs = self.engine.step()
            except Exception as e:  # keep serving: fail the requests in flight
                log.exception("engine step failed")
                self.error = e
                if isinstance(e, EngineBroken):
                    self.broken = e
                self._fail_all(e)
                continue
            if self.engine.num_steps == steps:
                time.sleep(0.001)  # nothing schedulable (e.g. memory short): do not spin
            for out in outputs:
                self._deliver(out)

    def _drain(self, block: bool) -> list[object]:
        """Every queued command; waits for one first when the engine is idle."""
        cmds = [self._inbox.get()] if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return [c for c in cmds if c is not None]  # None only wakes us up

    def _handle(self, cmd: object) -> None:
        if isinstance(cmd, AddRequest):
            try:
                with self._lock:
                    self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id,
                                            cmd.arrival_time)
            except Exception as e:
                cmd.loop.call_soon_threadsafe(cmd.out.put_nowait, e)
                return
            self._streams[cmd.request_id] = cmd
        elif isinstance(cmd, AbortRequest):
            self._streams.pop(cmd.request_id, None)
            with self._lock:
                self.engine.abort(cmd.request_id)
        else:
            raise TypeError(f"unknown step-thread command {cmd!r}")

    def _deliver(self, out: RequestOutput) -> None:
        s = self._streams.get(out.request_id)
        if s is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        s.loop.call_soon_threadsafe(s.out.put_nowait, out)

    def _fail_all(self, e: BaseException) -> None:
        for rid, s in list(self._streams.items()):
            with self._lock:
                self.engine.abort(rid)
            failure = e if isinstance(e, EngineUnavailable) else RuntimeError(
                f"engine error: {e}")
            s.loop.call_soon_threadsafe(s.out.put_nowait, failure)
        self._streams.clear()
