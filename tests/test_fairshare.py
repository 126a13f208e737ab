"""The arbitration policy on its own: weighted max-min fairness with floors and caps."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kvpool.daemon.fairshare import Claim, fair_shares
from kvpool.daemon.policy import FairShare

POLICY = FairShare()

GIB = 1 << 30


def test_shares_split_contended_memory():
    claims = [Claim("a", 0, 10 * GIB), Claim("b", 0, 10 * GIB), Claim("c", 0, 10 * GIB, shares=2)]
    s = fair_shares(8 * GIB, claims)
    assert [s["a"], s["b"], s["c"]] == [2 * GIB, 2 * GIB, 4 * GIB]


def test_unused_share_goes_to_others():
    claims = [Claim("small", 0, 1 * GIB), Claim("big", 0, 10 * GIB)]
    s = fair_shares(8 * GIB, claims)
    assert s == {"small": 1 * GIB, "big": 7 * GIB}


def test_min_is_a_floor_and_max_a_cap():
    claims = [Claim("a", 0, 10 * GIB, min=5 * GIB), Claim("b", 0, 10 * GIB, max=1 * GIB),
              Claim("c", 0, 10 * GIB)]
    s = fair_shares(8 * GIB, claims)
    assert s["a"] >= 5 * GIB and s["b"] == 1 * GIB and sum(s.values()) <= 8 * GIB


def test_reclaim_takes_from_the_largest_excess_and_spares_min():
    claims = [Claim("hog", 6 * GIB, 6 * GIB, min=1 * GIB), Claim("mid", 2 * GIB, 2 * GIB),
              Claim("new", 0, 4 * GIB)]
    plan = POLICY.plan(8 * GIB, claims, 2 * GIB, 1)
    assert plan == [("hog", 2 * GIB)]
    assert POLICY.may_grow(8 * GIB, claims, "new", 2 * GIB, 1)


def test_a_tenant_at_its_share_cannot_take_more_by_reclaim():
    claims = [Claim("a", 4 * GIB, 8 * GIB), Claim("b", 4 * GIB, 8 * GIB)]
    assert POLICY.plan(8 * GIB, claims, 1 * GIB, 1) == []
    assert not POLICY.may_grow(8 * GIB, claims, "a", 1 * GIB, 1)


claim = st.builds(
    Claim,
    name=st.uuids().map(str),
    held=st.integers(0, 64) .map(lambda x: x * GIB // 8),
    demand=st.integers(0, 64).map(lambda x: x * GIB // 8),
    min=st.integers(0, 16).map(lambda x: x * GIB // 8),
    max=st.integers(1, 64).map(lambda x: x * GIB // 8),
    shares=st.floats(0.1, 10),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64).map(lambda x: x * GIB // 8), st.lists(claim, min_size=1, max_size=6))
def test_share_invariants(budget, claims):
    s = fair_shares(budget, claims)
    floors = sum(c.floor for c in claims)
    assert sum(s.values()) <= max(budget, floors) + len(claims)
    for c in claims:
        assert c.floor - 1 <= s[c.name] <= c.cap
    plan = POLICY.plan(budget, claims, budget, 1)
    for name, amount in plan:
        c = next(c for c in claims if c.name == name)
        assert amount > 0 and c.held - amount >= max(c.min, s[name]) - 1
