"""The escrow book without a daemon: single use, expiry, who may claim, accounting, giver
death, and its integrity check, by example and as a hypothesis state machine against a
plain model of what each ticket's state must be."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.daemon import escrow as e
from kvpool.daemon.escrow import Escrow, Layout, Party, Refused

LAYOUT = Layout(n_regions=2, unit_bytes=64 << 10)
GIVER = Party(tenant=1, name="prefill", uid=1000)
RECEIVER = Party(tenant=2, name="decode", uid=1000)
THIRD = Party(tenant=3, name="other", uid=1000)
STRANGER = Party(tenant=4, name="decode", uid=2000)  # the receiver's name, another uid


def pfns(units, base=100):
    return [base + 2 * u + r for u in units for r in range(LAYOUT.n_regions)]


def offer(book, units=(0, 1), to="decode", ttl=10.0, now=0.0, giver=GIVER, group=7):
    return book.offer(giver, group, list(units), pfns(units), LAYOUT, to, ttl, now)


def claim(book, t, who=RECEIVER, room=100, now=1.0, layout=LAYOUT, n_at=None, pairs=()):
    got = book.check_claim(t.id, who, layout, len(t.units) if n_at is None else n_at,
                           room, now, pairs)
    book.claimed_by_receiver(got, who, now)
    return got


def test_a_ticket_is_single_use():
    book = Escrow()
    t = offer(book)
    assert len(t.id) == 2 * e.TICKET_BYTES and t.pages == 4
    claim(book, t)
    assert t.state == e.CLAIMED and t.claimed_by == RECEIVER.tenant
    with pytest.raises(Refused, match="claimed already") as err:
        claim(book, t)
    assert err.value.code == e.NOT_FOUND
    assert book.check_integrity() == []


def test_ids_are_unguessable_and_distinct():
    book = Escrow()
    ids = {offer(book, units=(u,)).id for u in range(200)}
    assert len(ids) == 200 and all(len(i) == 32 for i in ids)
    with pytest.raises(Refused, match="no ticket") as err:
        book.lookup("0" * 32, 0.0)
    assert err.value.code == e.NOT_FOUND


def test_expiry_refuses_and_frees_the_units():
    book = Escrow()
    t = offer(book, ttl=5.0)
    with pytest.raises(Refused, match="expired already"):
        claim(book, t, now=5.0)
    assert t.state == e.EXPIRED and not book.held
    offer(book, now=6.0)  # the units can be offered again
    assert book.check_integrity() == []


def test_expire_settles_late_tickets_only():
    book = Escrow()
    a, b = offer(book, units=(0,), ttl=1.0), offer(book, units=(1,), ttl=3.0)
    assert book.next_deadline() == 1.0
    assert book.expire(2.0) == [a]
    assert b.state == e.PENDING and book.next_deadline() == 3.0


def test_a_third_tenant_cannot_claim_and_does_not_spoil_it():
    book = Escrow()
    t = offer(book)
    with pytest.raises(Refused, match="is for tenant 'decode'") as err:
        claim(book, t, who=THIRD)
    assert err.value.code == e.UNAUTHORIZED and t.state == e.PENDING
    with pytest.raises(Refused, match="same uid") as err:  # the name is not enough
        claim(book, t, who=STRANGER)
    assert err.value.code == e.UNAUTHORIZED and t.state == e.PENDING
    claim(book, t)  # the real receiver still can
    assert t.state == e.CLAIMED


def test_a_configured_pairing_admits_another_uid():
    book = Escrow()
    t = offer(book)
    claim(book, t, who=STRANGER, pairs=[("prefill", "decode")])
    assert t.state == e.CLAIMED
    t2 = offer(book)
    with pytest.raises(Refused):  # the pairing is directed: giver -> receiver
        claim(book, t2, who=STRANGER, pairs=[("decode", "prefill")])


def test_layout_and_count_must_match():
    book = Escrow()
    t = offer(book)
    with pytest.raises(Refused, match="regions"):
        claim(book, t, layout=Layout(3, LAYOUT.unit_bytes))
    with pytest.raises(Refused, match="regions"):
        claim(book, t, layout=Layout(2, 2 * LAYOUT.unit_bytes))
    with pytest.raises(Refused, match="target units"):
        claim(book, t, n_at=1)
    assert t.state == e.PENDING


def test_a_claim_past_the_receivers_room_is_refused_and_keeps_the_ticket():
    book = Escrow()
    t = offer(book)
    with pytest.raises(Refused, match="exceed its limit") as err:
        claim(book, t, room=3)
    assert err.value.code == e.OVER_LIMIT and t.state == e.PENDING
    claim(book, t, room=4)


def test_cancel_only_by_the_giver():
    book = Escrow()
    t = offer(book)
    with pytest.raises(Refused, match="not this tenant's"):
        book.cancel(t.id, RECEIVER.tenant, 0.0)
    book.cancel(t.id, GIVER.tenant, 0.0)
    assert t.state == e.CANCELLED
    with pytest.raises(Refused, match="cancelled already"):
        claim(book, t)


def test_a_dying_giver_cancels_its_tickets():
    book = Escrow()
    a, b = offer(book, units=(0,)), offer(book, units=(1,))
    other = offer(book, units=(0,), giver=THIRD, group=8)
    assert {t.id for t in book.forget_giver(GIVER.tenant, 1.0)} == {a.id, b.id}
    assert a.state == b.state == e.CANCELLED and other.state == e.PENDING
    assert book.of_giver(GIVER.tenant) == [] and book.check_integrity() == []


@pytest.mark.parametrize("units,ttl,why", [
    ((), 1.0, "1..65536 units"), ((1, 1), 1.0, "named twice"), ((0,), 0.0, "ttl"),
    ((0,), float("nan"), "ttl"), ((0,), 1e9, "ttl"),
])
def test_bad_offers_change_nothing(units, ttl, why):
    book = Escrow()
    with pytest.raises(Refused, match=why):
        offer(book, units=units, ttl=ttl)
    assert not book.pending and not book.held


def test_a_unit_is_in_one_pending_ticket_at_most():
    book = Escrow()
    offer(book, units=(0, 1))
    with pytest.raises(Refused, match="in escrow already"):
        offer(book, units=(1, 2))
    offer(book, units=(1,), group=8)  # the same index in another group is another unit


def test_caps(monkeypatch):
    monkeypatch.setattr(e, "MAX_PENDING_PER_GIVER", 3)
    book = Escrow()
    for u in range(3):
        offer(book, units=(u,))
    with pytest.raises(Refused, match="pending already") as err:
        offer(book, units=(9,))
    assert err.value.code == e.OVER_LIMIT


def test_settled_tickets_are_remembered_boundedly(monkeypatch):
    monkeypatch.setattr(e, "MAX_SETTLED", 4)
    book = Escrow()
    ts = [offer(book, units=(u,)) for u in range(6)]
    for t in ts:
        book.cancel(t.id, GIVER.tenant, 0.0)
    assert len(book.settled) == 4
    with pytest.raises(Refused, match="no ticket"):  # forgotten: still not claimable
        claim(book, ts[0])
    with pytest.raises(Refused, match="cancelled already"):
        claim(book, ts[-1])


def test_check_integrity_sees_a_broken_index():
    book = Escrow()
    t = offer(book)
    assert book.check_integrity() == []
    book.held[(7, 99)] = t.id
    assert any("unit index" in x for x in book.check_integrity())
    del book.held[(7, 99)]
    book.settled[t.id] = t
    assert any("both pending and settled" in x for x in book.check_integrity())


def test_short_ids_never_show_the_whole_capability():
    book = Escrow()
    t = offer(book)
    book.cancel(t.id, GIVER.tenant, 0.0)
    with pytest.raises(Refused) as err:
        claim(book, t)
    assert t.id not in str(err.value) and t.id[:8] in str(err.value)


# ---- a state machine against a model ------------------------------------------------------
PARTIES = [GIVER, RECEIVER, THIRD, STRANGER]


class EscrowMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.book = Escrow()
        self.now = 0.0
        self.model: dict[str, dict] = {}  # id -> {"state", "expires", "giver", "to", "units"}

    def _pending_units(self):
        return {(m["group"], u) for m in self.model.values() if m["state"] == e.PENDING
                and self.now < m["expires"] for u in m["units"]}

    @rule(giver=st.sampled_from(PARTIES), group=st.integers(1, 2),
          units=st.lists(st.integers(0, 5), min_size=1, max_size=3),
          to=st.sampled_from(["decode", "other", "prefill"]), ttl=st.floats(0.5, 5.0))
    def do_offer(self, giver, group, units, to, ttl):
        self.book.expire(self.now)
        self._expire_model()
        busy = self._pending_units()
        try:
            t = self.book.offer(giver, group, units, pfns(units), LAYOUT, to, ttl, self.now)
        except Refused:
            assert len(set(units)) != len(units) or {(group, u) for u in units} & busy
            return
        assert len(set(units)) == len(units) and not {(group, u) for u in units} & busy
        self.model[t.id] = {"state": e.PENDING, "expires": self.now + ttl, "giver": giver,
                            "to": to, "units": units, "group": group}

    def _expire_model(self):
        for m in self.model.values():
            if m["state"] == e.PENDING and self.now >= m["expires"]:
                m["state"] = e.EXPIRED

    @precondition(lambda self: self.model)
    @rule(data=st.data(), who=st.sampled_from(PARTIES), room=st.integers(0, 8))
    def do_claim(self, data, who, room):
        tid = data.draw(st.sampled_from(list(self.model)))  # (creation order: ids are random)
        m = self.model[tid]
        self._expire_model()
        ok = (m["state"] == e.PENDING and who.name == m["to"] and who.uid == m["giver"].uid
              and len(m["units"]) * LAYOUT.n_regions <= room)
        try:
            t = self.book.check_claim(tid, who, LAYOUT, len(m["units"]), room, self.now)
            self.book.claimed_by_receiver(t, who, self.now)
        except Refused:
            assert not ok, (m, who, room)
            return
        assert ok, (m, who, room)
        m["state"] = e.CLAIMED

    @precondition(lambda self: self.model)
    @rule(data=st.data(), who=st.sampled_from(PARTIES))
    def do_cancel(self, data, who):
        tid = data.draw(st.sampled_from(list(self.model)))  # (creation order: ids are random)
        m = self.model[tid]
        self._expire_model()
        try:
            self.book.cancel(tid, who.tenant, self.now)
        except Refused:
            assert m["state"] != e.PENDING or m["giver"].tenant != who.tenant
            return
        assert m["state"] == e.PENDING and m["giver"].tenant == who.tenant
        m["state"] = e.CANCELLED

    @rule(dt=st.floats(0.0, 3.0))
    def advance(self, dt):
        self.now += dt

    @rule()
    def expire(self):
        self.book.expire(self.now)
        self._expire_model()

    @rule(who=st.sampled_from(PARTIES))
    def giver_dies(self, who):
        self.book.expire(self.now)
        self._expire_model()
        self.book.forget_giver(who.tenant, self.now)
        for m in self.model.values():
            if m["state"] == e.PENDING and m["giver"].tenant == who.tenant:
                m["state"] = e.CANCELLED

    @invariant()
    def agrees_with_the_model(self):
        assert self.book.check_integrity() == []
        for tid, m in self.model.items():
            t = self.book.pending.get(tid) or self.book.settled.get(tid)
            assert t is not None
            if t.state != m["state"]:  # the book expires lazily: only pending -> expired
                assert t.state == e.PENDING and m["state"] == e.EXPIRED, (t.state, m)


EscrowMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                           deadline=None)
test_escrow_machine = EscrowMachine.TestCase
