"""Which replica of a model serves a request: the :class:`Picker` seam and its registry.

The router (:mod:`kvpool.fleet.router`) keeps, per model, the live load of each replica
(:class:`ReplicaLoad`) and asks the model's picker for one; the picker may remember what
it routed (to send a prompt where its prefix's KV already is). Pickers are registered by
the name a fleet file's ``routing`` key gives (:data:`PICKERS`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence, Union

Prompt = Union[str, tuple[int, ...]]


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the router sees it when a request arrives."""

    index: int  # stable for the replica's life (restarts keep it)
    inflight: int  # requests the router sent it that have not finished
    capacity: int  # requests it runs at once (its max_num_seqs)
    ready: bool  # started and answering health checks (awake or asleep)


class Picker(Protocol):
    """Chooses a replica for one request.

    Caller's obligations: ``replicas`` is non-empty and holds at least one ``ready``
    replica; the picker returns the ``index`` of a ready one. The router calls
    :meth:`pick` from one thread (its event loop), so a picker needs no lock."""

    def pick(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> int: ...


def prompt_of(body: Mapping[str, Any]) -> Prompt:
    """The prompt of an OpenAI request body, as routing keys it: a completion's ``prompt``
    (text, or token ids), or a chat's messages joined role by role. Anything else (a
    malformed body the server will refuse) keys as the empty prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return tuple(prompt)
        if prompt and isinstance(prompt[0], str):
            return prompt[0]
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, Mapping):
                content = m.get("content")
                parts.append(f"{m.get('role')}\x1f{content if isinstance(content, str) else ''}")
        return "\x1e".join(parts)
    return ""


def _ready(replicas: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    ready = [r for r in replicas if r.ready]
    if not ready:
        raise ValueError("no ready replica (the caller must wait for one)")
    return ready


class LeastLoaded:
    """The ready replica with the lowest ``inflight / capacity`` (lowest index on ties)."""

    def pick(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> int:
        best = min(_ready(replicas),
                   key=lambda r: (r.inflight / max(r.capacity, 1), r.index))
        return best.index


class RoundRobin:
    """Ready replicas in turn, whatever their load (the baseline of the routing bench)."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, prompt: Prompt, replicas: Sequence[ReplicaLoad]) -> int:
        ready = _ready(replicas)
        return ready[next(self._turn) % len(ready)].index


PICKERS: dict[str, Callable[[], Picker]] = {
    "least_loaded": LeastLoaded,
    "round_robin": RoundRobin,
}


def make_picker(name: str) -> Picker:
    """A new picker of that registered name; an unknown one raises ValueError (the fleet
    file's validation says which names exist)."""
    try:
        return PICKERS[name]()
    except KeyError:
        raise ValueError(f"unknown routing {name!r} (one of {', '.join(sorted(PICKERS))})"
                         ) from None
