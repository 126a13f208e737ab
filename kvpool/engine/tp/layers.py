"""The tensor-parallel layers, and which part of each checkpoint tensor a rank holds.

Megatron-style splits over ``size`` ranks, rank ``rank`` holding:

* column-parallel :class:`~kvpool.engine.model.layers.PackedLinear` (q/k/v, gate/up): rows
  ``[rank * n, (rank + 1) * n)`` of every part (``n`` = the part's rows / size): its
  heads of q, its KV heads of k and v, its share of the MLP's intermediate dimension;
  no communication.
* :class:`RowParallelLinear` (o_proj, down_proj): the matching input columns; the
  partial products are summed over the ranks (:meth:`~Collective.all_reduce`). A bias
  is added once: rank 0 holds it, the other ranks hold zeros.
* :class:`VocabParallelEmbedding`: rows ``[rank * V/size, ...)`` of the vocabulary; a
  token outside them looks up zeros, and the ranks' rows are summed.
* :class:`ParallelLMHead`: the same vocabulary rows of the output projection (tied to
  the embedding's shard when the checkpoint ties them); rank 0 gathers the logits.
* everything else (norms, q/k norms) whole on every rank.

With ``size == 1`` every layer is its plain counterpart: no call into the collective,
and :func:`cut_of` answers None (the loader reads whole tensors, as it always did).
:func:`check_divisible` says, in one line, why a model cannot be split ``size`` ways.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.engine.model import fused
from kvpool.engine.tp.collective import SINGLE, Collective
from kvpool.engine.model.layers import PackedLinear
from kvpool.engine.model.config import ModelConfig


class Cut(NamedTuple):
    """The part of a checkpoint tensor one rank holds: ``length`` indices from ``start``
    along ``dim`` (0: rows, 1: columns) of a tensor whose extent there is
    ``size * length``. ``zeros``: the rank holds zeros of that shape instead (a
    row-parallel bias off rank 0); nothing is read."""

    dim: int
    start: int
    length: int
    size: int
    zeros: bool = False


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` over this rank's input columns; :meth:`project` sums over ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: Collective = SINGLE) -> None:
        assert in_features % tp.size == 0
        super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp = tp

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in/size] -> the whole layer's output [T, out], on every rank."""
        y = fused.linear(self, x)
        return y if self.tp.size == 1 else self.tp.all_reduce(y)


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` over this rank's vocabulary rows (see the module)."""

    def __init__(self, vocab_size: int, dim: int, tp: Collective = SINGLE) -> None:
        assert vocab_size % tp.size == 0
        super().__init__(vocab_size // tp.size, dim)
        self.tp = tp

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] (whole-vocabulary ids) -> [T, dim] on every rank."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        n = self.num_embeddings
        local = ids - self.tp.rank * n
        outside = (local < 0) | (local >= n)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(nn.Linear):
    """The output projection over this rank's vocabulary rows (see the module)."""

    def __init__(self, dim: int, vocab_size: int, tp: Collective = SINGLE) -> None:
        assert vocab_size % tp.size == 0
        super().__init__(dim, vocab_size // tp.size, bias=False)
        self.tp = tp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [S, dim] -> float32 logits [S, vocab] on rank 0; None elsewhere."""
        y = fused.linear(self, hidden).float()
        if self.tp.size == 1:
            return y
        if y.shape[0] == 0:  # a step that samples nothing (every rank knows it): no call
            return y.new_empty(0, y.shape[1] * self.tp.size) if self.tp.rank == 0 else None
        return self.tp.gather_last(y)


def cut_of(mod: nn.Module, leaf: str, rows: int) -> Cut | None:
    """Which part of the checkpoint tensor behind ``mod``'s parameter ``leaf`` this rank
    holds (``rows``: the rows of it in this rank's parameter; for a PackedLinear, of one
    part); None: the whole tensor."""
    if isinstance(mod, PackedLinear):
        size, rank = mod.tp_size, mod.tp_rank
        return None if size == 1 else Cut(0, rank * rows, rows, size)
    if isinstance(mod, (VocabParallelEmbedding, ParallelLMHead)):
        size, rank = mod.tp.size, mod.tp.rank
        return None if size == 1 else Cut(0, rank * rows, rows, size)
    if isinstance(mod, RowParallelLinear):
        size, rank = mod.tp.size, mod.tp.rank
        if size == 1 or (leaf == "bias" and rank == 0):
            return None
        if leaf == "bias":
            return Cut(0, 0, rows, 1, zeros=True)
        cols = mod.in_features
        return Cut(1, rank * cols, cols, size)
    return None


def check_divisible(c: ModelConfig, size: int) -> str | None:
    """Why ``c`` cannot be split over ``size`` ranks (one line), or None when it can."""
    if size < 1:
        return f"tensor_parallel_size must be >= 1, not {size}"
    if size == 1:
        return None
    if c.moe is not None:
        return (f"tensor parallelism does not split Mixture-of-Experts models "
                f"({c.model_type}) yet")
    for what, n in (("attention heads", c.num_heads), ("KV heads", c.num_kv_heads),
                    ("intermediate size", c.intermediate_size),
                    ("vocabulary size", c.vocab_size)):
        if n % size:
            return f"the model's {what} ({n}) do not divide by tensor_parallel_size {size}"
    return None
