"""``policy = "idle-sleep"``: idle-time sleep over elastic KV, no arbiter (kvcached's
controller and router), a baseline.

Where it comes from (docs/ARCHITECTURE.md, "Fleet policies"; kvcached's ``controller``:
its router and sleep manager): one engine per model, every engine up from the start, its
KV elastic and taken first come first served from the device's free memory; requests
routed by their ``model`` alone; a sleep manager puts a model idle longer than
``idle_threshold`` (default 300 s, checked every ``check_interval``, default 60 s) to
sleep (vLLM ``POST /sleep?level=1``: weights copied to host memory, KV dropped); a
request for a sleeping model wakes it first. Nothing reacts to memory pressure.

Here: every member is an elastic server started with the fleet, *not* sleepable (the
daemon never puts it to sleep under pressure) and without an idle timer of its own; the
fleet's daemon runs the ``first_come`` reclaim policy (:mod:`kvpool.daemon.policy`: what a
tenant holds is its share, nobody shrinks for another, a grant free memory does not
cover is refused). This policy's own timer sleeps a member that served no request of
the fleet's for ``idle_threshold`` (``POST /sleep``: it releases its KV and its hold on its
weight set, as a bundled server sleeps); the router wakes it for its next request, as
for every fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from kvpool.fleet.entries import ModelEntry
from kvpool.fleet.member import AWAKE, Member
from kvpool.fleet.policies.base import Control, Knob, PolicyRun, Setup, last_used

IDLE_THRESHOLD = Knob("idle_threshold", 300.0, 0.0, 86400.0, "seconds", lo_open=True)
CHECK_INTERVAL = Knob("check_interval", 60.0, 0.0, 86400.0, "seconds", lo_open=True)
#: the daemon config every elastic baseline runs on (no arbitration between tenants)
FIRST_COME: Mapping[str, str] = MappingProxyType({"reclaim_policy": "first_come"})


def idle_too_long(members: Sequence[Member], now: float, after_s: float) -> list[Member]:
    """The awake members that served nothing for ``after_s`` seconds (none in flight)."""
    return [m for m in members
            if m.state == AWAKE and m.inflight == 0 and now - last_used(m) >= after_s]


async def sleep_idle(fleet: Control, after_s: float, policy: str) -> None:
    """Put every member idle for ``after_s`` to sleep, one after another."""
    for m in idle_too_long(fleet.all(), time.monotonic(), after_s):
        if fleet.closed:
            return
        await fleet.put_to_sleep(m, f"{policy}: idle for {time.monotonic() - last_used(m):.1f} "
                                    f"s (at least {after_s:g} s)")


class IdleSleepRun:
    def __init__(self, idle_threshold: float, check_interval: float) -> None:
        self.idle_threshold = idle_threshold
        self.check_interval = check_interval

    def may_start(self, m: Member, fleet: Control) -> bool:
        return True

    def released(self, m: Member, fleet: Control) -> None:
        return None

    async def run(self, fleet: Control) -> None:
        """Every ``check_interval``: sleep the members idle for ``idle_threshold``."""
        while not fleet.closed:
            await asyncio.sleep(self.check_interval)
            await sleep_idle(fleet, self.idle_threshold, "idle-sleep")


class IdleSleepPolicy:
    """Every engine up, elastic KV first come first served, idle ones put to sleep (see
    the module)."""

    name = "idle-sleep"
    source = ("kvcached's controller: router by model, sleep manager (idle threshold "
              "300 s, checked every 60 s; vLLM sleep level 1), no reaction to pressure")
    knobs: tuple[Knob, ...] = (IDLE_THRESHOLD, CHECK_INTERVAL)
    decides: tuple[str, ...] = ("eager", "sleepable", "sleep_after", "min", "max", "shares")
    baseline = True
    elastic = True
    daemon_settings: Mapping[str, str] = FIRST_COME

    def member(self, entry: ModelEntry) -> ModelEntry:
        return dataclasses.replace(entry, eager=True, sleepable=False, sleep_after=None,
                                   min=None, max=None, shares=None)

    def start(self, knobs: Mapping[str, float], setup: Setup) -> PolicyRun:
        return IdleSleepRun(knobs["idle_threshold"], knobs["check_interval"])
