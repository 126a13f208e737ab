"""Issue 9 (7): the daemon decides what a session kind may do. Monitor and admin
sessions hold no memory (no group, grant, lease or adopt), so nothing they could hold
hides from ``ps``, from reclaim or from ``check``; the memory they asked for stays free
for the tenants that appear in ``ps``."""

from __future__ import annotations

import pytest

from kvpool import protocol as p

from .helpers import PAGE
from .policy_helpers import code, session, stats


@pytest.mark.parametrize("kind", ["monitor", "admin"])
def test_monitor_and_admin_sessions_hold_no_memory(start_daemon, kind):
    d = start_daemon(budget=str(16 * PAGE))
    sneaky = session(d, "sneaky", kind=kind, min=16 * PAGE)
    try:
        assert code(lambda: sneaky.call(p.CreateGroup(n_regions=1, capacity=16 * PAGE))) \
            == p.UNAUTHORIZED
        assert code(lambda: sneaky.call(p.Lease(bytes=16 * PAGE))) == p.UNAUTHORIZED
        assert code(lambda: sneaky.call(p.Adopt(lease=PAGE))) == p.UNAUTHORIZED
        s = stats(d)
        assert s.pool.granted == 0 and s.pool.leased == 0, s.pool
        # the whole budget is still there for a tenant ps shows, min included
        honest = session(d, "honest", min=16 * PAGE)
        try:
            reply, _ = honest.call(p.CreateGroup(n_regions=1, capacity=16 * PAGE))
            _, fds = honest.call(p.Grant(group=reply.group, units=list(range(16))))
            assert len(fds) == 16
            for fd in fds:
                __import__("os").close(fd)
            names = [t.name for t in stats(d).tenants]
            assert names == ["honest"], names
        finally:
            honest.close()
        assert d.check() == []
    finally:
        sneaky.close()
