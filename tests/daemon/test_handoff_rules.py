"""Handoff rules the daemon applies beyond the receiver's max, on the arbiter alone (real
pool and host pages, no daemon process): while others wait for memory a claim must stay
within the receiver's fair share, and a receiver being asked to give memory back may not
take more; either way the giver keeps its pages and the ticket stays claimable."""

from __future__ import annotations

import socket

import pytest

from kvpool import protocol as p
from kvpool.daemon.arbiter import Arbiter
from kvpool.daemon.config import Config
from kvpool.daemon.pool import Pool
from kvpool.vmm.host import HostBackend

PAGE = 64 << 10
BUDGET = 16


class Session:
    def __init__(self, arb: Arbiter, name: str, pid: int):
        self.arb = arb
        self.a, self.b = socket.socketpair()
        self.t = arb.open_session(self.a, pid, 0, 0, None)
        self.ident = f"id-{name}".encode()
        self.ids = 0
        assert isinstance(self.call(p.Register(name=name)).reply, p.Registered)

    def call(self, req: p.Request):
        self.ids += 1
        req.id, req.token = self.ids, self.t.token
        return self.arb.handle(self.ident, req)

    def group(self, units: int = 8) -> int:
        reply = self.call(p.CreateGroup(n_regions=1, capacity=units * PAGE)).reply
        assert isinstance(reply, p.GroupCreated)
        return reply.group

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def arb():
    backend = HostBackend(page_size=PAGE)
    pool = Pool(backend, BUDGET)
    arbiter = Arbiter(Config(budget=BUDGET * PAGE), pool, BUDGET * PAGE)
    yield arbiter
    pool.close()
    backend.close()


def contended(arb: Arbiter):
    """prefill holds 6 pages (4 in a ticket for decode), decode 8, and third waits for
    4 (2 are free): a reclaim is under way, decode the furthest above its share."""
    prefill, decode, third = (Session(arb, n, 100 + i)
                              for i, n in enumerate(("prefill", "decode", "third")))
    pg, dg, tg = prefill.group(), decode.group(16), third.group()
    assert isinstance(prefill.call(p.Grant(group=pg, units=list(range(6)))).reply, p.Granted)
    assert isinstance(decode.call(p.Grant(group=dg, units=list(range(8)))).reply, p.Granted)
    offered = prefill.call(p.Offer(group=pg, units=[2, 3, 4, 5], to="decode")).reply
    assert isinstance(offered, p.Offered)
    waiting = third.call(p.Grant(group=tg, units=[0, 1, 2, 3]))
    assert waiting.deferred and arb.reclaimer.waiters
    return prefill, decode, third, pg, dg, offered.ticket


def refused(arb, prefill, decode, pg, dg, ticket, code: str, why: str) -> None:
    before = {u: list(v) for u, v in prefill.t.groups[pg].units.items()}
    out = decode.call(p.Claim(ticket=ticket, group=dg, units=[8, 9, 10, 11]))
    assert isinstance(out.reply, p.Error), out.reply
    assert out.reply.code == code and why in out.reply.message, out.reply
    assert not out.pfns_to_send
    assert {u: list(v) for u, v in prefill.t.groups[pg].units.items()} == before
    assert prefill.t.granted == 6 and decode.t.granted == 8
    assert ticket in arb.handoff.book.pending  # still claimable
    assert arb.check_integrity() == []


def test_a_claim_past_the_fair_share_while_others_wait_is_refused(arb):
    prefill, decode, third, pg, dg, ticket = contended(arb)
    assert decode.t.ask is None
    refused(arb, prefill, decode, pg, dg, ticket, p.OVER_LIMIT, "fair share")
    for s in (prefill, decode, third):
        s.close()


def test_a_receiver_asked_to_give_back_may_not_take_more(arb):
    prefill, decode, third, pg, dg, ticket = contended(arb)
    arb.tick()  # the reclaim round asks the tenants above their share
    assert decode.t.ask is not None
    refused(arb, prefill, decode, pg, dg, ticket, p.NO_MEMORY, "asked to give memory back")
    for s in (prefill, decode, third):
        s.close()


def test_without_contention_the_same_claim_moves_the_pages(arb):
    prefill, decode = Session(arb, "prefill", 100), Session(arb, "decode", 101)
    pg, dg = prefill.group(), decode.group(16)
    prefill.call(p.Grant(group=pg, units=list(range(8))))
    decode.call(p.Grant(group=dg, units=list(range(6))))
    pfns = [prefill.t.groups[pg].units[u][0] for u in (4, 5, 6, 7)]
    ticket = prefill.call(p.Offer(group=pg, units=[4, 5, 6, 7], to="decode")).reply.ticket
    granted = arb.pool.granted
    out = decode.call(p.Claim(ticket=ticket, group=dg, units=[8, 9, 10, 11]))
    assert isinstance(out.reply, p.Claimed) and out.pfns_to_send == pfns
    assert [decode.t.groups[dg].units[u][0] for u in (8, 9, 10, 11)] == pfns
    assert all(arb.pool.owner[x] == decode.t.id for x in pfns)
    assert (prefill.t.granted, decode.t.granted, arb.pool.granted) == (4, 10, granted)
    assert [m for _, m in arb.take_outbox() if isinstance(m, p.Settled)][0].state == "claimed"
    assert arb.check_integrity() == []
    prefill.close()
    decode.close()


def test_a_ticket_found_expired_by_a_claim_is_still_told_to_its_giver(arb):
    """No timer ran (no daemon loop here): the claim itself finds the ticket late, and
    the giver still gets its Settled(expired), so it knows it keeps the pages."""
    import time

    prefill, decode = Session(arb, "prefill", 100), Session(arb, "decode", 101)
    pg, dg = prefill.group(), decode.group()
    prefill.call(p.Grant(group=pg, units=[0, 1]))
    ticket = prefill.call(p.Offer(group=pg, units=[1], to="decode", ttl_ms=1)).reply.ticket
    time.sleep(0.01)
    out = decode.call(p.Claim(ticket=ticket, group=dg, units=[0]))
    assert isinstance(out.reply, p.Error) and "expired already" in out.reply.message
    told = [m for _, m in arb.take_outbox() if isinstance(m, p.Settled)]
    assert [(m.ticket, m.state) for m in told] == [(ticket, "expired")]
    assert sorted(prefill.t.groups[pg].units) == [0, 1] and arb.check_integrity() == []
    prefill.close()
    decode.close()
