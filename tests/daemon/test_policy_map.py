"""Issue 9 (3c): ``map``/``ps`` replies are bounded and need a registered session. Page
tables travel run-length encoded, so a huge, nearly empty group costs a few bytes; a
map of many groups comes in pages (``next``), which :meth:`Monitor.map` joins."""

from __future__ import annotations

import os

import pytest
import zmq

from kvpool import paths
from kvpool import protocol as p

from .helpers import PAGE
from .policy_helpers import session


@pytest.mark.parametrize("op", ["map", "ps", "stats", "check"])
def test_read_only_ops_need_a_registered_session(daemon, op):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(paths.control_endpoint(daemon.run_dir))
    unregistered = session(daemon, None)
    try:
        for token in ("", unregistered.token):
            sock.send(p.encode({"op": op, "id": 5, "token": token}))
            assert sock.poll(10000), "no reply"
            reply = p.decode_reply(sock.recv())
            assert isinstance(reply, p.Error) and reply.code == p.UNAUTHORIZED, reply
        sock.send(p.encode(p.Ping(id=6)))  # ping stays open
        assert sock.poll(10000) and isinstance(p.decode_reply(sock.recv()), p.Done)
    finally:
        unregistered.close()
        sock.close()
    with daemon.monitor() as m:  # a monitor session gets them
        assert m.map().groups == [] and m.check() == []


def test_a_huge_empty_group_costs_a_few_bytes_in_the_map(start_daemon):
    d = start_daemon(budget=str(16 * PAGE))
    t = session(d, "wide")
    try:
        vpages = 1 << 20  # the default per-tenant cap on virtual pages
        g = t.call(p.CreateGroup(n_regions=1, capacity=vpages * PAGE, bases=[1 << 40]))[0].group
        _, fds = t.call(p.Grant(group=g, units=[0, 1, 2, vpages - 1], reserve=[2]))
        for fd in fds:
            os.close(fd)
        with d.monitor() as m:
            reply = m.call(p.MapReq())
        assert len(p.encode(reply)) < 4096, len(p.encode(reply))
        (info,) = reply.groups
        assert [tuple(r) for r in map(lambda r: (r.start, r.length, r.reserve), info.runs)] == \
            [(0, 2, False), (2, 1, True), (vpages - 1, 1, False)]
        assert info.cells(0, 4) == "##+." and info.cells(vpages - 2) == ".#"
        assert (info.in_use_units, info.reserve_units) == (3, 1)
    finally:
        t.close()


def test_a_map_of_many_groups_comes_in_pages(start_daemon):
    d = start_daemon(budget=str(16 * PAGE))
    tenants = [session(d, f"t{i}") for i in range(3)]
    try:
        ids = [c.call(p.CreateGroup(n_regions=1, capacity=PAGE, label=f"g{j}"))[0].group
               for c in tenants for j in range(10)]
        with d.monitor() as m:
            first = m.call(p.MapReq(limit=7))
            assert [g.id for g in first.groups] == sorted(ids)[:7]
            assert first.next == sorted(ids)[6] and first.truncated == 23
            whole = m.map()
            assert [g.id for g in whole.groups] == sorted(ids)
            assert [g.id for g in m.map("t1").groups] == sorted(ids[10:20])
    finally:
        for c in tenants:
            c.close()
