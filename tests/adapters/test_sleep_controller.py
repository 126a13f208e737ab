"""SleepController (kvpool.engine_adapters.sleep_controller) against a fake engine target and a
fake tenant (B's ``report_state``): transitions, refusal while busy, wake on request,
the idle timer, failures. No daemon, no engine: each test takes milliseconds — except
the last, which puts the controller behind a real tenant of a real daemon (what ``ps``
shows after the daemon's asks)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvpool.engine_adapters.sleep_controller import (AWAKE, ASLEEP, FALLING_ASLEEP, SleepController,
                                          SleepRefused, WakeFailed)

DEADLINE_S = 20.0


class FakeTarget:
    def __init__(self) -> None:
        self.released = self.restored = 0
        self.work = False
        self.refuse_inside = False
        self.fail_release: Exception | None = None
        self.fail_restore: Exception | None = None
        self.hold_release: threading.Event | None = None  # release_all waits for it
        self.hold_restore: threading.Event | None = None
        self.in_release = threading.Event()
        self.holding = False  # what the engine holds: True awake

    def busy(self) -> bool:
        return self.work

    def release_all(self) -> None:
        self.in_release.set()
        if self.hold_release is not None:
            assert self.hold_release.wait(DEADLINE_S)
        if self.refuse_inside:
            raise SleepRefused("a request came in")
        if self.fail_release is not None:
            raise self.fail_release
        self.released += 1
        self.holding = False

    def restore(self) -> None:
        if self.hold_restore is not None:
            assert self.hold_restore.wait(DEADLINE_S)
        if self.fail_restore is not None:
            raise self.fail_restore
        self.restored += 1
        self.holding = True


class FakeTenant:
    """B's Tenant.report_state: records every change."""

    def __init__(self) -> None:
        self.states: list[str] = []
        self.changed = threading.Condition()

    def report_state(self, state: str, reason: str | None = None) -> None:
        with self.changed:
            if not self.states or self.states[-1] != state:
                self.states.append(state)
            self.changed.notify_all()

    def wait_for(self, state: str) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.states[-1:] == [state], DEADLINE_S), \
                self.states


def make(**kw: object) -> tuple[SleepController, FakeTarget, FakeTenant]:
    t, r = FakeTarget(), FakeTenant()
    c = SleepController(t, r, **kw)  # type: ignore[arg-type]
    c.start()
    return c, t, r


def test_sleep_and_wake_report_states() -> None:
    c, t, r = make()
    assert r.states == ["idle"] and c.state == AWAKE and not c.is_sleeping
    assert c.sleep("operator") and c.state == ASLEEP and c.is_sleeping
    assert t.released == 1 and r.states == ["idle", "asleep"]
    assert c.sleep("again")  # already asleep: nothing more released
    assert t.released == 1
    assert c.wake("operator") and c.state == AWAKE and t.restored == 1
    assert r.states == ["idle", "asleep", "idle"]
    assert c.wake("again") and t.restored == 1
    c.close()


def test_sleep_is_refused_while_a_request_runs() -> None:
    c, t, r = make()
    c.enter_blocking()
    assert r.states[-1] == "busy"
    assert not c.sleep("operator") and c.refusals == 1 and t.released == 0
    assert c.state == AWAKE
    c.leave()
    assert r.states[-1] == "idle"
    assert c.sleep("operator")
    with pytest.raises(RuntimeError):
        c.leave()  # unpaired
    c.close()


def test_sleep_is_refused_when_the_engine_has_work() -> None:
    c, t, _ = make()
    t.work = True
    assert not c.sleep("pressure") and t.released == 0
    t.work = False
    t.refuse_inside = True  # the target finds work under its own lock
    assert not c.sleep("pressure") and c.state == AWAKE and t.restored == 0
    t.refuse_inside = False
    assert c.sleep("pressure")
    c.close()


def test_a_failed_release_restores() -> None:
    c, t, _ = make()
    t.fail_release = OSError("daemon went away")
    assert not c.sleep("operator")
    assert t.restored == 1 and c.state == AWAKE
    c.close()


def test_a_request_wakes_a_sleeping_engine_once_for_all() -> None:
    c, t, r = make()
    assert c.sleep("operator")
    t.hold_restore = threading.Event()

    async def many() -> None:
        tasks = [asyncio.create_task(c.enter()) for _ in range(5)]
        await asyncio.sleep(0)
        t.hold_restore.set()  # type: ignore[union-attr]
        await asyncio.gather(*tasks)
        assert c.active == 5 and r.states[-1] == "busy"
        for _ in range(5):
            c.leave()

    asyncio.run(asyncio.wait_for(many(), DEADLINE_S))
    assert t.restored == 1 and c.wakes == 1 and c.state == AWAKE
    assert r.states == ["idle", "asleep", "idle", "busy", "idle"]
    c.close()


def test_a_request_that_cannot_wake_gets_one_line() -> None:
    c, t, _ = make()
    assert c.sleep("operator")
    t.fail_restore = RuntimeError("NO_MEMORY: the pool is full\nsecond line")
    with pytest.raises(WakeFailed, match="cannot wake: NO_MEMORY: the pool is full$"):
        asyncio.run(c.enter())
    assert c.state == ASLEEP and c.active == 0
    with pytest.raises(WakeFailed):
        c.enter_blocking()
    t.fail_restore = None  # memory came back: the next request is served
    c.enter_blocking()
    assert c.state == AWAKE
    c.leave()
    c.close()


def test_a_wake_past_its_deadline_fails_the_request_not_the_wake() -> None:
    c, t, _ = make(wake_wait_s=0.05)
    assert c.sleep("operator")
    t.hold_restore = threading.Event()
    with pytest.raises(WakeFailed, match="did not wake within"):
        asyncio.run(c.enter())
    t.hold_restore.set()  # the wake itself goes on and ends awake
    c.enter_blocking()
    assert c.state == AWAKE and t.restored == 1
    c.leave()
    c.close()


def test_a_request_during_falling_asleep_waits_then_wakes() -> None:
    c, t, _ = make()
    t.hold_release = threading.Event()
    sleeper = threading.Thread(target=c.sleep, args=("operator",))
    sleeper.start()
    assert t.in_release.wait(DEADLINE_S)
    assert c.state == FALLING_ASLEEP
    got: list[str] = []
    req = threading.Thread(target=lambda: (c.enter_blocking(), got.append(c.state)))
    req.start()
    t.hold_release.set()
    sleeper.join(DEADLINE_S)
    req.join(DEADLINE_S)
    assert got == [AWAKE] and t.released == 1 and t.restored == 1 and c.active == 1
    c.leave()
    c.close()


def test_idle_timer_puts_an_idle_engine_to_sleep() -> None:
    c, t, r = make(sleep_after_s=0.05)
    r.wait_for("asleep")
    assert t.released == 1
    c.enter_blocking()  # woken by a request; not put to sleep while it runs
    time.sleep(0.2)  # four idle periods: a negative check, it can only pass wrongly
    assert c.state == AWAKE and t.released == 1
    c.leave()
    r.wait_for("asleep")
    assert t.released == 2
    c.close()


def test_reported_work_is_busy_for_the_tenant_and_the_timer() -> None:
    t, r = FakeTarget(), FakeTenant()
    c = SleepController(t, r, sleep_after_s=0.05)
    c.note_work(True)  # before the timer starts
    c.start()
    assert r.states == ["busy"]
    time.sleep(0.2)  # four idle periods with work reported: no sleep (negative check)
    assert c.state == AWAKE and t.released == 0
    c.note_work(False)
    r.wait_for("asleep")
    c.close()


def test_bad_sleep_after_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        SleepController(FakeTarget(), None, sleep_after_s=0)


def daemon_state(d, name: str) -> str:
    with d.monitor() as m:
        return next(t.state for t in m.ps().tenants if t.name == name)


def test_a_refused_sleep_leaves_the_daemon_seeing_busy(start_daemon) -> None:
    """Issue 33 item 8: the operator's sleep, refused because a request runs, made the
    tenant say ``idle`` mid-request (``ps`` said idle; the busy server was the first
    pressure-sleep candidate). The state after an ask is the controller's own."""
    from daemon.helpers import PAGE, wait_for

    d = start_daemon()
    with d.connect("srv", timeout_s=30, sleepable=True) as srv:
        g = srv.region_group(1, 8 * PAGE)
        g.grant(range(2))
        c = SleepController(FakeTarget(), srv)
        srv.set_sleep_handler(c)
        c.start()
        assert daemon_state(d, "srv") == "idle"
        c.enter_blocking()  # a request runs
        assert daemon_state(d, "srv") == "busy"
        for ask in (("sleep", "srv", "--wait", "0.3"), ("wake", "srv", "--wait", "10")):
            handled = srv._sleep.handled
            d.cli(*ask, check=False)
            wait_for(lambda: srv._sleep.handled > handled, 30, what="the ask handled")
            assert daemon_state(d, "srv") == "busy", ask  # still serving
        assert c.state == AWAKE and c.refusals == 1
        c.leave()
        wait_for(lambda: daemon_state(d, "srv") == "idle", 30, what="idle at last")
        c.close()
    assert d.check() == []

