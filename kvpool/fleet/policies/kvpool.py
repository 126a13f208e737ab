"""``policy = "kvpool"`` (the default): the fleet adds no memory policy of its own.

Members are elastic, sleepable tenants of the daemon started as their entries say
(``eager``, ``sleep_after``, ``min``/``max``/``shares``, ``weights``); the daemon
arbitrates (fair shares, reclaim, pressure sleep of an idle member), the fleet routes,
wakes and supervises (docs/ARCHITECTURE.md, "Fleet"). Nothing runs on the policy's own
clock and every member may start whenever a request asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvpool.fleet.entries import ModelEntry
from kvpool.fleet.member import Member
from kvpool.fleet.policies.base import Control, Knob, PolicyRun, Setup


class _Nothing:
    """The run of a policy that leaves everything to the daemon."""

    def may_start(self, m: Member, fleet: Control) -> bool:
        return True

    def released(self, m: Member, fleet: Control) -> None:
        return None

    async def run(self, fleet: Control) -> None:
        return None


class KvpoolPolicy:
    """Today's fleet: the daemon arbitrates (see the module)."""

    name = "kvpool"
    source = "kvpool's own: the daemon arbitrates (fair shares, reclaim, pressure sleep)"
    knobs: tuple[Knob, ...] = ()
    decides: tuple[str, ...] = ()
    baseline = False
    elastic = True
    daemon_settings: Mapping[str, str] = MappingProxyType({})

    def member(self, entry: ModelEntry) -> ModelEntry:
        return entry

    def start(self, knobs: Mapping[str, float], setup: Setup) -> PolicyRun:
        return _Nothing()


#: the one run of the default policy (it keeps no state)
NOTHING: PolicyRun = _Nothing()
