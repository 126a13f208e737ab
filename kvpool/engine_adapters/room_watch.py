"""RoomWatch: the daemon's last ``Room`` answer for one tenant, read without waiting.

(Generic in the answer: a vLLM API server watches its tenant's ``ps``/``stats`` view the
same way, :mod:`kvpool.engine_adapters.vllm.gauges`.)

A router scrapes a server's ``/metrics`` every 50 ms; the answer must not wait on the
daemon (the tenant's connection is one lock, and a grant waiting for reclaim holds it
for seconds). :meth:`RoomWatch.latest` returns the last answer at once and, when it is
older than ``max_age_s``, wakes one worker thread that asks again (one call in flight
at most, none while nobody scrapes). The very first call waits up to ``first_wait_s``
for an answer so a server's first scrape already has one. A failed ask (the daemon
gone, the session closed, a reply that does not validate) leaves the last answer in
place; :attr:`RoomWatch.failures` counts them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar


log = logging.getLogger("kvpool.adapter")

MAX_AGE_S = 0.05  # the router's scrape interval
FIRST_WAIT_S = 0.5
IDLE_EXIT_S = 30.0  # the worker ends after this long without a scrape (restarted on one)
T = TypeVar("T")


class RoomWatch(Generic[T]):
    """``ask`` (a tenant's :meth:`~kvpool.client_lib.Tenant.room`) answered off the scrape
    path (see the module). Thread-safe; :meth:`close` ends the worker."""

    def __init__(self, ask: Callable[[], T], max_age_s: float = MAX_AGE_S,
                 first_wait_s: float = FIRST_WAIT_S) -> None:
        self.ask = ask
        self.max_age_s = max_age_s
        self.first_wait_s = first_wait_s
        self.failures = 0
        self._last: T | None = None
        self._at = 0.0  # monotonic: when ``_last`` was asked for
        self._lock = threading.Lock()
        self._want = threading.Event()
        self._answered = threading.Event()
        self._worker: threading.Thread | None = None
        self._closed = False

    def latest(self) -> T | None:
        """The last answer (None before the first); asks again in the background when it
        is stale."""
        with self._lock:
            if self._closed:
                return self._last
            stale = time.monotonic() - self._at >= self.max_age_s
            if stale:
                self._want.set()
                if self._worker is None or not self._worker.is_alive():
                    self._worker = threading.Thread(target=self._run, name="kvpool-room",
                                                    daemon=True)
                    self._worker.start()
            first = self._last is None
        if first:
            self._answered.wait(self.first_wait_s)
        return self._last

    def _run(self) -> None:
        while not self._closed:
            if not self._want.wait(IDLE_EXIT_S):
                with self._lock:  # nobody scraped for a while: end (latest() restarts it)
                    if not self._want.is_set():
                        self._worker = None
                        return
                continue
            self._want.clear()
            asked = time.monotonic()
            try:
                reply = self.ask()
            except Exception as e:  # the daemon gone, the session closed, a bad reply
                self.failures += 1
                log.debug("room: %s: %s", type(e).__name__, e)
                with self._lock:
                    self._at = asked
                self._answered.set()
                continue
            with self._lock:
                self._last, self._at = reply, asked
            self._answered.set()

    def close(self) -> None:
        """End the worker (it exits after the call in flight, if any)."""
        with self._lock:
            self._closed = True
        self._want.set()
