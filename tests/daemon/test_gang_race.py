"""The gang race (issue 26's acceptance): two TP=2 gangs and one single-device tenant
compete for the last pages of two host devices (``--devices 2``) for 1,000 rounds of
grants, releases and reclaims, with a rank killed (SIGKILL) every few rounds. After
every round, on every device: ``kvpool check`` clean (the daemon's self-check, which
includes the gangs'), nothing over the budget, and no gang half-granted as ``ps`` and
``map`` show it; every killed gang's pages are back on every device.

Ranks are real processes forked from a zygote (``gang_ranks.py``), so a kill -9 is a
real death the daemon learns from the pidfd. ``KVPOOL_GANG_ROUNDS`` changes the count.
"""

from __future__ import annotations

import os
import random

from kvpool.client_lib import Monitor
from kvpool.client_lib.errors import KvpoolError

from .gang_harness import GangProcs, Ranks, invariant_problems
from .helpers import PAGE

ROUNDS = int(os.environ.get("KVPOOL_GANG_ROUNDS", "1000"))
BUDGET_PAGES = 24  # per device
N_REGIONS, UNITS = 2, 8  # a gang unit is 2 pages on each device
LAYOUT = [(N_REGIONS, UNITS * PAGE)]


def test_two_gangs_and_a_tenant_race_for_two_devices(start_daemon, tmp_path):
    d = start_daemon(budget=str(BUDGET_PAGES * PAGE),
                     extra=("--devices", "2", "--reclaim-timeout", "0.5"))
    rng = random.Random(26)
    ranks = Ranks(d.run_dir, tmp_path)
    monitors = {dev: Monitor(d.run_dir, device=dev) for dev in (0, 1)}
    solo = d.connect("solo", device=1)
    sg = solo.region_group(1, BUDGET_PAGES * PAGE)
    gangs: list[GangProcs] = []
    stats = {"granted": 0, "refused": 0, "released": 0, "killed": 0, "solo_waits": 0}
    try:
        gangs = [ranks.gang(f"g{i}", [0, 1], LAYOUT) for i in range(2)]
        next_kill = rng.randint(3, 9)
        for rnd in range(ROUNDS):
            for g in gangs:
                free = [u for u in range(UNITS) if u not in g.mapped]
                if g.mapped and (not free or rng.random() < 0.45):
                    units = rng.sample(sorted(g.mapped), rng.randint(1, len(g.mapped)))
                    replies = g.collective({"op": "release", "units": sorted(units)})
                    if all(r["ok"] for r in replies):
                        g.mapped -= set(units)
                        stats["released"] += 1
                else:
                    units = rng.sample(free, rng.randint(1, min(3, len(free))))
                    replies = g.collective({"op": "grant", "units": sorted(units)})
                    oks = {r["ok"] for r in replies}
                    assert len(oks) == 1, f"round {rnd}: a partial gang grant: {replies}"
                    codes = {r.get("code") for r in replies}
                    assert len(codes) == 1, f"round {rnd}: ranks told apart: {replies}"
                    if replies[0]["ok"]:
                        g.mapped |= set(units)
                        stats["granted"] += 1
                    else:
                        stats["refused"] += 1
                # a reclaim ask may have made the ranks give units back
                g.mapped = set(g.ranks[0].call({"op": "units"})["units"])
            solo_units = sorted(sg.mapped)
            if solo_units and rng.random() < 0.5:
                sg.release(rng.sample(solo_units, rng.randint(1, len(solo_units))))
            else:
                free = [u for u in range(BUDGET_PAGES) if u not in sg.mapped]
                want = rng.sample(free, min(len(free), rng.randint(1, 4)))
                waits = rnd % 25 == 24  # now and then: wait for reclaim from the gangs
                try:
                    sg.grant(want, speculative=not waits)
                    stats["solo_waits"] += waits
                except KvpoolError:
                    pass
            if rnd + 1 == next_kill:
                victim = rng.choice(gangs)
                dead = rng.choice(victim.ranks)
                dead.kill()
                stats["killed"] += 1
                for r in victim.ranks:
                    if r is not dead:
                        assert r.call({"op": "ended", "timeout": 30})["ended"], \
                            f"round {rnd}: a rank of the killed gang was not told"
                        r.close()
                gone = {x.id for mon in monitors.values() for x in mon.ps().tenants
                        if x.name == victim.name and x.mapped}
                assert not gone, f"round {rnd}: the killed gang still holds pages: {gone}"
                gangs[gangs.index(victim)] = ranks.gang(victim.name, [0, 1], LAYOUT)
                next_kill = rnd + 1 + rng.randint(3, 9)
            problems = invariant_problems(monitors, 2)
            assert not problems, f"round {rnd}: {problems}"
        assert stats["granted"] and stats["refused"] and stats["killed"], stats
        print(f"gang race, {ROUNDS} rounds: {stats}")
    finally:
        for g in gangs:
            for r in g.ranks:
                r.close()
        ranks.close()
        solo.close()
        for mon in monitors.values():
            mon.close()
