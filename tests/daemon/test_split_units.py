"""Units the daemon's split makes testable without a daemon process: the restart
state (``restart.py``), recovery as the arbiter applies it, the map view's paging
(``views.py``), the fd-queue bound from the config, and ``kvpool.limits``."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from kvpool import protocol as p
from kvpool.daemon import fdqueue
from kvpool.daemon.config import Config
from kvpool.daemon.restart import Recovery, StateFile, live_tenants
from kvpool.limits import raise_fd_limit

PAGE = 64 << 10


def test_recovery_ends_when_everyone_is_back_or_time_is_up():
    r = Recovery()
    r.begin({10, 11}, {"a": 10, "b": 11}, {10: 5}, until=100.0)
    assert r.active and r.is_expected(10, 5) and not r.is_expected(10, 6)
    assert r.is_expected(11, 7)  # no uid recorded: any uid
    assert not r.finish_if_done(50.0)
    r.returned(10)
    assert not r.is_expected(10, 5) and r.active
    r.returned(11)
    assert r.finish_if_done(50.0) and not r.active
    assert not r.finish_if_done(50.0)  # ends once
    r.begin({12}, {}, {}, until=100.0)
    assert not r.finish_if_done(99.9) and r.finish_if_done(100.0)


def test_names_are_kept_only_for_their_own_pid_and_uid_while_recovering():
    r = Recovery()
    r.begin({10}, {"a": 10}, {10: 5}, until=100.0)
    assert r.keeper_of("a", 99, 5) == 10
    assert r.keeper_of("a", 10, 6) == 10  # the pid came back under another uid
    assert r.keeper_of("a", 10, 5) is None
    assert r.keeper_of("b", 99, 5) is None
    r.returned(10)
    assert r.keeper_of("a", 99, 5) is None


def test_state_file_round_trip_and_garbage(tmp_path):
    sf = StateFile(tmp_path)
    assert sf.load() is None
    sf.save(7, [])
    assert sf.load() == {"next_group": 7, "tenants": []}
    assert (os.stat(sf.path).st_mode & 0o777) & 0o007 == 0  # not readable by others
    sf.path.write_text("not json")
    assert sf.load() is None
    sf.path.write_text("[1, 2]")
    assert sf.load() is None  # not an object
    sf.remove()
    assert not sf.path.exists()
    sf.remove()  # gone already: no error


def test_live_tenants_skip_dead_pids_and_this_process():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        state = {"tenants": [
            {"pid": live.pid, "uid": 3, "name": "live"},
            {"pid": dead.pid, "uid": 4, "name": "dead"},
            {"pid": os.getpid(), "uid": 5, "name": "me"},
            {"pid": 0, "name": "zero"},
        ]}
        pids, names, uids = live_tenants(json.loads(json.dumps(state)))
        assert pids == {live.pid} and names == {"live": live.pid} and uids == {live.pid: 3}
    finally:
        live.kill()
        live.wait()


def test_begin_recovery_refuses_grants_then_ends_and_continues_group_ids(arb):
    mine = os.getpid() + 1  # any pid: the arbiter does not look at /proc
    arb.begin_recovery({mine}, {"old": mine}, {mine: 0}, next_group=40,
                       until=time.monotonic() + 60)
    assert arb.recovering and arb.pool_info().recovering
    other, _, out = arb.register("old", pid=mine + 1)
    assert out.reply.code == p.UNAUTHORIZED  # the name is kept for its pid
    t, ident = arb.tenant("new")
    g = arb.handle(ident, p.CreateGroup(id=2, token=t.token, n_regions=1, capacity=4 * PAGE))
    assert g.reply.group == 40
    out = arb.handle(ident, p.Grant(id=3, token=t.token, group=40, units=[0]))
    assert out.reply.code == p.BUSY
    assert arb.next_deadline() is not None
    assert arb.tick(now=time.monotonic() + 61) == [] and not arb.recovering
    out = arb.handle(ident, p.Grant(id=4, token=t.token, group=40, units=[0]))
    assert isinstance(out.reply, p.Granted) and len(out.pfns_to_send) == 1
    assert arb.check_integrity() == []


def test_an_empty_recovery_changes_only_the_group_ids(arb):
    arb.begin_recovery(set(), {}, {}, next_group=9, until=time.monotonic() + 60)
    assert not arb.recovering and arb.next_group == 9
    arb.begin_recovery(set(), {}, {}, next_group=3, until=time.monotonic() + 60)
    assert arb.next_group == 9  # never goes back


def test_map_pages_its_reply_by_limit(arb):
    t, ident = arb.tenant("a")
    ids = [arb.handle(ident, p.CreateGroup(id=2 + i, token=t.token, n_regions=1,
                                           capacity=4 * PAGE)).reply.group for i in range(5)]
    arb.handle(ident, p.Grant(id=9, token=t.token, group=ids[1], units=[0, 1, 3]))
    seen, after = [], 0
    while True:
        r = arb.handle(ident, p.MapReq(id=10, token=t.token, after=after, limit=2)).reply
        assert isinstance(r, p.MapReply) and len(r.groups) <= 2
        seen += [g.id for g in r.groups]
        if r.next is None:
            break
        assert r.truncated == len(ids) - len(seen)
        after = r.next
    assert seen == ids
    g1 = arb.handle(ident, p.MapReq(id=11, token=t.token, after=ids[0], limit=1)).reply.groups[0]
    assert g1.id == ids[1] and g1.cells() == "##.#"


def test_ps_leaves_out_monitors_that_hold_nothing(arb):
    arb.tenant("watch", kind="monitor")
    t, ident = arb.tenant("eng")
    r = arb.handle(ident, p.Ps(id=2, token=t.token)).reply
    assert [x.name for x in r.tenants] == ["eng"]


def test_the_fd_queue_bound_comes_from_the_config():
    q = fdqueue.Outbound(limit=Config(max_queued_fds=3).max_queued_fds)
    q.push_fds(b"h", [1, 2, 3])
    assert not q.overflowing
    q.push_fds(b"h", [4])
    assert q.overflowing
    q.pop()
    assert not q.overflowing and q.fds == 1


def test_raise_fd_limit_never_passes_the_hard_limit_nor_lowers():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if soft > 64:
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        assert raise_fd_limit(32) == min(soft, 64)  # never lowered
        if hard > 64:
            assert raise_fd_limit(65) == 65
        assert raise_fd_limit() == hard
        assert raise_fd_limit(hard + 10) == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
