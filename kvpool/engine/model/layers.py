"""Small building blocks of the Llama family: RMSNorm, rotary embedding, packed linear."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like transformers (so logits match)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class PackedLinear(nn.Linear):
    """One matmul for several checkpoint projections stacked on the output dim (q/k/v,
    gate/up): fewer kernel launches per layer, which is what dominates small-batch decode.
    ``parts`` names the checkpoint sub-modules and their output sizes, in order.

    Column-parallel under tensor parallelism (:mod:`kvpool.engine.tp.layers`): rank
    ``tp_rank`` of ``tp_size`` holds rows ``[tp_rank * n, (tp_rank + 1) * n)`` of each
    part, ``n`` being the part's size given here (this rank's)."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], bias: bool,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(in_features, sum(n for _, n in parts), bias=bias)
        self.parts = parts
        self.tp_rank, self.tp_size = tp_rank, tp_size


class RotaryEmbedding:
    """cos/sin tables for the non-interleaved ("rotate_half") rotary embedding.

    ``scaling`` is the parsed rope config: rope_type default | linear | llama3.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any],
                 device: torch.device) -> None:
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = scaling.get("rope_type", "default")
        if rope_type == "linear":
            inv = inv / float(scaling["factor"])
        elif rope_type == "llama3":
            inv = _llama3_inv_freq(inv, scaling)
        self.inv_freq = inv.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns cos, sin of shape [T, 1, head_dim] for broadcasting over heads.

        With ``max_position`` (>= every position) the rows come from a table computed once
        for positions ``[0, n)`` (grown by doubling, up to ``TABLE_MAX``); the table rows
        are bit-identical to computing them per step."""
        if max_position is not None and max_position < self.TABLE_MAX:
            if self._table is None or self._table[0].shape[0] <= max_position \
                    or self._table[0].dtype != dtype:
                n = max(256, 1 << max_position.bit_length())
                self._table = self._compute(torch.arange(n, device=self.inv_freq.device), dtype)
            cos, sin = self._table
            return cos[positions], sin[positions]
        return self._compute(positions, dtype)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What :func:`kvpool.engine.model.fused.rotary_` takes: (cos_table, sin_table, index),
        tables [n, 1, D] with ``table[index[t]]`` the row of token t (no per-token copy)."""
        if max_position < self.TABLE_MAX:
            self.cos_sin(positions[:1], dtype, max_position)  # builds or grows the table
            assert self._table is not None
            return self._table[0], self._table[1], positions
        cos, sin = self._compute(positions, dtype)
        return cos, sin, torch.arange(positions.shape[0], device=positions.device)

    TABLE_MAX = 1 << 16
    _table: tuple[torch.Tensor, torch.Tensor] | None = None

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _llama3_inv_freq(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)
