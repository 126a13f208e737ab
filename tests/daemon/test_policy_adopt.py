"""Issue 9 (2): Adopt belongs to recovery. Outside it, or from a pid the previous daemon
did not record, or with anything that does not add up (units, group ids, budget, the
tenant's limit), it is refused with no effect: no page, lease or group id changes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpool import protocol as p

from .helpers import PAGE, REPO
from .policy_helpers import adopt, code, memfds, restart, session, stats

BUDGET = 8  # pages


def _closed(fds):
    for fd in fds:
        os.close(fd)


def _nothing_adopted(d) -> None:
    s = stats(d)
    assert s.pool.granted == 0 and s.pool.leased == 0, s.pool
    assert d.check() == []


def test_adopt_outside_recovery_is_refused_without_effect(start_daemon):
    d = start_daemon(budget=str(BUDGET * PAGE))
    conn = session(d)
    fds = memfds(2, PAGE)
    try:
        group = p.AdoptGroup(id=7, n_regions=1, capacity=4 * PAGE, units=[0, 1])
        assert code(lambda: adopt(conn, [group], fds)) == p.UNAUTHORIZED
        assert code(lambda: adopt(conn, [], [], lease=1 << 50)) == p.UNAUTHORIZED
        assert code(lambda: adopt(conn, [p.AdoptGroup(id=p.MAX_ID, n_regions=1,
                                                      capacity=PAGE)], [])) == p.UNAUTHORIZED
        _nothing_adopted(d)
        # group ids are untouched: the next group is a small id, and it works
        reply, _ = conn.call(p.CreateGroup(n_regions=1, capacity=2 * PAGE))
        assert reply.group < 1 << 31
        reply, fds2 = conn.call(p.Grant(group=reply.group, units=[0]))
        _closed(fds2)
    finally:
        _closed(fds)
        conn.close()


def _recovering(start_daemon, tmp_path):
    """A daemon restarted while this test process was its tenant: it is recovering and
    waits (a long time) for this pid to adopt."""
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text("recover_timeout_s = 120\n")
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--config", str(cfg)))
    before = session(d, "returning")
    for _ in range(4):  # group ids 1..4 were handed out by the previous daemon
        before.call(p.CreateGroup(n_regions=1, capacity=PAGE))
    restart(d, os.getpid(), next_group=5)
    before.close()
    assert stats(d).pool.recovering
    return d


@pytest.mark.parametrize("case", ["huge_lease", "huge_group_id", "taken_group_id",
                                  "duplicate_units", "over_budget", "unit_outside",
                                  "lease_plus_pages_over_budget", "fds_missing"])
def test_bad_adopt_during_recovery_is_refused_without_effect(start_daemon, tmp_path, case):
    d = _recovering(start_daemon, tmp_path)
    conn = session(d, "returning")
    g = lambda id=3, units=(0, 1), cap=4: p.AdoptGroup(id=id, n_regions=1, capacity=cap * PAGE,
                                                       units=list(units))
    n, lease, groups, nfds = 2, 0, [g()], None
    if case == "huge_lease":
        n, groups, lease = 0, [], 1 << 50
    elif case == "huge_group_id":
        groups = [g(id=p.MAX_ID)]
    elif case == "taken_group_id":
        groups = [g(id=3), g(id=3, units=(2, 3))]
        n = 4
    elif case == "duplicate_units":
        groups = [g(units=(1, 1))]
    elif case == "over_budget":  # (more descriptors than the budget: the server hangs up)
        n, groups, lease = BUDGET, [g(units=range(BUDGET), cap=BUDGET)], PAGE
    elif case == "unit_outside":
        groups = [g(units=(0, 4))]
    elif case == "lease_plus_pages_over_budget":
        lease = (BUDGET - 1) * PAGE
    elif case == "fds_missing":
        n, nfds = 1, 2
    fds = memfds(n, PAGE)
    try:
        got = code(lambda: adopt(conn, groups, fds, lease=lease, nfds=nfds))
        assert got in (p.BAD_REQUEST, p.UNAUTHORIZED), got
        assert stats(d).pool.recovering  # still waiting: the failed adopt changed nothing
        _nothing_adopted(d)
        # all or nothing: a correct adopt on the same session still works afterwards
        fds2 = memfds(2, PAGE)
        try:
            reply = adopt(conn, [g()], fds2)
        finally:
            _closed(fds2)
        assert reply.pages == 2, reply
        s = stats(d)
        assert s.pool.granted == 2 * PAGE and not s.pool.recovering
        assert d.check() == []
        # and later groups get ordinary ids
        created, _ = conn.call(p.CreateGroup(n_regions=1, capacity=PAGE))
        assert created.group < 1 << 31 and created.group != 3
    finally:
        _closed(fds)
        conn.close()


ADOPT_FROM_STRANGER = """
import json, sys
from kvpool import protocol as p
from kvpool.client_lib.connection import Connection
from kvpool.client_lib.errors import KvpoolError
c = Connection(__import__("pathlib").Path(sys.argv[1]), timeout_s=20)
c.call(p.Register(name=sys.argv[2], kind=sys.argv[3]))
try:
    c.call(p.Adopt(lease=int(sys.argv[4])))
    print("ok")
except KvpoolError as e:
    print(e.code)
c.close()
"""


@pytest.mark.parametrize("kind", ["engine", "monitor"])
def test_adopt_from_a_pid_the_previous_daemon_did_not_record_is_refused(start_daemon, tmp_path,
                                                                        kind):
    d = _recovering(start_daemon, tmp_path)
    out = subprocess.run([sys.executable, "-c", ADOPT_FROM_STRANGER, str(d.run_dir), "stranger",
                          kind, str(PAGE)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.stdout.strip() == p.UNAUTHORIZED, out
    s = stats(d)
    assert s.pool.leased == 0 and s.pool.recovering
    assert d.check() == []


def test_a_second_adopt_of_the_same_pid_is_refused(start_daemon, tmp_path):
    d = _recovering(start_daemon, tmp_path)
    first = session(d, "returning")
    fds = memfds(1, PAGE)
    try:
        reply = adopt(first, [p.AdoptGroup(id=2, n_regions=1, capacity=2 * PAGE, units=[0])], fds)
        assert reply.pages == 1
        second = session(d, "returning2")
        try:
            assert code(lambda: adopt(second, [], [], lease=PAGE)) == p.UNAUTHORIZED
        finally:
            second.close()
        s = stats(d)
        assert s.pool.granted == PAGE and s.pool.leased == 0
        assert d.check() == []
    finally:
        _closed(fds)
        first.close()


def test_adopt_from_a_reused_pid_of_another_uid_is_refused(start_daemon, tmp_path):
    """The previous daemon recorded (pid, uid): the same pid under another uid is a
    stranger that got a dead tenant's pid, not the tenant."""
    import json

    cfg = tmp_path / "kvpool.toml"
    cfg.write_text("recover_timeout_s = 120\n")
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--config", str(cfg)))
    before = session(d, "returning")
    state = d.run_dir / "state.json"

    def other_uid():
        saved = json.loads(state.read_text())
        assert [t["uid"] for t in saved["tenants"]] == [os.getuid()]
        for t in saved["tenants"]:
            t["uid"] = os.getuid() + 4242
        state.write_text(json.dumps(saved))

    restart(d, os.getpid(), between=other_uid)
    before.close()
    conn = session(d, "returning2")
    try:
        assert code(lambda: adopt(conn, [], [], lease=PAGE)) == p.UNAUTHORIZED
        assert stats(d).pool.leased == 0
    finally:
        conn.close()


def test_tenants_come_back_after_a_clean_stop(start_daemon):
    """``kvpool stop`` leaves tenants their mapped pages, so the next daemon recovers them
    as after a crash: Adopt being recovery-only must not strand them."""
    import time

    from .helpers import read_event, respawn

    d = start_daemon(budget=str(64 * PAGE))
    holder = d.worker("hold", "--name", "h0", "--units", "6")
    pages = read_event(holder, "ready")["pages"]
    before = {t.name: t.mapped for t in stats(d).tenants}
    assert before == {"h0": pages * PAGE}, before
    d.cli("stop")
    assert d.proc.wait(30) == 0
    respawn(d)
    deadline = time.monotonic() + 30
    while True:
        try:
            after = {t.name: t.mapped for t in stats(d).tenants}
        except Exception:  # noqa: BLE001 - the new daemon may not answer yet
            after = {}
        if after == before:
            break
        assert time.monotonic() < deadline, (after, d.logs()[-2000:])
        time.sleep(0.1)
    assert holder.poll() is None and d.check() == []
