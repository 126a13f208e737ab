"""Which replica of a model serves a request: the :class:`Picker` seam and its registry.

The router (:mod:`kvpool.fleet.router`) keeps, per model, the live load of each replica
(:class:`ReplicaLoad`) and asks the model's picker for one; the picker may remember what
it routed (to send a prompt where its prefix's KV already is). Pickers are registered by
the name a fleet file's ``routing`` key gives (:data:`PICKERS`, a
:class:`kvpool.registry.Registry` of factories). A picker says why it
chose (a :class:`Pick`), which the router counts by reason.
"""

from __future__ import annotations

import itertools
from typing import Callable, Protocol, Sequence, runtime_checkable

from kvpool.fleet.loads import REASONS, Pick, ReplicaLoad, least_loaded, ready_replicas
from kvpool.fleet.prefix_picker import PrefixAffinity
from kvpool.fleet.prompt import Prompt, prompt_of
from kvpool.registry import Registry

__all__ = ["PICKERS", "REASONS", "LeastLoaded", "Pick", "Picker", "PrefixAffinity", "Prompt",
           "Remembering", "ReplicaLoad", "RoundRobin", "choose", "make_picker", "prompt_of"]


class Picker(Protocol):
    """Chooses a replica for one request and says why (:class:`Pick`).

    Caller's obligations: ``replicas`` is non-empty and holds at least one ``ready``
    replica; the picker returns the ``index`` of a ready one. Call :meth:`choose` once
    per request (a picker may remember each call). The router calls it from one thread
    (its event loop), so a picker needs no lock."""

    def choose(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> Pick: ...


@runtime_checkable
class Remembering(Picker, Protocol):
    """A picker that remembers what it sent to each replica (an estimate of its cache).

    Caller's obligation: call :meth:`forget` when a replica's server restarts (its cache
    is empty), before the next :meth:`~Picker.choose` that may choose it."""

    def forget(self, index: int) -> None: ...


def choose(picker: Picker, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> Pick:
    """``picker``'s choice with its reason, under :class:`Picker`'s obligations."""
    return picker.choose(prompt, replicas)


class LeastLoaded:
    """The ready replica with the lowest ``inflight / capacity`` (lowest index on ties)."""

    def choose(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> Pick:
        ready = ready_replicas(replicas)
        return Pick(least_loaded(ready).index, "only" if len(ready) == 1 else "load")


class RoundRobin:
    """Ready replicas in turn, whatever their load (the baseline of the routing bench)."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> Pick:
        ready = ready_replicas(replicas)
        return Pick(ready[next(self._turn) % len(ready)].index,
                    "only" if len(ready) == 1 else "turn")


#: a new picker by the fleet file's ``routing`` name
PICKERS: Registry[Callable[[], Picker]] = Registry("routing")
PICKERS.register("least_loaded", LeastLoaded)
PICKERS.register("round_robin", RoundRobin)
PICKERS.register("prefix", PrefixAffinity)


def make_picker(name: str) -> Picker:
    """A new picker of that registered name; an unknown one raises
    :class:`kvpool.registry.UnknownName` (a ValueError; the fleet file's validation says
    which names exist)."""
    return PICKERS.lookup(name)()
