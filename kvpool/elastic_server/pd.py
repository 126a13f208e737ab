"""A prefill/decode pair of bundled engine servers that hand each request's KV over as
pages (``kvpool serve MODEL --role prefill|decode``).

* The **prefill** server (:class:`PrefillEngine`) answers ``POST /pd/prefill``: it runs
  the request until its first token, offers the request's units to the decode tenant
  (:func:`.handoff.give`) and replies with the :class:`~.handoff.Handover`; its step
  thread settles the tickets (a claim: the pool forgets the units; an expired ticket:
  the request is dropped here and its memory freed). It serves the OpenAI API too.
* The **decode** server (:class:`DecodeEngine`) is the front: the same OpenAI API as
  ``kvpool serve``; for each request it asks the prefill server for the prefill, claims
  the handover into its own units (:func:`.handoff.take`) and streams the rest (the
  first token, sampled by the prefill engine, comes first). When the claim fails (the
  ticket expired, the prefill server died) it computes the request itself: slower, but
  the same tokens.

Both run elastic and request-aligned, each as its own kvpool tenant
(``<model>-prefill``, ``<model>-decode`` unless ``KVPOOL_TENANT`` names them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from kvpool.engine.serving.async_engine import AddRequest, AsyncEngine
from kvpool.engine.config import EngineConfig
from kvpool.engine_adapters.bundled.bridge import BundledBridge
from kvpool.engine.errors import RequestError
from kvpool.engine.request import RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.client_lib import handoff as wire
from kvpool.engine_adapters.bundled import handoff

log = logging.getLogger("kvpool.pd")

ROLES = ("prefill", "decode")


@dataclass
class _Adopt:
    handover: handoff.Handover
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[RequestOutput | BaseException]


class PrefillEngine(AsyncEngine):
    """Runs ``/pd/prefill`` requests to their first token, then hands them to ``to``."""

    def __init__(self, engine: Any, to: str, ttl_s: float = 10.0) -> None:
        super().__init__(engine)
        self.to, self.ttl_s = to, ttl_s
        self._prefills: set[str] = set()
        self._tickets: list[tuple[handoff.Handover, wire.Ticket]] = []
        self.handed = self.expired = 0

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams
                      ) -> dict[str, Any]:
        """``{"handover": ...}`` (the decode side claims it) or ``{"done": ...}`` when the
        first token ended the request."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._prefills.add(request_id)
        self.post(AddRequest(request_id, prompt, params, asyncio.get_running_loop(), q,
                             time.perf_counter()))
        item = await q.get()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, RequestOutput):
            return {"done": _output_json(item)}
        return {"handover": dataclasses.asdict(item)}

    def _deliver(self, out: RequestOutput) -> None:
        rid = out.request_id
        if rid not in self._prefills or out.finished or not out.new_token_ids:
            if out.finished:
                self._prefills.discard(rid)  # ended at its first token: {"done": ...}
            return super()._deliver(out)
        self._prefills.discard(rid)
        s = self._streams.pop(rid)
        try:
            with self._lock:
                h, ticket = handoff.give(self.engine, rid, to=self.to, ttl_s=self.ttl_s)
        except Exception as e:  # noqa: BLE001 - the caller hears of it
            with self._lock:
                self.engine.abort(rid)
            s.loop.call_soon_threadsafe(s.out.put_nowait, e)
            return
        self._tickets.append((h, ticket))
        q: asyncio.Queue[Any] = s.out  # a prefill's queue takes the handover too
        s.loop.call_soon_threadsafe(q.put_nowait, h)

    def _drain(self, block: bool) -> list[Any]:
        self._settle()
        if self._tickets and block:  # keep polling the tickets
            time.sleep(0.002)
            block = False
        return super()._drain(block)

    def _settle(self) -> None:
        """Finish the tickets the daemon settled (between steps, on the step thread)."""
        done = [(h, t) for h, t in self._tickets if t.settled]
        if not done:
            return
        self._tickets = [x for x in self._tickets if not x[1].settled]
        for h, t in done:
            with self._lock:
                state = handoff.settle(self.engine, h, t, 0)
                if state == "claimed":
                    self.handed += 1
                else:  # the decode side recomputes it: drop it here, free its memory
                    self.expired += 1
                    self.engine.abort(h.request_id)


class DecodeEngine(AsyncEngine):
    """The front: asks the prefill server for each request's prefill, then decodes."""

    def __init__(self, engine: Any, prefill_url: str, timeout_s: float = 600.0) -> None:
        super().__init__(engine)
        self.prefill_url = prefill_url.rstrip("/")
        self.timeout_s = timeout_s
        self.adopted = self.recomputed = 0
        self._client: Any = None  # one httpx.AsyncClient, made in the serving loop

    def _prefill_client(self) -> Any:
        """The client for the prefill server, made once: an ``httpx.AsyncClient`` costs
        ~25 ms of CPU to build (its TLS context), which per request would hold the GIL
        and stall this server's decode steps."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        return self._client

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams
                       ) -> AsyncGenerator[RequestOutput, None]:
        import httpx

        body = {"request_id": request_id, "prompt": prompt,
                "params": dataclasses.asdict(params)}
        try:
            reply = await self._prefill_client().post(f"{self.prefill_url}/pd/prefill",
                                                      json=body)
        except httpx.TransportError as e:  # no prefill server: compute it here
            log.warning("prefill server unreachable (%s); computing %s here", e, request_id)
            self.recomputed += 1
            async for out in super().generate(request_id, prompt, params):
                yield out
            return
        if reply.status_code != 200:
            raise RequestError(_error_text(reply))
        got = reply.json()
        if "done" in got:
            yield RequestOutput(**got["done"])
            return
        h = handoff.Handover(**got["handover"])
        first = h.token_ids[h.num_prompt_tokens:]
        yield RequestOutput(request_id=request_id, prompt_token_ids=prompt,
                            output_token_ids=first, new_token_ids=first, text="",
                            finished=False, finish_reason=None)
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.post(_Adopt(h, prompt, params, asyncio.get_running_loop(), q))
        async with contextlib.aclosing(self._relay(request_id, q)) as outs:
            async for out in outs:
                yield out

    def _handle(self, cmd: Any) -> None:
        if not isinstance(cmd, _Adopt):
            return super()._handle(cmd)
        h = cmd.handover
        try:
            with self._lock:
                try:
                    handoff.take(self.engine, h)
                    self.adopted += 1
                except Exception as e:  # noqa: BLE001 - recompute it here instead
                    log.warning("handoff of %s failed (%s); recomputing it", h.request_id, e)
                    self.engine.add_request(cmd.prompt, cmd.params, h.request_id)
                    self.recomputed += 1
        except Exception as e:  # noqa: BLE001
            cmd.loop.call_soon_threadsafe(cmd.out.put_nowait, e)
            return
        self._streams[h.request_id] = cmd  # type: ignore[assignment]

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "pd": {"adopted": self.adopted,
                                          "recomputed": self.recomputed}}


def _output_json(o: RequestOutput) -> dict[str, Any]:
    d = dataclasses.asdict(o)
    d["logits"] = []
    return d


def _error_text(reply: Any) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except Exception:  # noqa: BLE001
        return f"prefill server answered {reply.status_code}"


class PrefillBody(BaseModel):
    """``POST /pd/prefill``: the front's request (token ids, sampling parameters)."""

    request_id: str
    prompt: list[int]
    params: dict[str, Any]


def enable_role(config: EngineConfig, role: str) -> BundledBridge:
    """The adapter of an elastic, request-aligned engine of ``config`` named for
    ``role``."""
    import os

    from kvpool.engine_adapters.bundled import Settings, enable

    settings = Settings.from_env()
    settings.request_aligned = True
    if settings.name is None and "KVPOOL_TENANT" not in os.environ:
        settings.name = f"{tenant_base(config)}-{role}"
    return enable(config, settings)


def tenant_base(config: EngineConfig) -> str:
    from pathlib import Path

    return config.served_model_name or Path(config.model).resolve().name


def serve_role(config: EngineConfig, role: str, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", prefill_url: str | None = None,
               handoff_to: str | None = None) -> None:
    """Load the model as the ``role`` half of a pair and serve until interrupted."""
    import uvicorn

    from kvpool.engine.engine import Engine
    from kvpool.engine.serving.server import create_app
    from kvpool.engine_adapters.bundled.memory_view import ElasticMemory

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    if role == "decode" and not prefill_url:
        raise ValueError("a decode server needs --prefill-url (the prefill server)")
    bridge = enable_role(config, role)
    engine = Engine(bridge.config, bridge.seams)
    if role == "prefill":
        aengine: AsyncEngine = PrefillEngine(engine, handoff_to or
                                             f"{tenant_base(config)}-decode")
    else:
        aengine = DecodeEngine(engine, prefill_url or "")
    app = create_app(aengine, memory=ElasticMemory(engine, bridge))  # (elastic /metrics)
    if isinstance(aengine, PrefillEngine):
        pe = aengine

        @app.post("/pd/prefill")
        async def prefill(body: PrefillBody) -> dict[str, Any]:
            try:
                sp = SamplingParams(**body.params)
            except (TypeError, ValueError) as e:
                raise RequestError(f"bad sampling parameters: {e}") from None
            return await pe.prefill(body.request_id, engine.encode(body.prompt), sp)

    uvicorn.run(app, host=host, port=port, log_level=log_level)


def serve_pair(config: EngineConfig, argv: list[str], host: str = "127.0.0.1",
               port: int = 8000, log_level: str = "info", start_timeout_s: float = 300.0,
               cpus: list[int] | None = None) -> None:
    """``kvpool serve MODEL --pd``: start the prefill half as a child process (the same
    command line ``argv`` with ``--role prefill`` on a free loopback port), then serve the
    decode half here as the front; the child ends with this process. ``cpus`` (the
    front's ``--decode-cpus`` or ``--cpus``): the CPUs this process is pinned to once the
    child has started, so the child (which pins itself to its ``--prefill-cpus``) may
    still choose any of this process's CPUs."""
    import socket
    import subprocess

    from kvpool import paths
    from kvpool.client_lib.connection import probe
    from kvpool.launch import cli_argv, wait_healthy

    probe(paths.run_dir())  # no daemon: one line here, not the child's and then ours
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        child_port = s.getsockname()[1]
    cmd = [*cli_argv(), *argv, "--role", "prefill",
           "--host", "127.0.0.1", "--port", str(child_port)]
    child = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
    url = f"http://127.0.0.1:{child_port}"
    try:
        if cpus:
            from kvpool.engine.cpus import pin_and_say

            pin_and_say(cpus, "kvpool serve --pd (decode)")
        wait_healthy(child, url, "the prefill server", time.monotonic() + start_timeout_s)
        serve_role(config, "decode", host, port, log_level, prefill_url=url)
    finally:
        child.terminate()
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _die_with_parent() -> None:
    """(in the child, Linux) SIGTERM when the front exits, however it exits (uvicorn
    re-raises SIGTERM after its shutdown, so a ``finally`` in the front never runs)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
