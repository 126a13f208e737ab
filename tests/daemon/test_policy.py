"""Reclaim policies: every registered policy keeps the obligations the arbiter relies on
(kvpool/daemon/policy.py), the priority policy splits by tiers of shares, the config picks
one by name (an unknown name is one clear line), and the choice decides which tenant the
arbiter asks to give back (first_come: nobody; a grant takes free memory only)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvpool import protocol as p
from kvpool.daemon.config import Config, ConfigError
from kvpool.daemon.fairshare import Claim
from kvpool.daemon.policy import POLICIES, Priority

GIB = 1 << 30
UNIT = GIB // 8

claim = st.builds(
    Claim,
    name=st.uuids().map(str),
    held=st.integers(0, 64).map(lambda x: x * UNIT),
    demand=st.integers(0, 64).map(lambda x: x * UNIT),
    min=st.integers(0, 16).map(lambda x: x * UNIT),
    max=st.integers(1, 64).map(lambda x: x * UNIT),
    shares=st.sampled_from([0.5, 1.0, 2.0, 3.0]),
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=200, deadline=None)
@given(budget=st.integers(1, 64).map(lambda x: x * UNIT),
       claims=st.lists(claim, min_size=1, max_size=6))
def test_every_policy_keeps_the_obligations(name: str, budget: int, claims: list[Claim]) -> None:
    policy = POLICIES.lookup(name)
    fair = policy.fair_shares(budget, claims, UNIT)
    floors = sum(c.floor // UNIT * UNIT for c in claims)
    assert sum(fair.values()) <= max(budget, floors)
    for c in claims:  # 2: floor <= share <= cap, in whole units
        assert fair[c.name] % UNIT == 0
        assert c.floor // UNIT * UNIT <= fair[c.name] <= c.cap
    plan = policy.plan(budget, claims, budget, UNIT)
    excess = {c.name: c.held - max(c.min, fair[c.name]) for c in claims}
    for name_, amount in plan:  # 3: only from the excess, largest first
        assert 0 < amount <= excess[name_] + UNIT
    assert [excess[n] for n, _ in plan] == sorted((excess[n] for n, _ in plan), reverse=True)
    for c in claims:  # 4: growth within max(share, min)
        assert policy.may_grow(budget, claims, c.name, UNIT, UNIT) == (
            c.held + UNIT <= max(fair[c.name], c.min))


def test_priority_fills_the_most_shares_first_and_keeps_every_floor() -> None:
    claims = [Claim("batch", 6 * GIB, 8 * GIB, min=1 * GIB, shares=1),
              Claim("prod", 2 * GIB, 8 * GIB, shares=2)]
    # priority: batch keeps its floor, prod takes the rest; fair share splits 1:2
    assert Priority().fair_shares(8 * GIB, claims, UNIT) == {"batch": 1 * GIB, "prod": 7 * GIB}
    assert POLICIES.lookup("fair_share").fair_shares(8 * GIB, claims, UNIT) == {
        "batch": 21 * UNIT, "prod": 42 * UNIT}  # 2.625 and 5.25 GiB (whole units)
    # so for 5 GiB more, batch gives all 5 under priority but only its excess over
    # 2.625 GiB (3.375) under fair share
    assert Priority().plan(8 * GIB, claims, 5 * GIB, UNIT) == [("batch", 5 * GIB)]
    assert POLICIES.lookup("fair_share").plan(8 * GIB, claims, 5 * GIB, UNIT) == [
        ("batch", 27 * UNIT)]
    # ties in the top tier share it fairly, lower tiers keep only their floors
    tier = [Claim("x", 0, 8 * GIB, shares=2), Claim("y", 0, 8 * GIB, shares=2),
            Claim("z", 4 * GIB, 8 * GIB, min=1 * GIB, shares=1)]
    assert Priority().fair_shares(8 * GIB, tier, UNIT) == {"x": 28 * UNIT, "y": 28 * UNIT,
                                                      "z": 1 * GIB}


def test_priority_tiers_that_fit_get_their_caps() -> None:
    claims = [Claim("a", 0, 3 * GIB, shares=3), Claim("b", 0, 2 * GIB, shares=2),
              Claim("c", 0, 8 * GIB, shares=1)]
    assert Priority().fair_shares(8 * GIB, claims, UNIT) == {"a": 3 * GIB, "b": 2 * GIB,
                                                        "c": 3 * GIB}


def test_config_picks_a_policy_by_name_and_refuses_an_unknown_one() -> None:
    assert Config.from_dict({"reclaim_policy": "priority"}).reclaim_policy == "priority"
    assert Config().reclaim_policy == "fair_share"
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"reclaim_policy": "lottery"})
    assert "reclaim_policy = 'lottery': expected one of fair_share, priority" in str(e.value)


PAGE = 64 << 10


def test_the_policy_decides_whom_the_arbiter_asks_and_for_how_much(make_arb) -> None:
    """16 pages; batch (shares 1, min 2) holds 12, prod (shares 2) holds 4 and asks for 10
    more. Fair share gives prod 10 of 16 (2:1): it is refused at once, batch is asked for
    nothing. Priority gives prod everything above batch's min: it waits, and batch is
    asked for exactly the 10 pages above its min."""
    outcomes = {}
    for policy in ("fair_share", "priority"):
        arb = make_arb(Config.from_dict({"budget": 16 * PAGE, "reclaim_policy": policy,
                                         "tenants": {"batch": {"shares": 1, "min": 2 * PAGE},
                                                     "prod": {"shares": 2}}}))
        batch, bi = arb.tenant("batch")
        prod, pi = arb.tenant("prod")
        gid = {}
        for t, i in ((batch, bi), (prod, pi)):
            gid[t.id] = arb.handle(i, p.CreateGroup(id=2, token=t.token, n_regions=1,
                                                    capacity=16 * PAGE)).reply.group
        assert arb.handle(bi, p.Grant(id=3, token=batch.token, group=gid[batch.id],
                                      units=list(range(12)))).reply.ok
        assert arb.handle(pi, p.Grant(id=3, token=prod.token, group=gid[prod.id],
                                      units=list(range(4)))).reply.ok
        out = arb.handle(pi, p.Grant(id=4, token=prod.token, group=gid[prod.id],
                                     units=list(range(4, 14))))
        arb.tick()
        outcomes[policy] = (out.deferred, None if out.deferred else out.reply.code,
                            batch.ask.pages if batch.ask else 0, prod.ask)
    assert outcomes == {"fair_share": (False, p.NO_MEMORY, 0, None),
                        "priority": (True, None, 10, None)}


def test_first_come_takes_free_memory_only_and_asks_nobody(make_arb) -> None:
    """16 pages: early holds 12, late 2, and late asks for 4 more (2 are free). Fair share
    (8 each) lets late wait while early is asked to give back; first come (the fleet
    baselines' daemon: no arbiter) refuses late at once and asks early for nothing."""
    outcomes = {}
    for policy in ("fair_share", "first_come"):
        arb = make_arb(Config.from_dict({"budget": 16 * PAGE, "reclaim_policy": policy}))
        early, ei = arb.tenant("early")
        late, li = arb.tenant("late")
        gid = {}
        for t, i in ((early, ei), (late, li)):
            gid[t.id] = arb.handle(i, p.CreateGroup(id=2, token=t.token, n_regions=1,
                                                    capacity=16 * PAGE)).reply.group
        assert arb.handle(ei, p.Grant(id=3, token=early.token, group=gid[early.id],
                                      units=list(range(12)))).reply.ok
        assert arb.handle(li, p.Grant(id=3, token=late.token, group=gid[late.id],
                                      units=list(range(2)))).reply.ok
        out = arb.handle(li, p.Grant(id=4, token=late.token, group=gid[late.id],
                                     units=list(range(2, 6))))
        arb.tick()
        outcomes[policy] = (out.deferred, None if out.deferred else out.reply.code,
                            early.ask is not None)
    assert outcomes == {"fair_share": (True, None, True),
                        "first_come": (False, p.NO_MEMORY, False)}
