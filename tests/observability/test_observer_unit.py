"""The observer on a socket-free arbiter: the arbiter and its reclaimer report every
request handled, tick, drop, reclaim ask and page given back to it (the observation
points of ``kvpool.daemon.hooks``), so every outcome the arbiter produces is counted and
recorded (no daemon process)."""

from __future__ import annotations

from kvpool import protocol as p
from kvpool.daemon.fdwatch import FdWatch
from kvpool.daemon.observe import Observer, attach

PAGE = 64 << 10


def observe(arb) -> Observer:
    replies: list[p.Reply] = []
    return attach(arb, FdWatch(), lambda envelope, reply: replies.append(reply), arb.cfg)


def test_grants_waits_asks_releases_and_deaths_are_recorded(arb):
    obs = observe(arb)
    try:
        hog, hi = arb.tenant("hog")
        new, ni = arb.tenant("new")
        gh = arb.handle(hi, p.CreateGroup(id=2, token=hog.token, n_regions=1,
                                          capacity=16 * PAGE)).reply.group
        gn = arb.handle(ni, p.CreateGroup(id=2, token=new.token, n_regions=1,
                                          capacity=16 * PAGE)).reply.group
        out = arb.handle(hi, p.Grant(id=3, token=hog.token, group=gh, units=list(range(16))))
        assert isinstance(out.reply, p.Granted)
        assert obs.counts["grants"] == 1 and obs.counts["grant_pages"] == 16
        out = arb.handle(ni, p.Grant(id=4, token=new.token, group=gn, units=[0, 1]))
        assert out.deferred and obs.counts["waits"] == 1 and obs.round is not None
        arb.tick()  # asks hog to give back (the reclaimer reports the ask)
        assert sum(v for k, v in obs.counts.items() if k[0] == "asks") == 1
        arb.handle(hi, p.Release(id=5, token=hog.token, group=gh, units=[14, 15]))
        assert obs.counts["releases"] == 1 and obs.counts["release_pages"] == 2
        assert sum(v for k, v in obs.counts.items() if k[0] == "reclaimed_bytes") == 2 * PAGE
        done = arb.tick()  # the waiter is served: the round closes
        assert [type(o.reply) for o in done] == [p.Granted]
        assert obs.round is None and obs.counts["rounds"] == 1
        arb.drop(hog, "process 1 exited")
        assert obs.counts["drops", "death"] == 1
        kinds = [e.kind for e in obs.events.ring]
        for kind in ("grant", "wait", "ask", "reclaim", "death"):
            assert kind in kinds, (kind, kinds)
        assert arb.check_integrity() == []
    finally:
        obs.close()


def test_the_events_request_is_dispatched_to_the_observer(arb):
    obs = observe(arb)
    try:
        t, ident = arb.tenant("watch", kind="monitor")
        reply = arb.handle(ident, p.Events(id=2, token=t.token)).reply
        assert isinstance(reply, p.EventsReply)
    finally:
        obs.close()
