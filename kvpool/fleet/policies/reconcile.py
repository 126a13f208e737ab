"""``policy = "reconcile"``: an out-of-path arbiter that sets KV ceilings at an interval
(AIBrix's ModelClaim, v0.8, experimental), a baseline.

Where it comes from (docs/ARCHITECTURE.md, "Fleet policies"; AIBrix's ModelClaim
controller and its tracker, aibrix#2770): engines with elastic KV (kvcached); per device
a controller loop every ``reconcile_interval`` (10 s) computes each engine's KV ceiling:
its base is ``max(P% x capacity, its current KV use)``; when no engine is active there is
no plan; otherwise what the bases leave goes to the active engines by the weight ``1 +
min(in-flight, 4) + min(completions since the last loop, 4)``; the ceilings are applied
after the fact through a sidecar (``kvctl limit``); engines idle for ``sleepAfterSeconds``
are put to sleep and the gateway wakes them on a request. Between two loops the engines
grow first come first served: the ceilings arrive after the fact (two engines started
together each took most of the device for ~12 s before the first ceilings applied).

Here: members are elastic, not sleepable, started with the fleet, on a daemon that runs
the ``first_come`` reclaim policy (as ``idle-sleep``). Every ``reconcile_interval`` this
policy reads the daemon's tenants (``stats``: each member's KV, ``mapped``, and weight
sets), counts each awake member's requests in flight and those it finished since the
last round (the fleet's own counts), and when one is active sets every awake member's
``max`` with the daemon's admin call (``kvpool limit``'s ``set_limit``) to its weight
sets plus its KV ceiling (a tenant's ``max`` counts the sets it holds); ``capacity`` is
the budget less the weight sets in use (the KV part of the device). Only the fleet's own
members are ever limited (its group's tenants). ``floor_percent`` is ``P`` (default 10:
the source names P without a default); ``sleep_after`` (default 300 s, the same as
idle-sleep's threshold: the source gives none) is checked at each round.

The start-up window this leaves (tests/fleet/test_startup_race.py,
benchmarks/startup_race_bench.py): an engine that grew first keeps what it holds above
its share while another waits for memory, until a round; and a round's bases are
``max(floor, KV in use)``, so not even a round takes the excess back (the daemon is
``first_come``, so the budget itself is never exceeded: the late engine is refused).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpool import protocol as p
from kvpool.fleet.entries import ModelEntry
from kvpool.fleet.member import AWAKE, Member
from kvpool.fleet.policies.base import Control, Knob, PolicyRun, Setup
from kvpool.fleet.policies.idle_sleep import FIRST_COME, sleep_idle
from kvpool.sizes import format_size

RECONCILE_INTERVAL = Knob("reconcile_interval", 10.0, 0.0, 86400.0, "seconds", lo_open=True)
FLOOR_PERCENT = Knob("floor_percent", 10.0, 0.0, 100.0, "percent")
SLEEP_AFTER = Knob("sleep_after", 300.0, 0.0, 86400.0, "seconds", lo_open=True)
CAP = 4  # in-flight requests and completions each count at most this much


@dataclass(frozen=True)
class Engine:
    """One awake member as a round sees it."""

    tenant: str
    used: int  # bytes of KV it holds now (the daemon's ``mapped``)
    inflight: int
    completions: int  # requests it finished since the last round

    @property
    def active(self) -> bool:
        return self.inflight > 0 or self.completions > 0

    @property
    def weight(self) -> int:
        return 1 + min(self.inflight, CAP) + min(self.completions, CAP)


def ceilings(capacity: int, floor_percent: float, engines: Sequence[Engine]
             ) -> dict[str, int] | None:
    """Each engine's KV ceiling (bytes), or None when no engine is active (no plan):
    its base ``max(floor_percent% x capacity, used)``, plus, for an active engine, its
    weight's part of what the bases leave. Pure."""
    active = [e for e in engines if e.active]
    if not active:
        return None
    floor = int(capacity * floor_percent / 100)
    out = {e.tenant: max(floor, e.used) for e in engines}
    rest = max(0, capacity - sum(out.values()))
    total = sum(e.weight for e in active)
    for e in active:
        out[e.tenant] += rest * e.weight // total
    return out


class ReconcileRun:
    def __init__(self, interval: float, floor_percent: float, sleep_after: float,
                 setup: Setup) -> None:
        self.interval = interval
        self.floor_percent = floor_percent
        self.sleep_after = sleep_after
        self.setup = setup
        self.finished: dict[str, int] = {}  # tenant -> its completions at the last round
        self.rounds = 0  # rounds that set ceilings
        self.quiet = True  # the last round had no plan (and said so)

    def may_start(self, m: Member, fleet: Control) -> bool:
        return True

    def released(self, m: Member, fleet: Control) -> None:
        return None

    async def run(self, fleet: Control) -> None:
        while not fleet.closed:
            await asyncio.sleep(self.interval)
            try:
                await self.round(fleet)
            except Exception as e:  # a round that fails (the daemon is gone) never ends it
                fleet.say(f"fleet: reconcile: {type(e).__name__}: {str(e)[:200]}")
            await sleep_idle(fleet, self.sleep_after, "reconcile")

    async def round(self, fleet: Control) -> None:
        """One controller loop: read, plan, and (with a plan) set every awake member's
        ceiling: one log line before (the ceilings), one once they are set; the first
        loop without a plan after one says so (the ceilings stay)."""
        members = fleet.all()
        completions = {m.tenant: m.completed - self.finished.get(m.tenant, m.completed)
                       for m in members}
        self.finished = {m.tenant: m.completed for m in members}
        stats = await asyncio.to_thread(self._stats)
        ours = {t.name: t for t in stats.tenants
                if t.group == self.setup.group and t.state != "asleep"}
        engines = [Engine(m.tenant, ours[m.tenant].mapped, m.inflight, completions[m.tenant])
                   for m in members if m.state == AWAKE and m.tenant in ours]
        pool = stats.pool
        capacity = max(0, pool.budget - (pool.weights - pool.weights_cached))
        plan = ceilings(capacity, self.floor_percent, engines)
        if plan is None:  # said once when the fleet goes quiet, not every interval
            if not self.quiet:
                self.quiet = True
                fleet.say(f"fleet: reconcile: no engine active since round {self.rounds}; "
                          f"ceilings kept")
            return
        self.quiet = False
        self.rounds += 1
        active = [e.tenant for e in engines if e.active]
        fleet.say(f"fleet: reconcile round {self.rounds}: KV ceilings "
                  f"{', '.join(f'{t}={format_size(b)}' for t, b in plan.items())} of "
                  f"{format_size(capacity)} (active: {', '.join(active)})")
        limits = {t: ours[t].weights + b for t, b in plan.items()}
        await asyncio.to_thread(self._apply, limits)
        fleet.say(f"fleet: reconcile round {self.rounds} applied")

    def _stats(self) -> p.StatsReply:
        from kvpool.client_lib import Monitor

        with Monitor(self.setup.run_dir) as monitor:
            return monitor.stats()

    def _apply(self, limits: Mapping[str, int]) -> None:
        from kvpool.client_lib import Monitor

        with Monitor(self.setup.run_dir) as monitor:
            for tenant, nbytes in limits.items():
                monitor.set_limit(tenant, nbytes)


class ReconcilePolicy:
    """KV ceilings set at an interval by an arbiter out of the path (see the module)."""

    name = "reconcile"
    source = ("AIBrix ModelClaim (v0.8): a 10 s controller loop sets each engine's KV "
              "ceiling (floor P%, the rest by 1 + min(in-flight, 4) + min(completions, 4)) "
              "through kvcached's limit; sleepAfterSeconds idle sleep")
    knobs: tuple[Knob, ...] = (RECONCILE_INTERVAL, FLOOR_PERCENT, SLEEP_AFTER)
    decides: tuple[str, ...] = ("eager", "sleepable", "sleep_after", "min", "max", "shares")
    baseline = True
    elastic = True
    daemon_settings: Mapping[str, str] = FIRST_COME

    def member(self, entry: ModelEntry) -> ModelEntry:
        return dataclasses.replace(entry, eager=True, sleepable=False, sleep_after=None,
                                   min=None, max=None, shares=None)

    def start(self, knobs: Mapping[str, float], setup: Setup) -> PolicyRun:
        return ReconcileRun(knobs["reconcile_interval"], knobs["floor_percent"],
                            knobs["sleep_after"], setup)
