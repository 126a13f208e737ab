"""Issue 9 (11): no head-of-line blocking. While one tenant waits for reclaim from a
tenant that never answers, another tenant's grant that fits in free memory (and within
its fair share) is served at once, not queued behind the waiter; the waiter is still
served first from what reclaim frees."""

from __future__ import annotations

import os
import threading
import time

from kvpool import protocol as p

from .helpers import PAGE
from .policy_helpers import session, stats

BUDGET = 16


def _grant(conn, group, units):
    reply, fds = conn.call(p.Grant(group=group, units=units))
    for fd in fds:
        os.close(fd)
    return reply


def test_a_grant_that_fits_is_not_queued_behind_one_that_does_not(start_daemon):
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--warm-max", "0",
                                                       "--reclaim-timeout", "120"))
    stopped = session(d, "stopped")  # a raw session: never answers a reclaim
    other = session(d, "other")
    waiter = session(d, "waiter")
    conns = (stopped, other, waiter)
    try:
        gs, go, gw = (c.call(p.CreateGroup(n_regions=1, capacity=BUDGET * PAGE))[0].group
                      for c in conns)
        _grant(stopped, gs, list(range(12)))
        _grant(other, go, [0, 1, 2, 3])  # the budget is full
        result: dict = {}

        def wait_for_pages():
            try:
                result["reply"] = _grant(waiter, gw, [0, 1, 2, 3])
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                result["error"] = e

        th = threading.Thread(target=wait_for_pages)
        th.start()
        deadline = time.monotonic() + 20
        while not any(t.waiting for t in stats(d).tenants if t.name == "waiter"):
            assert time.monotonic() < deadline, "the grant never waited"
            time.sleep(0.02)
        # the other tenant gives back a page and takes it again: it fits, it is served
        other.call(p.Release(group=go, units=[3]))
        reply = _grant(other, go, [3])
        assert isinstance(reply, p.Granted) and reply.units == [3]
        (w,) = [t for t in stats(d).tenants if t.name == "waiter"]
        assert w.waiting == 4 * PAGE and "reply" not in result  # still waiting, unharmed
        # the stopped tenant goes: the waiter gets its pages
        stopped.call(p.Bye())
        th.join(60)
        assert isinstance(result.get("reply"), p.Granted), result
        assert d.check() == []
    finally:
        for c in conns:
            c.close()
