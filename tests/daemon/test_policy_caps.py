"""Issue 9 (6): per-uid and global session caps, and per-tenant caps on groups and on
virtual pages, each with a clear refusal; what a refused peer held is untouched, and a
freed slot can be used again."""

from __future__ import annotations

import time

import pytest

from kvpool import protocol as p
from kvpool.client_lib.errors import KvpoolError

from .policy_helpers import code, session, stats
from .helpers import PAGE


def _daemon(start_daemon, tmp_path, **caps):
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text("".join(f"{k} = {v}\n" for k, v in caps.items()))
    return start_daemon(budget=str(16 * PAGE), extra=("--config", str(cfg)))


@pytest.mark.parametrize("caps", [{"max_sessions_per_uid": 3, "max_sessions": 100},
                                  {"max_sessions_per_uid": 100, "max_sessions": 3}])
def test_sessions_past_a_cap_are_refused_clearly(start_daemon, tmp_path, caps):
    d = _daemon(start_daemon, tmp_path, **caps)
    held = [session(d, None) for _ in range(3)]
    try:
        with pytest.raises(KvpoolError) as e:
            session(d, None)
        assert e.value.code == p.OVER_LIMIT and "sessions" in e.value.message, e.value
        held.pop().close()
        deadline = time.monotonic() + 20
        while True:  # a freed slot is usable again (once the daemon has seen the EOF)
            try:
                again = session(d, "late")
                break
            except KvpoolError:
                assert time.monotonic() < deadline, "the freed session slot never came back"
                time.sleep(0.02)
        held.append(again)
        assert again.token
    finally:
        for c in held:
            c.close()
    assert d.proc.poll() is None


def test_groups_and_virtual_pages_per_tenant_are_capped(start_daemon, tmp_path):
    d = _daemon(start_daemon, tmp_path, max_groups_per_tenant=3,
                max_virtual_pages_per_tenant=100)
    t = session(d, "greedy")
    try:
        create = lambda n, c: t.call(p.CreateGroup(n_regions=n, capacity=c * PAGE))[0]
        g1 = create(2, 40)  # 80 virtual pages
        assert code(lambda: create(1, 21)) == p.OVER_LIMIT  # 101 > 100
        create(1, 20)  # exactly 100
        t.call(p.DestroyGroup(group=g1.group))  # frees 80
        create(1, 10)
        create(1, 10)
        assert code(lambda: create(1, 1)) == p.OVER_LIMIT  # a 4th group
        s = stats(d)
        (info,) = [x for x in s.tenants if x.name == "greedy"]
        assert info.groups == 3
    finally:
        t.close()
    assert d.check() == []
