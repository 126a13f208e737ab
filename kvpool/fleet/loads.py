"""What a picker sees of a model's replicas (:class:`ReplicaLoad`) and what it answers
when asked why (:class:`Pick`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: why a replica was chosen (the label of the router's routed-by-reason counter)
REASONS = (
    "prefix",  # it was sent this prompt's prefix before (its KV is likely cached there)
    "load",  # the least loaded (no replica holds the prefix, or the one that does is busy)
    "only",  # the only ready replica
    "turn",  # its turn (round-robin)
)


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the router sees it when a request arrives."""

    index: int  # stable for the replica's life (restarts keep it)
    inflight: int  # requests the router sent it that have not finished
    capacity: int  # requests it runs at once (its max_num_seqs)
    ready: bool  # started and answering health checks (awake or asleep)

    @property
    def load(self) -> float:
        """``inflight / capacity`` (a capacity below 1 counts as 1)."""
        return self.inflight / max(self.capacity, 1)


@dataclass(frozen=True)
class Pick:
    """A picker's answer with its reason: the chosen replica's ``index``, ``reason`` one
    of :data:`REASONS`, and ``matched_blocks``, how many of the prompt's first blocks
    the picker had sent to that replica before (0 for pickers that do not track it)."""

    index: int
    reason: str
    matched_blocks: int = 0


def ready_replicas(replicas: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    """The ready ones; none raises ValueError (the router must wait for one)."""
    ready = [r for r in replicas if r.ready]
    if not ready:
        raise ValueError("no ready replica (the caller must wait for one)")
    return ready


def least_loaded(ready: Sequence[ReplicaLoad]) -> ReplicaLoad:
    """The replica with the lowest :attr:`ReplicaLoad.load`, the lowest index on ties."""
    return min(ready, key=lambda r: (r.load, r.index))
