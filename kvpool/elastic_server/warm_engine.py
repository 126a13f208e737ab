"""The step loop of an elastic server that can hand over to a successor (warm restart,
:mod:`.app`): :class:`RetiringEngine`.

As the old server, on ``/pd/retire`` (between two steps, in the step thread): by default
(``in_flight``) every request is detached and offered at once with the prefix cache
(:func:`~.handoff_cache.offer_cache`), the step thread holding the engine's ``step_lock``
until the ticket settles (no step, shrink or idle eviction touches the offered units);
else no request is admitted, the running ones finish, then the cache alone is offered.
Requests arriving meanwhile wait (none is refused). Claimed: the server is *retired*
(``/health`` 503); each moved request's client is served by relaying the new server's
``/pd/follow/{id}`` (:mod:`.warm_relay`); the waiting and later requests are forwarded to
its ``/pd/adopt`` while any relay runs, then refused ("retired"). Expired or cancelled:
everything runs here again, nothing lost. Never held forever: a ticket still pending
``SETTLE_GRACE_S`` past its ttl is cancelled here; a handover that raises releases the
hold and fails its clients (the step thread lives on).

As the new server: the requests it adopted (``adopted``) run before anyone follows
them; each keeps its latest output (one, cumulative) until ``/pd/follow/{id}`` attaches,
or is aborted if nobody does within ``FOLLOW_WAIT_S``.

Thread contract: engine state, ``_streams``, ``_held``, ``_follows`` belong to the step
thread; ``_relays`` (request id -> the loop relaying it) is shared under
``_relay_lock``; ``_tasks`` belongs to the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import asdict
from collections.abc import Sequence
from typing import Any

from kvpool.engine.serving.api_bodies import PUBLIC_SAMPLING
from kvpool.engine.serving.async_engine import AbortRequest, AddRequest, AsyncEngine, RequestGate
from kvpool.engine.errors import RequestError
from kvpool.engine.request import RequestOutput
from kvpool.engine_adapters.bundled import handoff_cache
from kvpool.elastic_server import warm_relay
from kvpool.elastic_server import warm_commands as wc

log = logging.getLogger("kvpool.warm")

FOLLOW_WAIT_S = 120.0  # an adopted request nobody follows within this is aborted
SETTLE_GRACE_S = 5.0  # a ticket not settled this long after its ttl is cancelled here
ATTACHED = "attached"  # first item a follower gets


class RetiringEngine(AsyncEngine):
    """An AsyncEngine that can hand its cache and requests to a successor and retire,
    and, as the successor, serve the followers of the requests it adopted."""

    def __init__(self, engine: Any, adopted: Sequence[str] = (),
                 gate: RequestGate | None = None) -> None:
        super().__init__(engine, gate)
        self._retire: wc.Retire | None = None
        self._offer: tuple[handoff_cache.CacheHandover, Any] | None = None
        self._hold: Any = None  # the engine's step_lock, held while an offer is out
        self._settle_by = 0.0  # when an offer still out is taken back (cancelled)
        self._held: list[AddRequest] = []  # requests that arrived while an offer was out
        self._gone: set[str] = set()  # offered requests whose client left meanwhile
        self._ttft: dict[str, float | None] = {}
        self._target: str | None = None  # the server that took over
        self._relays: dict[str, asyncio.AbstractEventLoop] = {}
        self._relay_lock = threading.Lock()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: set[str] = set()
        self._follows = {rid: wc.Follow(time.monotonic() + FOLLOW_WAIT_S) for rid in adopted}
        self.retired = False

    async def retire(self, to: str, ttl_s: float, in_flight: bool = True,
                     url: str | None = None) -> dict[str, Any]:
        if in_flight and not url:
            raise RequestError("moving the in-flight requests needs 'url' (where the new "
                               "server will serve); or pass in_flight: false to drain")
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.post(wc.Retire(to, ttl_s, in_flight, url, asyncio.get_running_loop(), q))
        item = await q.get()
        if isinstance(item, BaseException):
            raise item
        return {"cache": asdict(item)}

    async def follow(self, request_id: str) -> Any:
        """The adopted request's outputs (an async iterator) once attached; raises
        LookupError if there is no such request to follow."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.post(wc.Attach(request_id, asyncio.get_running_loop(), q))
        first = await q.get()
        if isinstance(first, BaseException):
            raise first
        return self._relay(request_id, q)

    def drop_soon(self, request_id: str) -> None:
        """Abort an adopted request nobody follows yet (between steps); any other
        request id is left alone."""
        self.post(wc.Drop(request_id))

    @property
    def alive(self) -> bool:
        return super().alive and not self.retired

    # --- the step thread ------------------------------------------------------------

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, wc.Retire):
            if self._retire is not None or self.retired:
                _put(cmd.loop, cmd.out, RequestError("this server is retiring already"))
            else:
                self._retire = cmd
        elif isinstance(cmd, wc.Attach):
            self._attach(cmd)
        elif isinstance(cmd, wc.Drop):
            if self._follows.pop(cmd.request_id, None) is not None:
                with self._lock:
                    self.engine.abort(cmd.request_id)
        elif isinstance(cmd, AddRequest) and self._retire is not None:
            self._held.append(cmd)  # served once the handover settles, one way or other
        elif isinstance(cmd, AddRequest) and self.retired:
            self._forward(cmd)
        elif isinstance(cmd, AbortRequest):
            if not self._abort(cmd.request_id):
                super()._handle(cmd)
        else:
            super()._handle(cmd)

    def _abort(self, rid: str) -> bool:
        """An abort for a request this class keeps apart; False if it is not one."""
        with self._relay_lock:
            loop = self._relays.get(rid)
        if loop is not None:
            loop.call_soon_threadsafe(self._cancel_task, rid)
        elif any(a.request_id == rid for a in self._held):
            self._held = [a for a in self._held if a.request_id != rid]
        elif rid in self.engine.detached:
            self._gone.add(rid)
            self._streams.pop(rid, None)
        elif self._follows.pop(rid, None) is not None:
            with self._lock:
                self.engine.abort(rid)
        else:
            return False
        return True

    def _deliver(self, out: RequestOutput) -> None:
        f = self._follows.get(out.request_id)
        if f is not None:
            f.latest = out  # nobody follows it yet
        else:
            super()._deliver(out)

    def _attach(self, cmd: wc.Attach) -> None:
        f = self._follows.pop(cmd.request_id, None)
        if f is None:
            return _put(cmd.loop, cmd.out, LookupError(
                f"no adopted request {cmd.request_id!r} to follow here"))
        _put(cmd.loop, cmd.out, ATTACHED)
        if f.latest is not None:
            _put(cmd.loop, cmd.out, f.latest)
        if f.latest is None or not f.latest.finished:
            self._streams[cmd.request_id] = AddRequest(cmd.request_id, [], None, cmd.loop,  # type: ignore[arg-type]
                                                 cmd.out, 0.0)

    def _drain(self, block: bool) -> list[Any]:
        if self._retire is not None:
            try:
                self._step_retire()
            except Exception as e:  # noqa: BLE001 - the step thread must live on
                self._abandon(e)
        if self._follows:
            self._expire_follows()
        if block and (self._retire is not None or self._follows):
            time.sleep(0.002 if self._retire is not None else 0.02)
            block = False
        if block and self.engine.has_unfinished():  # a settle just let held requests in
            block = False
        return super()._drain(block)

    def _expire_follows(self) -> None:
        now = time.monotonic()
        for rid in [r for r, f in self._follows.items() if f.deadline < now]:
            del self._follows[rid]
            with self._lock:
                self.engine.abort(rid)
            log.warning("adopted request %s: nobody followed it; aborted", rid)

    def _step_retire(self) -> None:
        r = self._retire
        assert r is not None
        if self._offer is None:
            if not r.in_flight and self.engine.has_unfinished():
                return  # the running requests finish first (new ones wait)
            self._make_offer(r)
            return
        c, ticket = self._offer
        if not ticket.settled and time.monotonic() < self._settle_by:
            return  # (past the deadline settle_cache cancels it: never held forever)
        try:
            with self._lock:
                state = handoff_cache.settle_cache(self.engine, c, ticket, 0)
        finally:
            self._unhold()
        self._offer, self._retire = None, None
        log.warning("handoff of the cache and %d request(s) to %s: %s", len(c.requests),
                    r.to, state)
        if state == "claimed":
            self._hand_over(c, r)
        else:
            self._serve_on()

    def _make_offer(self, r: wc.Retire) -> None:
        self._hold = self.engine.step_lock
        if self._hold is not None:
            self._hold.acquire()  # from before the offer until it settles (this thread)
        try:
            with self._lock:
                c, ticket = handoff_cache.offer_cache(self.engine, r.to, r.ttl_s,
                                                      in_flight=r.in_flight)
        except Exception as e:  # noqa: BLE001 - the caller hears of it
            self._unhold()
            self._retire = None
            _put(r.loop, r.out, RequestError(str(e)))
            self._serve_on()
            return
        self._offer = (c, ticket)
        self._settle_by = time.monotonic() + ticket.ttl_s + SETTLE_GRACE_S
        self._ttft = {m.request_id: self.engine.detached[m.request_id].metrics.ttft
                      for m in c.requests}
        _put(r.loop, r.out, c)

    def _abandon(self, e: Exception) -> None:
        """The handover broke (a bug; the daemon gone): the hold is released and every
        client of it hears so at once (where its request is, is not known): none waits."""
        r, self._retire, self._offer = self._retire, None, None
        log.error("handoff to %s failed: %s", r.to if r else "?", e, exc_info=e)
        self._unhold()
        if r is not None:  # (nobody reads it if it was answered already)
            _put(r.loop, r.out, RequestError(f"the handover failed: {e}"))
        self._fail_all(RuntimeError(f"the warm restart failed: {e}"))
        for a in self._held:
            _put(a.loop, a.out, RuntimeError(f"engine error: the warm restart failed: {e}"))
        self._held = []
        self._gone.clear()

    def _unhold(self) -> None:
        if self._hold is not None:
            self._hold.release()
            self._hold = None

    def _serve_on(self) -> None:
        """The handover did not happen: aborts that came meanwhile apply, the requests
        that waited run here."""
        with self._lock:
            for rid in self._gone:
                self.engine.abort(rid)
        self._gone.clear()
        held, self._held = self._held, []
        for a in held:
            super()._handle(a)

    def _hand_over(self, c: handoff_cache.CacheHandover, r: wc.Retire) -> None:
        """Claimed: relay each moved request's stream, forward the waiting ones."""
        self.retired, self._target = True, r.url
        for m in c.requests:
            s = self._streams.pop(m.request_id, None)
            if r.url is None:
                continue
            if s is None:  # its client left (or it had none): the new server drops it
                self._spawn(m.request_id, r.loop, warm_relay.drop(r.url, m.request_id), None)
                continue
            n = m.num_prompt_tokens
            dec = warm_relay.Decoder(m.request_id, m.token_ids[:n], m.token_ids[n:],
                                     self._ttft.get(m.request_id))
            self._spawn(m.request_id, s.loop, warm_relay.relay(r.url, dec, s.out.put_nowait),
                        s.out)
        self._gone.clear()
        held, self._held = self._held, []
        for a in held:
            self._forward(a, waited=True)

    def _forward(self, a: AddRequest, waited: bool = False) -> None:
        """A new request for a retired server: the new one computes it (its stream
        relayed too) if it ``waited`` for the handover or while any relay runs; else it
        is refused."""
        with self._relay_lock:
            relaying = bool(self._relays)
        if self._target is None or not (relaying or waited):
            _put(a.loop, a.out, RequestError(
                "this server is retired: the engine that replaced it serves its requests"))
            return
        params = dataclasses.asdict(a.params)  # the public ones: all a client could set
        body = {"id": a.request_id, "prompt": list(a.prompt),
                "params": {k: params[k] for k in PUBLIC_SAMPLING}}
        dec = warm_relay.Decoder(a.request_id, a.prompt, [], None)
        self._spawn(a.request_id, a.loop,
                    warm_relay.relay(self._target, dec, a.out.put_nowait, forward=body),
                    a.out)

    def _spawn(self, rid: str, loop: asyncio.AbstractEventLoop, coro: Any,
               out: asyncio.Queue[Any] | None) -> None:
        with self._relay_lock:
            self._relays[rid] = loop
        asyncio.run_coroutine_threadsafe(self._run_relay(rid, coro, out), loop)

    # --- the event loop ---------------------------------------------------------------

    async def _run_relay(self, rid: str, coro: Any, out: asyncio.Queue[Any] | None) -> None:
        """Run one relay; its failure goes to its client. It leaves ``_relays`` with no
        await after its last output, so a request that comes after that output was
        answered finds the relay gone."""
        try:
            if rid in self._cancelled:
                coro.close()
                return
            self._tasks[rid] = asyncio.current_task()  # type: ignore[assignment]
            await coro
        except asyncio.CancelledError:
            pass  # its client left: closing the stream aborts it on the new server
        except Exception as e:  # noqa: BLE001 - the client hears of it
            log.warning("relay of %s from %s failed: %s", rid, self._target, e)
            if out is not None:
                out.put_nowait(e if isinstance(e, RequestError) else RuntimeError(
                    f"the server that took this request over failed: {e}"))
        finally:
            self._tasks.pop(rid, None)
            self._cancelled.discard(rid)
            with self._relay_lock:
                self._relays.pop(rid, None)

    def _cancel_task(self, rid: str) -> None:
        t = self._tasks.get(rid)
        if t is not None:
            t.cancel()
        else:
            self._cancelled.add(rid)  # not started yet: it ends as it starts


def _put(loop: asyncio.AbstractEventLoop, q: asyncio.Queue[Any], item: Any) -> None:
    loop.call_soon_threadsafe(q.put_nowait, item)
