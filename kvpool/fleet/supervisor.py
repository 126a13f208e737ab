"""Starts, watches, wakes and stops the members of a fleet: :class:`Supervisor`.

One watch task looks at every member each ``poll_s`` (all looks at once):

* ``starting``: ``GET /health`` 200 makes it ``awake``; a process that exits, or is not
  healthy within the fleet's ``start_timeout_s``, makes it ``failed`` (one log line
  saying why; ``kvpool_fleet_upstream_errors_total{kind="start"}``). Except a process
  that exited because its port was taken before it bound
  (:meth:`~kvpool.fleet.member.Member.port_taken`): the member is started again on
  another port, still ``starting`` (one log line ``fleet: T: port P was taken ...``),
  up to ``PORT_TRIES`` processes per start; such a try is neither a start nor a
  restart (no ``fleet: starting`` line, ``Member.starts`` and the restart and error
  counts unchanged; ``kvpool_fleet_port_retries_total`` counts it),
  and a start whose every port was taken fails as above. A ``/health`` 200 from the
  port of a member whose server has not bound it yet is another process's server
  (:meth:`~kvpool.fleet.member.Member.another_listens`): not taken for this member's;
* ``awake``/``asleep``/``hung``: a process that exited is started again at once (one
  log line, ``kvpool_fleet_restarts_total``); else its sleep state is read (``GET`` the
  kind's ``state_path``, ``LOOK_TIMEOUT_S``), then its KV figures when the kind has a
  ``stats_path`` (``Member.kv``, for :mod:`kvpool.fleet.router_protocol`). Sleeps are
  counted by cause from the server's own counters (``GET /kvpool/sleep``: the bundled
  server's, and vLLM's with the kvpool plugin); only a server that kept none would have
  an ``awake -> asleep`` change guessed, ``idle`` when the model has ``sleep_after`` and
  the router sent it nothing for that long, else ``pressure`` (no kind of the fleet's is
  such a server). A process that exited is named by its signal, or by its exit code and
  its last error line (:meth:`~kvpool.fleet.member.Member.why_exited`).
* a member whose server has answered no look for ``hung_after_s`` (a stopped or
  deadlocked process: the kernel still accepts its connections, nothing answers) is
  ``hung``: the router sends it nothing (another replica serves; none: 503). One that
  answers again is awake or asleep again; one silent for ``hung_restart_s`` is killed
  (SIGKILL to its process group: a stopped process ignores SIGTERM) and started again
  (one log line, ``kvpool_fleet_restarts_total``); the requests it held end then (502).

A look whose answer comes back after the member changed (a wake the router asked for,
a restart) is dropped (``version``). Every change of state sets the current
:meth:`wait_change` event, which the requests waiting for a ready replica wait on.

:meth:`wake` wakes an asleep member for the router (``POST /wake_up``), one wake per
member however many requests wait for it; the wake is measured
(``kvpool_fleet_wake_seconds``). :meth:`close` stops every member (process groups,
SIGTERM then SIGKILL) and the watch task; nothing the fleet started outlives it.

The fleet's policy (:mod:`kvpool.fleet.policies`) is asked before every start of a
member (:meth:`ensure_started`, the eager starts: ``may_start``), hears of every member
whose last request ended (:meth:`released`), and runs as one task from :meth:`start` to
:meth:`close`, acting through :meth:`unload` (the process group stopped: ``stopped``),
:meth:`put_to_sleep` (``POST /sleep``: ``asleep``) and :meth:`poke`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from kvpool.fleet.member import (ASLEEP, AWAKE, FAILED, HUNG, PORT_TRIES, STARTING, STOPPED,
                                 WATCHED, Member, MemberState)
from kvpool.fleet.metrics import FleetMetrics
from kvpool.fleet.router_protocol import member_kv
from kvpool.fleet.policies.base import PolicyRun
from kvpool.fleet.policies.kvpool import NOTHING

POLL_S = 0.5
HUNG_AFTER_S = 30.0
HUNG_RESTART_S = 120.0
LOOK_TIMEOUT_S = 5.0  # one health or state look (a busy server on 2 cores answers slowly)
SLEEP_TIMEOUT_S = 60.0  # a policy's POST /sleep (the server releases everything)
WAKE_TIMEOUT_S = 330.0  # the server's own wake wait is 300 s (kvpool.engine_adapters.sleep_controller)


class WakeFailed(RuntimeError):
    """The router's wake of a member did not succeed; one line saying why."""


class Supervisor:
    """The members of a fleet (``members``: model name -> replicas in index order).
    ``client`` makes every call to the members; ``say`` takes the fleet's log lines."""

    def __init__(self, members: Mapping[str, Sequence[Member]], metrics: FleetMetrics,
                 client: httpx.AsyncClient, start_timeout_s: float,
                 say: Callable[[str], None], poll_s: float = POLL_S,
                 control_headers: Mapping[str, str] | None = None,
                 hung_after_s: float = HUNG_AFTER_S,
                 hung_restart_s: float = HUNG_RESTART_S,
                 policy: PolicyRun = NOTHING) -> None:
        self.members = members
        self.policy = policy  # the fleet policy's run (kvpool.fleet.policies)
        # sent with every wake: the bearer token of KVPOOL_CONTROL_TOKEN (members inherit it)
        self.control_headers = dict(control_headers or {})
        self.hung_after_s = hung_after_s
        self.hung_restart_s = max(hung_restart_s, hung_after_s)
        self.metrics = metrics
        self.client = client
        self.start_timeout_s = start_timeout_s
        self.say = say
        self.poll_s = poll_s
        self._changed = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        self._eager: asyncio.Task[None] | None = None
        self._policy: asyncio.Task[None] | None = None
        self._wakes: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._versions: dict[tuple[str, int], int] = {}
        self.closed = False

    def all(self) -> list[Member]:
        return [m for ms in self.members.values() for m in ms]

    # ---- life ------------------------------------------------------------------------
    def start(self, eager: Sequence[str]) -> None:
        """Start the watch task and, one after another, the members of the ``eager``
        models (in the loop)."""
        self._watch = asyncio.create_task(self._watch_loop(), name="fleet-watch")
        self._policy = asyncio.create_task(self._run_policy(), name="fleet-policy")
        if eager:
            self._eager = asyncio.create_task(self._start_in_turn(eager), name="fleet-eager")

    async def _start_in_turn(self, eager: Sequence[str]) -> None:
        """Eager members start one at a time, each once the one before is up or failed.
        Started together on a budget their weights fill, one could not make room: the
        daemon puts only an *idle* sleepable tenant to sleep, and a member still loading
        has not said idle yet, so its first KV chunk would be refused."""
        for model in eager:
            for m in self.members[model]:
                if self.closed:
                    return
                if m.startable(time.monotonic()) and self.policy.may_start(m, self):
                    self._spawn(m)
                while m.state == STARTING and not self.closed:
                    await self.wait_change(1.0)

    async def close(self) -> None:
        """Stop watching, then stop every member (at once, each on a thread)."""
        self.closed = True
        for task in (self._eager, self._policy, self._watch):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._eager = self._policy = self._watch = None
        for task in self._wakes.values():
            task.cancel()
        await asyncio.gather(*(asyncio.to_thread(m.stop) for m in self.all()))
        for m in self.all():
            self.set_state(m, STOPPED)

    def stop_all(self) -> None:
        """:meth:`close` without a loop (a fleet that stops before or after serving)."""
        self.closed = True
        for m in self.all():
            m.stop()

    # ---- states ----------------------------------------------------------------------
    def set_state(self, m: Member, state: MemberState) -> None:
        """Change ``m``'s state (the watch's, the wake's and tests' one way): metrics,
        the look version, and the waiters of :meth:`wait_change`."""
        key = (m.model, m.index)
        self._versions[key] = self._versions.get(key, 0) + 1
        if m.state != state:
            m.state = state
            self.metrics.set_state(m.model, m.index, state)
            self._changed.set()
            self._changed = asyncio.Event()

    def _version(self, m: Member) -> int:
        return self._versions.get((m.model, m.index), 0)

    async def wait_change(self, timeout_s: float) -> None:
        """Return at the next change of any member's state, or after ``timeout_s``."""
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass

    def ensure_started(self, model: str) -> None:
        """Start every replica of ``model`` that is stopped (or failed long enough ago)."""
        now = time.monotonic()
        for m in self.members[model]:
            if m.startable(now) and not self.closed and self.policy.may_start(m, self):
                self._spawn(m)

    def _spawn(self, m: Member) -> None:
        try:
            m.spawn()
        except OSError as e:
            self._failed(m, f"cannot start: {e}")
            return
        self.say(f"fleet: starting {m.tenant} ({m.entry.engine}) at {m.url}; log {m.log}")
        self.set_state(m, STARTING)

    def _another_port(self, m: Member) -> None:
        """``m``'s process found its port taken: the same start on a new port."""
        taken = m.port
        try:
            m.spawn_on_another_port()
        except OSError as e:
            self._failed(m, f"cannot start: {e}")
            return
        self.metrics.port_retries.labels(m.model).inc()
        self.say(f"fleet: {m.tenant}: port {taken} was taken before its server bound it "
                 f"(address already in use); starting it on port {m.port} instead "
                 f"(try {m.port_tries} of {PORT_TRIES})")
        self.set_state(m, STARTING)  # (a look of the last process is dropped)

    def _failed(self, m: Member, why: str) -> None:
        m.fail(why)
        self.metrics.upstream_errors.labels(m.model, "start").inc()
        self.say(f"fleet: {m.tenant} failed to start: {why}")
        self.set_state(m, FAILED)

    # ---- what a fleet policy does (kvpool.fleet.policies.base.Control) ------------------
    async def _run_policy(self) -> None:
        try:
            await self.policy.run(self)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a policy's bug is one log line, never the fleet's end
            self.say(f"fleet: the policy stopped: {type(e).__name__}: {e}")

    def poke(self) -> None:
        """Wake the waiters of :meth:`wait_change` without a change of state."""
        self._changed.set()
        self._changed = asyncio.Event()

    def released(self, m: Member) -> None:
        """``m``'s last request in flight ended (the router's queue says so): the
        policy hears of it (swap: a model that waits for an idle one looks again)."""
        self.policy.released(m, self)

    async def unload(self, m: Member, why: str) -> None:
        """Stop ``m``'s server for the policy: ``stopped`` at once (nothing is routed
        to it, the watch leaves it alone), back when its process group is gone."""
        self.say(f"fleet: unloading {m.tenant}: {why}")
        self.set_state(m, STOPPED)
        await asyncio.to_thread(m.stop)

    async def put_to_sleep(self, m: Member, why: str) -> bool:
        """``POST /sleep`` to ``m`` for the policy; ``asleep`` once it answers 200."""
        url = m.url
        try:
            reply = await self.client.post(f"{url}/sleep", timeout=SLEEP_TIMEOUT_S,
                                           headers=self.control_headers)
        except httpx.HTTPError as e:
            self.say(f"fleet: {m.tenant} did not answer its sleep: {type(e).__name__}")
            return False
        if reply.status_code != 200:
            self.say(f"fleet: {m.tenant} did not sleep ({why}): {_message(reply)}")
            return False
        if m.url == url and m.state == AWAKE:
            self.set_state(m, ASLEEP)
        self.say(f"fleet: put {m.tenant} to sleep: {why}")
        return True

    # ---- watching ----------------------------------------------------------------------
    async def _watch_loop(self) -> None:
        while True:
            members = self.all()
            await asyncio.gather(*(self._look(m) for m in members))
            await asyncio.sleep(self.poll_s)

    async def _look(self, m: Member) -> None:
        try:
            if m.state == STARTING:
                await self._look_starting(m)
            elif m.state in WATCHED:
                await self._look_ready(m)
        except Exception as e:  # a look never ends the watch
            self.say(f"fleet: watching {m.tenant}: {type(e).__name__}: {e}")

    async def _look_starting(self, m: Member) -> None:
        code = m.exit_code()
        if code is not None:
            m.kill_group()
            taken = m.port_taken(code)
            if taken and m.port_tries < PORT_TRIES and not self.closed:
                self._another_port(m)
                return
            self._failed(m, f"{m.why_exited(code)} (while starting"
                            + (f"; each of {m.port_tries} ports taken)" if taken else ")"))
            return
        version = self._version(m)
        if await self._healthy(m):
            if self._version(m) == version and m.exit_code() is None \
                    and not await asyncio.to_thread(m.another_listens):
                m.answered_at = m.up_at = time.monotonic()
                self.say(f"fleet: {m.tenant} is up at {m.url} "
                         f"({time.monotonic() - m.started_at:.1f} s)")
                self.set_state(m, AWAKE)
            return
        if time.monotonic() - m.started_at > self.start_timeout_s:
            self._failed(m, f"not healthy within {self.start_timeout_s:g} s: {m.log_tail()}")
            await asyncio.to_thread(m.stop, 5.0)

    async def _look_ready(self, m: Member) -> None:
        code = m.exit_code()
        if code is not None:
            m.kill_group()
            self.metrics.restarts.labels(m.model).inc()
            self.say(f"fleet: {m.tenant} {m.why_exited(code)}; restarting it")
            self._spawn(m)
            return
        version = self._version(m)
        try:
            reply = await self.client.get(f"{m.url}{m.kind.state_path}",
                                          timeout=LOOK_TIMEOUT_S)
        except httpx.HTTPError:
            await self._silent(m)  # busy, going away, or hung: the silence tells
            return
        m.answered_at = time.monotonic()
        try:
            observed = m.kind.observe(reply.json()) if reply.status_code == 200 else None
        except ValueError:
            observed = None
        if self._version(m) != version:
            return
        if m.state == HUNG:
            self.say(f"fleet: {m.tenant} answers again")
            if observed is None:
                self.set_state(m, AWAKE)  # (asleep: it wakes itself for a request)
        if observed is None:
            return
        self._count(m, observed.asleep, observed.sleeps, observed.wakes)
        self.set_state(m, ASLEEP if observed.asleep else AWAKE)
        await self._look_kv(m, self._version(m))  # (set_state moved the version on)

    async def _look_kv(self, m: Member, version: int) -> None:
        """Its KV figures (the kind's ``stats_path``) for the fleet's router protocol
        (:mod:`kvpool.fleet.router_protocol`); unknown (None) when it does not answer
        them or answers something else."""
        path = m.kind.stats_path
        if path is None:
            return
        try:
            reply = await self.client.get(f"{m.url}{path}", timeout=LOOK_TIMEOUT_S)
            kv = member_kv(reply.json()) if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            kv = None
        if self._version(m) == version:
            m.kv = kv

    async def _silent(self, m: Member) -> None:
        """A look ``m`` did not answer: hung after ``hung_after_s`` of silence, killed and
        started again after ``hung_restart_s`` (see the module)."""
        silent = time.monotonic() - m.answered_at
        if silent >= self.hung_restart_s:
            self.say(f"fleet: {m.tenant} answered nothing for {silent:.0f} s; killed it, "
                     f"restarting it")
            self.metrics.restarts.labels(m.model).inc()
            await asyncio.to_thread(m.kill)
            if not self.closed:
                self._spawn(m)
        elif silent >= self.hung_after_s and m.state != HUNG:
            self.say(f"fleet: {m.tenant} answered nothing for {silent:.0f} s: hung, no "
                     f"request goes to it (killed if silent for {self.hung_restart_s:g} s)")
            self.set_state(m, HUNG)

    def _count(self, m: Member, asleep: bool, sleeps: Mapping[str, int] | None,
               wakes: int | None) -> None:
        """Sleeps by cause and wakes since the last look (see the module)."""
        if sleeps is not None:
            for cause, n in sleeps.items():
                if n > m.sleeps_seen.get(cause, 0):
                    self.metrics.sleeps.labels(m.model, cause).inc(n - m.sleeps_seen.get(cause, 0))
            m.sleeps_seen = dict(sleeps)
        elif asleep and m.state == AWAKE:
            after = m.entry.sleep_after
            idle = m.inflight == 0 and after is not None \
                and time.monotonic() - m.idle_since >= after
            self.metrics.sleeps.labels(m.model, "idle" if idle else "pressure").inc()
        m.counts_wakes = wakes is not None
        if wakes is not None:
            if wakes > m.wakes_seen:
                self.metrics.wakes.labels(m.model).inc(wakes - m.wakes_seen)
            m.wakes_seen = wakes
        elif not asleep and m.state == ASLEEP:
            self.metrics.wakes.labels(m.model).inc()

    async def _healthy(self, m: Member) -> bool:
        try:
            reply = await self.client.get(f"{m.url}/health", timeout=LOOK_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    # ---- waking ------------------------------------------------------------------------
    async def wake(self, m: Member) -> None:
        """Wake the asleep member ``m``; every caller shares one wake. Raises
        :class:`WakeFailed` (one line) when it does not wake."""
        key = (m.model, m.index)
        task = self._wakes.get(key)
        if task is None or task.done():
            task = self._wakes[key] = asyncio.create_task(self._wake(m), name="fleet-wake")
        await asyncio.shield(task)

    async def _wake(self, m: Member) -> None:
        t0 = time.monotonic()
        url = m.url
        try:
            reply = await self.client.post(f"{url}/wake_up", timeout=WAKE_TIMEOUT_S,
                                           headers=self.control_headers)
        except httpx.HTTPError as e:
            self.metrics.upstream_errors.labels(m.model, "wake").inc()
            raise WakeFailed(f"{m.tenant} did not answer its wake: {type(e).__name__}") from None
        if reply.status_code != 200:
            self.metrics.upstream_errors.labels(m.model, "wake").inc()
            raise WakeFailed(f"{m.tenant} could not wake: {_message(reply)}")
        seconds = time.monotonic() - t0
        self.metrics.wake_seconds.labels(m.model).observe(seconds)
        if m.url == url and m.state == ASLEEP:
            if not m.counts_wakes:  # the server keeps no count: this wake is counted here
                self.metrics.wakes.labels(m.model).inc()
            self.set_state(m, AWAKE)
        self.say(f"fleet: woke {m.tenant} in {seconds:.2f} s")


def _message(reply: httpx.Response) -> str:
    """The one-line message of an error reply (OpenAI's shape, else the status)."""
    try:
        body: Any = reply.json()
        text = str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        text = f"HTTP {reply.status_code}"
    return text.splitlines()[0][:300] if text else f"HTTP {reply.status_code}"
