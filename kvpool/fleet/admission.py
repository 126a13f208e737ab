"""Which replica serves a request, and the bounded wait for one: :class:`ModelQueue`
(one per model).

A request is sent at once to an awake replica (the model's picker chooses among the
awake ones). When none is awake the request *waits*, and waiting is bounded: at most
``limit`` requests of a model wait at once, the next gets :class:`QueueFull` (the router
answers 429 with ``Retry-After``), so a flood of requests for a sleeping or starting
model costs a counter and one small coroutine per waiter, never more than ``limit``.
While it waits:

* an asleep replica (the picker chooses among them) is woken by the supervisor, one wake
  shared by every waiter (:meth:`~kvpool.fleet.supervisor.Supervisor.wake`); a wake that
  fails is :class:`Unavailable` (503);
* else the model's stopped replicas are started, and the request waits for a change of
  state; every replica failed (and not yet due for another try) or hung, or no replica
  ready within ``wait_s``: :class:`Unavailable`. A hung replica is never chosen.

Only the fleet's event loop calls a queue.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvpool.fleet.balance import Picker, Prompt, Remembering, choose
from kvpool.fleet.member import ASLEEP, AWAKE, FAILED_BACKOFF_S, HUNG, STARTING, Member
from kvpool.fleet.metrics import FleetMetrics
from kvpool.fleet.supervisor import Supervisor, WakeFailed

RETRY_AFTER_S = 2  # what a 429 tells the client to wait


class QueueFull(Exception):
    """``limit`` requests of the model already wait; the message is one line."""

    retry_after_s = RETRY_AFTER_S


class Unavailable(Exception):
    """No replica of the model can serve now; the message is one line."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelQueue:
    """The requests of one model (``members``: its replicas in index order)."""

    def __init__(self, model: str, members: Sequence[Member], supervisor: Supervisor,
                 picker: Picker, metrics: FleetMetrics, limit: int, wait_s: float) -> None:
        self.model = model
        self.members = members
        self.supervisor = supervisor
        self.picker = picker
        self.metrics = metrics
        self.limit = limit
        self.wait_s = wait_s
        self.waiting = 0
        self._starts = [m.starts for m in members]  # a replica started again: forgotten

    async def acquire(self, prompt: Prompt) -> tuple[Member, str]:
        """A replica for one request and why the picker chose it (``only``, ``load``,
        ``prefix``, ``turn``: :class:`~kvpool.fleet.balance.Pick`), its
        ``inflight`` counted; pair with :meth:`release`. Raises :class:`QueueFull` or
        :class:`Unavailable`."""
        queued = False
        deadline = time.monotonic() + self.wait_s
        try:
            while True:
                awake = [m for m in self.members if m.state == AWAKE]
                ready = awake or [m for m in self.members if m.state == ASLEEP]
                if ready:
                    self._forget_restarted()
                    loads = [m.load(awake_only=bool(awake)) for m in self.members]
                    pick = choose(self.picker, prompt, loads)
                    m = self.members[pick.index]
                    if m.state == AWAKE:
                        m.inflight += 1
                        self.metrics.inflight.labels(self.model, str(m.index)).set(m.inflight)
                        return m, pick.reason
                    queued = self._enter(queued)
                    try:
                        await self.supervisor.wake(m)
                    except WakeFailed as e:
                        raise Unavailable(f"model {self.model!r} is asleep and could not "
                                          f"wake: {e}", RETRY_AFTER_S) from None
                    continue
                now = time.monotonic()
                if not any(m.state == STARTING or m.startable(now) for m in self.members):
                    if any(m.state == HUNG for m in self.members):
                        raise Unavailable(f"model {self.model!r}: its server does not answer "
                                          f"(hung); the fleet restarts it", RETRY_AFTER_S)
                    why = next((m.last_error for m in self.members if m.last_error), "")
                    raise Unavailable(f"model {self.model!r} failed to start: {why}",
                                      int(FAILED_BACKOFF_S))
                if now >= deadline:
                    raise Unavailable(f"model {self.model!r} had no ready server within "
                                      f"{self.wait_s:g} s", RETRY_AFTER_S)
                queued = self._enter(queued)
                self.supervisor.ensure_started(self.model)
                await self.supervisor.wait_change(deadline - now)
        finally:
            if queued:
                self.waiting -= 1
                self.metrics.queue_depth.labels(self.model).set(self.waiting)

    def _forget_restarted(self) -> None:
        """A replica whose server started again since the last pick has an empty cache:
        a picker that remembers what it sent there forgets it."""
        for i, m in enumerate(self.members):
            if m.starts != self._starts[i]:
                self._starts[i] = m.starts
                if isinstance(self.picker, Remembering):
                    self.picker.forget(m.index)

    def _enter(self, queued: bool) -> bool:
        if queued:
            return True
        if self.waiting >= self.limit:
            raise QueueFull(f"model {self.model!r}: {self.limit} requests already wait for "
                            f"a ready server (the fleet's queue); try again later")
        self.waiting += 1
        self.metrics.queue_depth.labels(self.model).set(self.waiting)
        return True

    def release(self, m: Member) -> None:
        """The request :meth:`acquire` gave ``m`` ended (however it ended)."""
        m.inflight -= 1
        m.completed += 1
        if m.inflight == 0:
            m.idle_since = time.monotonic()
            self.supervisor.released(m)
        self.metrics.inflight.labels(self.model, str(m.index)).set(m.inflight)
