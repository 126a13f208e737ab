"""The ranks of a tensor-parallel model as threads of the test process: a
:class:`~kvpool.engine.tp.collective.Collective` whose calls meet at a barrier, so one test
can run every rank's share of a model side by side without processes or sockets."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class ThreadGroup:
    """``size`` ranks; :meth:`rank` is one rank's collective."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list[torch.Tensor | None] = [None] * size

    def rank(self, rank: int) -> ThreadRank:
        return ThreadRank(self, rank)

    def run(self, fn: Callable[[ThreadRank], T]) -> list[T]:
        """``fn(rank)`` on every rank at once; their results in rank order."""
        with ThreadPoolExecutor(self.size) as ex:
            futures = [ex.submit(fn, self.rank(r)) for r in range(self.size)]
            return [f.result() for f in futures]


class ThreadRank:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self._rank = group, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.group.size

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        g = self.group
        g.slots[self._rank] = x.clone()
        g.barrier.wait()
        parts = [t for t in g.slots if t is not None]
        g.barrier.wait()
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        total = parts[0]
        for p in parts[1:]:
            total = total + p  # rank order: the same sum on every rank
        return x.copy_(total)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = self._exchange(x)
        return torch.cat(parts, dim=-1) if self._rank == 0 else None
