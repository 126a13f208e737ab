"""Sleep and wake of a serving engine, engine-neutral: :class:`SleepController`.

A server that sleeps gives back everything it holds in the pool (all its KV pages, its
hold on its weight set) and keeps only its process and virtual ranges; waking takes back
what serving needs. Four callers, one controller per engine:

* the server's HTTP routes (``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``);
* the daemon (``kvpool sleep/wake NAME``, or a needy grant's pressure): the tenant's
  worker thread calls :meth:`SleepController.sleep` / :meth:`~SleepController.wake`,
  the controller being the tenant's sleep handler
  (:class:`~kvpool.client_lib.sleep_handler.SleepHandler`);
* the idle timer (``sleep_after_s``): an engine with no request for that long sleeps;
* requests: every request is admitted through :meth:`~SleepController.enter` (async) /
  :meth:`~SleepController.enter_blocking`, paired with :meth:`~SleepController.leave`.
  A request that finds the engine asleep wakes it and is then served (its TTFT includes
  the wake); it never fails because the model slept. Only when the wake cannot get the
  memory (the daemon refused the grant after its deadline, or ``wake_wait_s`` passed)
  does the request get :class:`WakeFailed`, one line (the servers answer 503).

**A sleep while requests run is refused**: :meth:`~SleepController.sleep` returns False
(the HTTP route answers 409) when a request is admitted, the engine has work
(:meth:`SleepTarget.busy`) or the target finds work when it looks under its own lock
(:class:`SleepRefused`). (:meth:`~SleepController.note_work` only feeds the reports and
the idle timer.) Requests that arrive while the
engine is falling asleep wait for that to end, then wake it.

The controller tells the tenant what the engine does (``report_state``): ``busy`` from
the first admitted request (or reported work) until the last ends, then ``idle``;
``asleep`` once asleep; ``idle`` again after a wake. The daemon only ever puts an
``idle`` sleepable tenant to sleep.

Engine specifics come in through :class:`SleepTarget` (release everything / take it
back / has work); the state goes out through :class:`StateReport` (the tenant).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Protocol

log = logging.getLogger("kvpool.sleep")

AWAKE = "awake"
FALLING_ASLEEP = "falling_asleep"
ASLEEP = "asleep"
WAKING = "waking"

WAKE_WAIT_S = 300.0  # a request waits at most this long for a wake (the grant's own
# deadline, the daemon's, usually ends it first)


class SleepRefused(RuntimeError):
    """Raised by :meth:`SleepTarget.release_all` when, under the engine's own lock, it
    finds work after all (nothing was released): the sleep is refused."""


class WakeFailed(RuntimeError):
    """A request found the engine asleep and the wake could not get its memory in time;
    the message is one line saying why."""


class SleepTarget(Protocol):
    """The engine-specific half of sleeping (an adapter implements it).

    The controller calls ``release_all`` and ``restore`` one at a time (never both at
    once, never twice in a row without the other succeeding in between), on whatever
    thread asked for the transition (an HTTP worker thread, the tenant's worker thread,
    the idle timer), never on the engine's own step thread; each may take seconds.
    """

    def busy(self) -> bool:
        """Whether the engine has work the controller's request count does not show
        (requests it adopted, requests running or waiting in its scheduler). Cheap; may be
        called with the controller's lock held, so it must not call the controller."""
        ...

    def release_all(self) -> None:
        """Give everything back: every KV page (prefix cache dropped, no refill until
        :meth:`restore`) and the hold on the weights. Must exclude the engine's steps
        while it runs and raise :class:`SleepRefused` (having released nothing) if it
        finds work under that exclusion. Any other exception means it may have released
        part: the controller then calls :meth:`restore` before serving again."""
        ...

    def restore(self) -> None:
        """Take back what serving needs (weights re-attached or reloaded, the KV the
        engine needs before its first step); waits for memory like a grant and raises
        (one-line message) when the memory does not come. Idempotent for what is
        already back, so a failed restore can be retried."""
        ...


class StateReport(Protocol):
    """Where the engine's state goes (the tenant: ``Tenant.report_state``)."""

    def report_state(self, state: str, reason: str | None = None) -> None:
        """``"busy"``, ``"idle"`` or ``"asleep"``; ``reason``: why it went to sleep or
        woke (``idle``, ``request``, ``http``, ``operator``, ``pressure``; None
        otherwise). Thread-safe, never raises, cheap (sends only changes)."""
        ...


class SleepController:
    """Sleep/wake state, request gating, idle timer and state reports of one engine.

    Thread safety: every method may be called from any thread; transitions are one at a
    time (``_transition``), the state and counts are guarded by ``_cond``. :meth:`enter`
    is for asyncio callers (it never blocks the event loop: a wake runs on a thread of its
    own and every waiter awaits the same one); :meth:`enter_blocking` for threads.
    Lifetime: :meth:`start` starts the idle timer (only with ``sleep_after_s``);
    :meth:`close` ends it (idempotent). Counters: ``sleeps`` (and ``sleeps_by_reason``:
    ``idle``, ``pressure``, ``operator``, ``http``), ``wakes`` (transitions done),
    ``refusals`` (sleeps refused), ``last_error`` (why the last wake failed).
    """

    def __init__(self, target: SleepTarget, reporter: StateReport | None = None,
                 sleep_after_s: float | None = None, wake_wait_s: float = WAKE_WAIT_S
                 ) -> None:
        if sleep_after_s is not None and sleep_after_s <= 0:
            raise ValueError(f"sleep_after_s must be positive, got {sleep_after_s}")
        self.target = target
        self.reporter = reporter
        self.sleep_after_s = sleep_after_s
        self.wake_wait_s = wake_wait_s
        self._transition = threading.Lock()  # one sleep or wake at a time
        self._cond = threading.Condition(threading.Lock())
        self._report_lock = threading.Lock()  # reports go out in the order of the state
        self._state = AWAKE
        self._active = 0  # admitted requests (enter .. leave)
        self._engine_busy = False  # work the engine reported (note_work)
        self._idle_since = time.monotonic()
        self._pending: concurrent.futures.Future[bool] | None = None  # a request's wake
        self._closed = False
        self._timer: threading.Thread | None = None
        self.sleeps = self.wakes = self.refusals = 0
        self.sleeps_by_reason: dict[str, int] = {}  # reason -> sleeps done (a fleet reads it)
        self.last_error = ""

    # ---- state ---------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``awake``, ``falling_asleep``, ``asleep`` or ``waking``."""
        with self._cond:
            return self._state

    @property
    def is_sleeping(self) -> bool:
        """True unless fully awake (vLLM's ``is_sleeping``: a wake under way still sleeps)."""
        return self.state != AWAKE

    @property
    def active(self) -> int:
        """Requests admitted now."""
        with self._cond:
            return self._active

    def _reported_state(self) -> str:
        """(``_cond`` held) What the tenant should see now."""
        if self._state in (ASLEEP, FALLING_ASLEEP):
            return "asleep" if self._state == ASLEEP else "busy"
        return "busy" if self._active or self._engine_busy else "idle"

    def report(self, reason: str | None = None) -> None:
        """Send the current state to the tenant (what it is now, so reports racing from
        several threads end in the right one); ``reason``: the transition's, if one
        just ended."""
        if self.reporter is None:
            return
        with self._report_lock:
            with self._cond:
                state = self._reported_state()
            try:
                self.reporter.report_state(state, reason)
            except Exception:  # the contract says it never raises; never let it kill us
                log.exception("kvpool: reporting state %r failed", state)

    # ---- transitions ---------------------------------------------------------------
    def sleep(self, reason: str = "operator") -> bool:
        """Release everything; True once asleep (also when it already was), False when
        refused because requests run (nothing released then) or the release failed.
        Blocks for the release (seconds); never call it on the engine's step thread."""
        with self._transition:
            with self._cond:
                if self._state == ASLEEP:
                    return True
                if self._active or self.target.busy():
                    self.refusals += 1
                    log.info("kvpool: sleep (%s) refused: %d request(s) running", reason,
                             self._active)
                    return False
                self._state = FALLING_ASLEEP  # requests arriving now wait, then wake it
            try:
                self.target.release_all()
            except SleepRefused as e:
                self._set(AWAKE)
                self.refusals += 1
                log.info("kvpool: sleep (%s) refused: %s", reason, e)
                return False
            except Exception as e:
                log.exception("kvpool: sleep (%s) failed while releasing", reason)
                self.last_error = _one_line(e)
                self._set(ASLEEP)  # partly released: restore it all (or the next wake will)
                self._wake_locked("after a failed sleep")
                ok = False
            else:
                ok = True
                self.sleeps += 1
                self.sleeps_by_reason[reason] = self.sleeps_by_reason.get(reason, 0) + 1
                with self._cond:
                    self._engine_busy = False  # asleep: no work, whatever was reported
                self._set(ASLEEP)
                log.warning("kvpool: asleep (%s): what it held is back in the pool", reason)
        self.report(reason)
        return ok

    def wake(self, reason: str = "operator") -> bool:
        """Take back what serving needs; True once awake (also when it already was),
        False when the memory did not come (``last_error`` says why; still asleep)."""
        with self._transition:
            ok = self._wake_locked(reason)
        self.report(reason)
        return ok

    def _wake_locked(self, reason: str) -> bool:
        """(``_transition`` held) The wake itself."""
        with self._cond:
            if self._state == AWAKE:
                return True
            self._state = WAKING
        t0 = time.monotonic()
        try:
            self.target.restore()
        except Exception as e:
            self.last_error = _one_line(e)
            self._set(ASLEEP)
            log.warning("kvpool: wake (%s) failed: %s", reason, self.last_error)
            return False
        self.wakes += 1
        with self._cond:
            self._state = AWAKE
            self._idle_since = time.monotonic()
            self._cond.notify_all()
        log.warning("kvpool: awake (%s) in %.3f s", reason, time.monotonic() - t0)
        return True

    def _set(self, state: str) -> None:
        with self._cond:
            self._state = state
            self._idle_since = time.monotonic()
            self._cond.notify_all()

    # ---- requests ------------------------------------------------------------------
    def _try_admit(self) -> bool | None:
        """Admit one request if awake: True (the first: report busy), False (not the
        first); None when not awake."""
        with self._cond:
            if self._state != AWAKE:
                return None
            self._active += 1
            return self._active == 1

    def _wake_for_requests(self) -> concurrent.futures.Future[bool]:
        """The wake the waiting requests share (started on a thread of its own by the
        first of them; it waits for a sleep under way to end first)."""
        with self._cond:
            fut = self._pending
            if fut is None:
                fut = self._pending = concurrent.futures.Future()
                threading.Thread(target=self._run_wake, args=(fut,), daemon=True,
                                 name="kvpool-wake").start()
            return fut

    def _run_wake(self, fut: concurrent.futures.Future[bool]) -> None:
        try:
            ok = self.wake("request")
        except BaseException as e:  # never leave the waiters hanging
            self.last_error = _one_line(e)
            ok = False
        with self._cond:
            self._pending = None
            self._cond.notify_all()
        fut.set_result(ok)

    def _wake_timed_out(self) -> WakeFailed:
        return WakeFailed(f"the model is asleep and did not wake within "
                          f"{self.wake_wait_s:g} s")

    async def enter(self) -> None:
        """Admit one request (asyncio): at once when awake; else wake the engine first
        (every waiting request shares one wake). Raises :class:`WakeFailed` (one line)
        when the wake cannot get its memory in time. Pair with :meth:`leave`."""
        deadline = time.monotonic() + self.wake_wait_s
        while True:
            first = self._try_admit()
            if first is not None:
                break
            wrapped = asyncio.wrap_future(self._wake_for_requests())
            try:  # shield: a cancelled request never cancels the wake the others share
                ok = await asyncio.wait_for(asyncio.shield(wrapped),
                                            max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise self._wake_timed_out() from None
            if not ok:
                raise WakeFailed(f"the model is asleep and cannot wake: {self.last_error}")
        if first:
            self.report()

    def enter_blocking(self) -> None:
        """:meth:`enter` for a thread (blocks during the wake)."""
        deadline = time.monotonic() + self.wake_wait_s
        while True:
            first = self._try_admit()
            if first is not None:
                break
            try:
                ok = self._wake_for_requests().result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                raise self._wake_timed_out() from None
            if not ok:
                raise WakeFailed(f"the model is asleep and cannot wake: {self.last_error}")
        if first:
            self.report()

    def leave(self) -> None:
        """One admitted request ended (however it ended)."""
        with self._cond:
            if self._active <= 0:
                raise RuntimeError("leave() without enter()")
            self._active -= 1
            last = self._active == 0
            if last:
                self._idle_since = time.monotonic()
                self._cond.notify_all()
        if last:
            self.report()

    def note_work(self, busy: bool) -> None:
        """The engine says whether it has work (for engines whose requests do not come
        through :meth:`enter`, e.g. vLLM's engine core between steps): for the reports
        and the idle timer (a sleep asks :meth:`SleepTarget.busy`). Cheap when
        unchanged."""
        if busy == self._engine_busy:  # a plain read: only this caller writes it
            return
        with self._cond:
            self._engine_busy = busy
            if not busy:
                self._idle_since = time.monotonic()
                self._cond.notify_all()
        self.report()

    # ---- idle timer ------------------------------------------------------------------
    def start(self) -> None:
        """Report the initial state; start the idle timer (with ``sleep_after_s``; once)."""
        self.report()
        if self.sleep_after_s is None or self._timer is not None:
            return
        self._timer = threading.Thread(target=self._idle_loop, daemon=True,
                                       name="kvpool-sleep-after")
        self._timer.start()

    def close(self) -> None:
        """End the idle timer (joined unless called from it). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        t, self._timer = self._timer, None
        if t is not None and t is not threading.current_thread():
            t.join()

    def _idle_loop(self) -> None:
        after = self.sleep_after_s
        assert after is not None
        while True:
            with self._cond:
                if self._closed:
                    return
                if (self._state != AWAKE or self._active or self._engine_busy
                        or self._pending is not None):
                    self._cond.wait()  # every change that could make it idle notifies
                    continue
                due = self._idle_since + after - time.monotonic()
                if due > 0:
                    self._cond.wait(due)
                    continue
            if not self.sleep("idle"):
                with self._cond:  # refused (work came): a full period from now again
                    self._idle_since = time.monotonic()


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
