"""Collective: how the ranks of one tensor-parallel engine combine their tensors.

The model's parallel layers (:mod:`kvpool.engine.tp.layers`) are given one in their
constructor; they call it at fixed points of the forward pass, the same calls in the same
order on every rank (all ranks run the same step entries, so they always agree).

Two implementations:

* :class:`SingleRank` (``SINGLE``): one rank, every call returns its input. A model built
  without tensor parallelism holds it and its layers skip the calls altogether.
* :class:`GlooGroup`: the ranks' processes on one host, joined over a TCP store through a
  ``torch.distributed`` gloo process group of their own (no global default group, so a
  process may hold several and tests may build engines side by side). A rank that died
  makes the others' next call raise RuntimeError (gloo's connection error, or its
  ``timeout``).
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol

import torch
from torch._C._distributed_c10d import (GatherOptions, PrefixStore, ProcessGroupGloo,
                                        TCPStore)

#: how long a collective may wait for the other ranks before it raises
COLLECTIVE_TIMEOUT_S = 300.0


class Collective(Protocol):
    """What the parallel layers need of the ranks: ``rank`` in ``[0, size)``.

    Caller's obligations: every rank makes the same calls, in the same order, with
    tensors of the same shape and dtype (contiguous, on CPU for gloo); each call blocks
    until every rank made it."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        ...

    def gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along the last dimension, in rank order, on
        rank 0; None on the other ranks."""
        ...


class SingleRank:
    """The one rank of an engine without tensor parallelism."""

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        return x


SINGLE = SingleRank()


class GlooGroup:
    """Rank ``rank`` of ``size`` processes that meet at a TCP store (see the module).

    Rank 0 opens the store (``TCPStore`` on ``host``, an ephemeral port: :attr:`port`,
    which the other ranks are given); :meth:`join` forms the process group and blocks
    until every rank joined (or ``timeout_s``)."""

    def __init__(self, rank: int, size: int, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        assert 0 <= rank < size, f"rank {rank} of {size}"
        self._rank, self._size = rank, size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = TCPStore(host, port, size, rank == 0, timeout=self.timeout,
                              wait_for_workers=False)
        self.port = self.store.port
        # Any: torch's stubs list the collectives on ProcessGroup only; the gloo backend
        # object has them (allreduce, gather) at run time
        self._pg: Any = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def announce(self) -> None:
        """(ranks > 0) Tell rank 0 this rank is about to join (before :meth:`join`)."""
        self.store.set(f"kvpool-tp/announced/{self._rank}", "1")

    def announced(self, rank: int) -> bool:
        """(rank 0) Whether ``rank`` announced itself (does not wait)."""
        return self.store.check([f"kvpool-tp/announced/{rank}"])

    def join(self) -> None:
        """Form the process group (blocks until every rank joined)."""
        self._pg = ProcessGroupGloo(PrefixStore("kvpool-tp", self.store), self._rank,
                                    self._size, self.timeout)

    def _group(self) -> Any:
        assert self._pg is not None, "join() first"
        return self._pg

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._group().allreduce([x]).wait()
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        x = x.contiguous()
        opts = GatherOptions()
        opts.rootRank = 0
        if self._rank == 0:
            parts = [torch.empty_like(x) for _ in range(self._size)]
            self._group().gather([parts], [x], opts).wait()
            return torch.cat(parts, dim=-1)
        self._group().gather([], [x], opts).wait()
        return None

    def close(self) -> None:
        """Leave the group (idempotent); the store closes with the object."""
        self._pg = None
