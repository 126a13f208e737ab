"""A grant the daemon holds for reclaim is never lost between daemon and client.

The daemon may hold a grant up to its reclaim deadline (``--reclaim-timeout``), which can
be longer than a client's request timeout. Found in CI: a vLLM tenant's background grant
(10 s client timeout, 60 s reclaim deadline) gave up while the daemon held it; the daemon
granted it later, so the tenant was charged for pages it never mapped, and every later
grant of those units was refused as "already granted": its next request waited forever.

Two guarantees: the client waits as long as the daemon says it may hold a request (its
hello), and a grant answered after the client gave up anyway (an explicit short
timeout) is given back when its late reply arrives.
"""

from __future__ import annotations

import os

from kvpool import protocol as p
from kvpool.client_lib.connection import Connection
from kvpool.client_lib.errors import KvpoolError

from .helpers import PAGE, wait_for
from .policy_helpers import session, stats

BUDGET = 8


def _grant(conn: Connection, group: int, units: list[int], **kw) -> p.Reply:
    reply, fds = conn.call(p.Grant(group=group, units=units), **kw)
    for fd in fds:
        os.close(fd)
    return reply


def _tenant(d, name: str):
    return next(t for t in stats(d).tenants if t.name == name)


def test_the_client_waits_as_long_as_the_daemon_may_hold_a_grant(start_daemon):
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--warm-max", "0",
                                                       "--reclaim-timeout", "8"))
    stopped = session(d, "stopped")  # a raw session: never answers a reclaim
    waiter = Connection(d.run_dir, timeout_s=5)  # shorter than the daemon's deadline
    try:
        waiter.call(p.Register(name="waiter", kind="engine"))
        assert waiter.hello is not None and waiter.hello.hold_ms == 8000
        gs = stopped.call(p.CreateGroup(n_regions=1, capacity=BUDGET * PAGE))[0].group
        gw = waiter.call(p.CreateGroup(n_regions=1, capacity=BUDGET * PAGE))[0].group
        _grant(stopped, gs, list(range(BUDGET)))  # the budget is full
        # the daemon holds the grant to its deadline, then refuses it: the client hears
        # that refusal (NO_MEMORY), not its own "no reply" after 5 s
        try:
            _grant(waiter, gw, [0, 1])
            raise AssertionError("granted with the budget full")
        except KvpoolError as e:
            assert e.code == p.NO_MEMORY, e
        assert _tenant(d, "waiter").mapped == 0
        assert d.check() == []
    finally:
        waiter.close()
        stopped.close()


def test_a_grant_answered_after_the_client_gave_up_is_given_back(start_daemon):
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--warm-max", "0",
                                                       "--reclaim-timeout", "120"))
    stopped = session(d, "stopped")
    waiter = session(d, "waiter")
    try:
        gs = stopped.call(p.CreateGroup(n_regions=1, capacity=BUDGET * PAGE))[0].group
        gw = waiter.call(p.CreateGroup(n_regions=1, capacity=BUDGET * PAGE))[0].group
        _grant(stopped, gs, list(range(BUDGET)))
        try:
            _grant(waiter, gw, [0, 1, 2], timeout_ms=300)  # gives up; the daemon holds it
            raise AssertionError("granted with the budget full")
        except KvpoolError as e:
            assert e.code == p.BUSY, e
        wait_for(lambda: _tenant(d, "waiter").waiting == 3 * PAGE, what="the held grant")
        stopped.call(p.Bye())  # the daemon serves the held grant now, to a client gone
        wait_for(lambda: _tenant(d, "waiter").waiting == 0, what="the late grant")
        waiter.call(p.Ping())  # the late reply is read: its units go back
        # the same units can be granted again, and the daemon charges only those
        reply = _grant(waiter, gw, [0, 1])
        assert isinstance(reply, p.Granted) and reply.units == [0, 1]
        assert _tenant(d, "waiter").mapped == 2 * PAGE
        assert d.check() == []
    finally:
        waiter.close()
        stopped.close()


def test_a_tenant_gives_up_on_a_held_grant_and_nothing_is_lost(start_daemon):
    """A tenant's grant waits at most its own timeout (its thread must keep answering
    reclaims on the one connection); the grant served later goes back by itself (the
    session's thread reads the late reply) and the units can be granted again."""
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--warm-max", "0",
                                                       "--reclaim-timeout", "120"))
    stopped = session(d, "stopped")
    tenant = d.connect("waiter", timeout_s=1)
    try:
        gs = stopped.call(p.CreateGroup(n_regions=1, capacity=BUDGET * PAGE))[0].group
        _grant(stopped, gs, list(range(BUDGET)))
        group = tenant.region_group(1, BUDGET * PAGE)
        try:
            group.grant([0, 1, 2])
            raise AssertionError("granted with the budget full")
        except KvpoolError as e:
            assert e.code == p.BUSY, e
        assert _tenant(d, "waiter").waiting == 3 * PAGE  # the daemon still holds it
        stopped.call(p.Bye())
        wait_for(lambda: _tenant(d, "waiter").waiting == 0, what="the late grant")
        wait_for(lambda: _tenant(d, "waiter").mapped == 0, what="the late grant given back")
        group.grant([0, 1])
        assert group.mapped == {0, 1} and _tenant(d, "waiter").mapped == 2 * PAGE
        assert d.check() == []
    finally:
        tenant.close()
        stopped.close()
