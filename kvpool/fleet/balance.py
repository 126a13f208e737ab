"""Which replica of a model serves a request: the :class:`Picker` seam and its registry.

The router (:mod:`kvpool.fleet.router`) keeps, per model, the live load of each replica
(:class:`ReplicaLoad`) and asks the model's picker for one; the picker may remember what
it routed (to send a prompt where its prefix's KV already is). Pickers are registered by
the name a fleet file's ``routing`` key gives (:data:`PICKERS`). A router that also
counts why a replica was chosen (its routed-by-reason counter) calls
:func:`choose` instead of :meth:`Picker.pick`: it works with every picker.
"""

from __future__ import annotations

import itertools
from typing import Callable, Protocol, Sequence, runtime_checkable

from kvpool.fleet.loads import REASONS, Pick, ReplicaLoad, least_loaded, ready_replicas
from kvpool.fleet.prefix_picker import PrefixAffinity
from kvpool.fleet.prompt import Prompt, prompt_of

__all__ = ["PICKERS", "REASONS", "Explaining", "LeastLoaded", "Pick", "Picker",
           "PrefixAffinity", "Prompt", "Remembering", "ReplicaLoad", "RoundRobin", "choose", "make_picker",
           "prompt_of"]


class Picker(Protocol):
    """Chooses a replica for one request.

    Caller's obligations: ``replicas`` is non-empty and holds at least one ``ready``
    replica; the picker returns the ``index`` of a ready one. The router calls
    :meth:`pick` from one thread (its event loop), so a picker needs no lock."""

    def pick(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> int: ...


@runtime_checkable
class Explaining(Picker, Protocol):
    """A picker that also says why it chose (:class:`Pick`); :meth:`choose` is
    :meth:`pick` with the reason, under the same obligations (call one or the other per
    request, not both: a picker may remember each call)."""

    def choose(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> Pick: ...


@runtime_checkable
class Remembering(Picker, Protocol):
    """A picker that remembers what it sent to each replica (an estimate of its cache).

    Caller's obligation: call :meth:`forget` when a replica's server restarts (its cache
    is empty), before the next :meth:`~Picker.pick` that may choose it."""

    def forget(self, index: int) -> None: ...


def choose(picker: Picker, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> Pick:
    """``picker``'s choice with its reason, under :class:`Picker`'s obligations. A picker
    that does not explain itself gets ``only`` (one ready replica) or ``load``."""
    if isinstance(picker, Explaining):
        return picker.choose(prompt, replicas)
    index = picker.pick(prompt, replicas)
    return Pick(index, "only" if sum(r.ready for r in replicas) == 1 else "load")


class LeastLoaded:
    """The ready replica with the lowest ``inflight / capacity`` (lowest index on ties)."""

    def pick(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> int:
        return self.choose(prompt, replicas).index

    def choose(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> Pick:
        ready = ready_replicas(replicas)
        return Pick(least_loaded(ready).index, "only" if len(ready) == 1 else "load")


class RoundRobin:
    """Ready replicas in turn, whatever their load (the baseline of the routing bench)."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> int:
        return self.choose(prompt, replicas).index

    def choose(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> Pick:
        ready = ready_replicas(replicas)
        return Pick(ready[next(self._turn) % len(ready)].index,
                    "only" if len(ready) == 1 else "turn")


PICKERS: dict[str, Callable[[], Picker]] = {
    "least_loaded": LeastLoaded,
    "round_robin": RoundRobin,
    "prefix": PrefixAffinity,
}


def make_picker(name: str) -> Picker:
    """A new picker of that registered name; an unknown one raises ValueError (the fleet
    file's validation says which names exist)."""
    try:
        return PICKERS[name]()
    except KeyError:
        raise ValueError(f"unknown routing {name!r} (one of {', '.join(sorted(PICKERS))})"
                         ) from None
