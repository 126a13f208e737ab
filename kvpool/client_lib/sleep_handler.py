"""Sleep and wake on the tenant's side: the handler an engine gives the tenant, and the
worker thread that runs it when the daemon asks (docs/ARCHITECTURE.md, "Sleep and wake").

The daemon asks with an unsolicited ``SleepAsk`` (the operator's ``kvpool sleep|wake``,
or memory pressure); the tenant's keeper thread hands it to :class:`SleepWorker`, which
runs the engine's :class:`SleepHandler` on a thread of its own (a sleep may take seconds:
the keeper must go on answering reclaims meanwhile) and then reports the new state
(``TenantState``): a handler that keeps the state itself (:class:`ReportsState`, e.g.
the engines' :class:`~kvpool.engine_adapters.sleep_controller.SleepController`) reports what it is
now — ``busy`` after a sleep it refused because requests run, never ``idle`` mid-request;
for any other handler, ``asleep`` when ``sleep`` returned True, ``idle`` when it refused or
when ``wake`` returned True. One ask runs at a time; asks that arrive meanwhile are
kept, the latest only, and run next (a sleep then a wake while sleeping ends awake).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol, runtime_checkable

from kvpool import protocol as p

log = logging.getLogger("kvpool.client")


class SleepHandler(Protocol):
    """What an engine does when asked to sleep or wake (``Tenant.set_sleep_handler``)."""

    def sleep(self, reason: str) -> bool:
        """Release everything (KV pages, weight-set holds); True when asleep, False when
        it refuses (busy). Called on a worker thread, never the keeper; may take
        seconds. ``reason``: ``operator`` or ``pressure``. Must synchronise with the
        engine's own threads itself; exceptions are logged and count as a refusal."""
        ...

    def wake(self, reason: str) -> bool:
        """Take back what it needs to serve (weights re-attached or reloaded, KV
        re-granted lazily); True when awake. Same thread rules as :meth:`sleep`."""
        ...


@runtime_checkable
class ReportsState(Protocol):
    """A sleep handler that tells the tenant its state itself: after an ask the worker
    has it report what it is now, instead of guessing from the ask's outcome."""

    def report(self) -> None:
        """Send the current state (``busy``, ``idle``, ``asleep``) to the tenant."""
        ...


class SleepWorker:
    """Runs a :class:`SleepHandler` for the daemon's asks, one at a time, and reports
    the outcome through ``report`` (``Tenant.report_state``: never raises)."""

    def __init__(self, report: Callable[[str, str], None], name: str = "kvpool-sleep"):
        self.report = report
        self.name = name
        self._lock = threading.Lock()
        self._running: threading.Thread | None = None
        self._next: tuple[p.SleepAsk, SleepHandler] | None = None
        self.handled = 0  # asks run to the end (tests and diagnostics)

    def ask(self, m: p.SleepAsk, handler: SleepHandler | None) -> None:
        """The daemon asked (called on the keeper thread: returns at once)."""
        if handler is None:
            log.info("the daemon asked this tenant to %s (%s), but it has no sleep "
                     "handler: ignored", "wake" if m.wake else "sleep", m.reason)
            return
        with self._lock:
            if self._running is not None:
                self._next = (m, handler)  # the latest ask wins
                return
            self._running = threading.Thread(target=self._run, args=(m, handler),
                                             name=self.name, daemon=True)
            self._running.start()

    def _run(self, m: p.SleepAsk, handler: SleepHandler) -> None:
        while True:
            self._one(m, handler)
            with self._lock:
                self.handled += 1
                if self._next is None:
                    self._running = None
                    return
                (m, handler), self._next = self._next, None

    def _one(self, m: p.SleepAsk, handler: SleepHandler) -> None:
        try:
            done = handler.wake(m.reason) if m.wake else handler.sleep(m.reason)
        except Exception:
            log.exception("sleep handler's %s failed", "wake" if m.wake else "sleep")
            done = False
        if isinstance(handler, ReportsState):  # a refused sleep changed nothing: busy
            handler.report()                     # stays busy (issue 33 item 8)
            return
        if m.wake:
            self.report("idle" if done else "asleep", m.reason)
        else:
            self.report("asleep" if done else "idle", m.reason)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the ask running now, if any (tests; closing a tenant)."""
        t = self._running
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)
