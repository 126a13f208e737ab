"""``Room``: what the daemon would grant a tenant at once, its knobs and the pool's free
memory (the answer a server's router metrics are made of). In-process arbiter over a
16-page host pool; the request and the reply are checked as hostile input."""

from __future__ import annotations

import msgspec
import pytest

from kvpool import protocol as p

from .helpers import PAGE


def room(a, t, ident) -> p.RoomReply:
    reply = a.handle(ident, p.Room(id=9, token=t.token)).reply
    assert isinstance(reply, p.RoomReply), reply
    return reply


def test_headroom_is_what_a_grant_gets_at_once(make_arb) -> None:
    a = make_arb()
    t, ident = a.tenant("a")
    r = room(a, t, ident)
    assert (r.headroom, r.granted, r.pool_free, r.pool_budget) == (16 * PAGE, 0, 16 * PAGE,
                                                                    16 * PAGE)
    assert r.state == "awake"
    u, uident = a.tenant("b")
    assert a.handle(uident, p.Lease(id=2, token=u.token, bytes=10 * PAGE)).reply.ok
    r = room(a, t, ident)
    assert (r.headroom, r.pool_free) == (6 * PAGE, 6 * PAGE)
    gid = a.handle(ident, p.CreateGroup(id=3, token=t.token, n_regions=1,
                                        capacity=16 * PAGE)).reply.group
    out = a.handle(ident, p.Grant(id=4, token=t.token, group=gid, units=list(range(6))))
    assert isinstance(out.reply, p.Granted) and not out.deferred  # all of it, at once
    r = room(a, t, ident)
    assert (r.headroom, r.granted, r.pool_free) == (0, 6 * PAGE, 0)
    out = a.handle(ident, p.Grant(id=5, token=t.token, group=gid, units=[6]))
    assert out.reply is None or not out.reply.ok  # one more page does not come at once
    assert room(a, u, uident).granted == 10 * PAGE  # a lease counts as held


def test_headroom_stops_at_the_tenants_cap_and_state_is_what_it_said(make_arb) -> None:
    a = make_arb()
    t, ident = a.tenant("a")
    admin_reply = a.handle(ident, p.TenantState(id=2, token=t.token, state="idle")).reply
    assert admin_reply.ok
    t.max_pages, t.min_pages = 4, 2  # its knobs (as SetLimit or the config would set them)
    r = room(a, t, ident)
    assert (r.headroom, r.max, r.min, r.state) == (4 * PAGE, 4 * PAGE, 2 * PAGE, "idle")
    t.unresponsive = True  # capped at its min until it answers a reclaim
    assert room(a, t, ident).headroom == 2 * PAGE
    t.min_pages = 0
    assert room(a, t, ident).headroom == 0  # never negative


def test_a_monitor_has_no_headroom_and_strangers_are_refused(make_arb) -> None:
    a = make_arb()
    m, mident = a.tenant("watcher", kind="monitor")
    assert room(a, m, mident).headroom == 0
    out = a.handle(b"nobody", p.Room(id=3, token=""))
    assert out.reply.code == p.UNAUTHORIZED
    out = a.handle(b"nobody", p.Room(id=4, token="f" * 32))
    assert out.reply.code == p.UNAUTHORIZED


def test_room_is_validated_as_hostile_input_both_ways() -> None:
    with pytest.raises(p.DecodeError):  # a request with a field it does not have
        p.decode_request(msgspec.msgpack.encode({"op": "room", "id": 1, "headroom": 5}))
    good = p.encode(p.RoomReply(id=1, headroom=5))
    assert p.decode_reply(good).headroom == 5
    for field, bad in (("headroom", -1), ("pool_free", 1 << 60), ("granted", "many"),
                       ("state", "dreaming")):
        frame = msgspec.msgpack.encode({"r": "room", "id": 1, field: bad})
        with pytest.raises(msgspec.ValidationError):
            p.decode_reply(frame)
