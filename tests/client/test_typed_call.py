"""``Connection.call(req, expect)``: the reply is the type the caller expects, or a
:class:`ProtocolError` naming both (descriptors that came with it are closed)."""

from __future__ import annotations

import os

import pytest

from kvpool import protocol as p
from kvpool.client_lib import Monitor, connect
from kvpool.client_lib.errors import KvpoolError, ProtocolError

from .conftest import PAGE


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_expected_reply_type_comes_back(run_dir):
    with Monitor(run_dir) as mon:
        done = mon.call(p.Ping(), p.Done)
        assert type(done) is p.Done
        assert isinstance(mon.ps(), p.PsReply)
        assert type(mon.call(p.Ping())) is p.Done  # no expectation: any reply


def test_another_reply_type_is_a_protocol_error(run_dir):
    with Monitor(run_dir) as mon:
        with pytest.raises(ProtocolError, match="answered Ping with Done, expected PsReply"):
            mon.call(p.Ping(), p.PsReply)
        assert isinstance(ProtocolError("x", "y"), KvpoolError)
        assert type(mon.call(p.Ping(), p.Done)) is p.Done  # the session still works


def test_a_mistyped_grant_closes_its_descriptors(run_dir):
    with connect("typed", run_dir=run_dir) as t:
        group = t.call(p.CreateGroup(n_regions=2, capacity=8 * PAGE), p.GroupCreated)[0]
        before = open_fds()
        with pytest.raises(ProtocolError, match="answered Grant with Granted"):
            t.conn.call(p.Grant(group=group.group, units=[0, 1, 2]), p.Done)
        assert open_fds() == before  # the 6 page descriptors did not leak
        reply, fds = t.conn.call(p.Grant(group=group.group, units=[3]), p.Granted)
        assert reply.units == [3] and len(fds) == 2
        for fd in fds:
            os.close(fd)
