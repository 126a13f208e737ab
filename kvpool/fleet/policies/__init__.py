"""How a fleet shares its device between its models: one :class:`FleetPolicy` per
``[fleet] policy`` name, in :data:`FLEET_POLICIES` (a :class:`kvpool.registry.Registry`).

``kvpool`` (the default: the daemon arbitrates) and three baselines built from what the
peers do, for benchmarking the fleet against them on the same engines, checkpoints,
budget and workload: ``swap`` (load on demand, unload the least recently used idle
model: Ollama, llama-swap), ``idle-sleep`` (elastic KV first come first served, idle
models put to sleep: kvcached) and ``reconcile`` (KV ceilings set at an interval by an
arbiter out of the path: AIBrix ModelClaim). The seam is :mod:`.base`; each policy's
module says where its behaviour comes from.
"""

from __future__ import annotations

from kvpool.fleet.policies.base import (Control, FleetPolicy, Knob, PolicyError, PolicyRun,
                                        Setup)
from kvpool.fleet.policies.idle_sleep import IdleSleepPolicy
from kvpool.fleet.policies.kvpool import KvpoolPolicy
from kvpool.fleet.policies.reconcile import ReconcilePolicy
from kvpool.fleet.policies.swap import SwapPolicy
from kvpool.registry import Registry

__all__ = ["FLEET_POLICIES", "Control", "FleetPolicy", "Knob", "PolicyError", "PolicyRun",
           "Setup", "knob_owners"]

#: every fleet policy by the name a fleet file's ``[fleet] policy`` gives
FLEET_POLICIES: Registry[FleetPolicy] = Registry("policy")
for _policy in (KvpoolPolicy(), SwapPolicy(), IdleSleepPolicy(), ReconcilePolicy()):
    FLEET_POLICIES.register(_policy.name, _policy)


def knob_owners() -> dict[str, tuple[str, ...]]:
    """Every policy knob's name -> the policies that have it."""
    owners: dict[str, tuple[str, ...]] = {}
    for policy in FLEET_POLICIES.entries():
        for knob in policy.knobs:
            owners[knob.name] = (*owners.get(knob.name, ()), policy.name)
    return owners
