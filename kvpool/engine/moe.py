"""The sparse Mixture-of-Experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE.

A router scores every token against every expert; each token goes to its ``top_k`` experts
and gets their SwiGLU outputs summed with the routing weights (plus, for Qwen2-MoE, a
gated shared expert). Tokens are grouped by expert: the (token, expert) pairs of the whole
step are sorted by expert id, each chosen expert runs one gate/up and one down matmul on
all its rows, and the weighted rows are added back to their tokens with one
``index_add_``. The Python loop is over experts (at most ``num_experts`` iterations a
layer), never over tokens.

The module replaces the MLP only: attention, the paged KV cache, prefix caching, chunked
prefill and preemption do not know it is there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.engine import fused
from kvpool.engine.model_config import MoEConfig


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs stored as two 3-D parameters, the layout transformers 5
    keeps in memory: ``gate_up_proj`` [E, 2 * I, H] (gate rows, then up rows) and
    ``down_proj`` [E, H, I]. The loader fills them from that fused layout or from
    per-expert tensors (``experts.{e}.gate_proj`` / ``w1`` and so on)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids [T, k] (expert of each of a token's k slots) and topk_weights
        [T, k] (its routing weight, in the dtype the scaling happens in). Returns
        sum over slots of weight * expert(x) [T, H] in x's dtype."""
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        # Stable: within an expert, rows keep token order (deterministic accumulation).
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = torch.div(order, k, rounding_mode="floor")
        rows = x.index_select(0, token)  # [T * k, H], grouped by expert
        out_rows = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            h = fused.silu_mul(F.linear(rows[start:end], self.gate_up_proj[e]))
            torch.mm(h, self.down_proj[e].t(), out=out_rows[start:end])
            start = end
        w = topk_weights.reshape(-1).index_select(0, order)[:, None]
        scaled = (out_rows * w).to(x.dtype)  # float32 weights: scaled in float32 (Mixtral)
        out = torch.zeros_like(x)
        out.index_add_(0, token, scaled)
        return out


class SparseMoeBlock(nn.Module):
    """Router (``gate``, a bias-free [E, H] linear) + :class:`Experts`, and optionally a
    shared expert (any [T, H] -> [T, H] module, built by the caller) with its
    ``shared_expert_gate`` [1, H]. Attribute names mirror transformers' so checkpoint
    tensor names map one to one (``mlp.gate``, ``mlp.experts``, ``mlp.shared_expert``,
    ``mlp.shared_expert_gate``)."""

    def __init__(self, hidden: int, c: MoEConfig, shared_expert: nn.Module | None = None
                 ) -> None:
        super().__init__()
        self.top_k = c.top_k
        self.norm_topk_prob = c.norm_topk_prob
        self.weights_in_model_dtype = c.weights_in_model_dtype
        self.gate = nn.Linear(hidden, c.num_experts, bias=False)
        self.experts = Experts(c.num_experts, hidden, c.intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_expert else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [T, k], topk_weights [T, k]): softmax over all experts in float32, the
        k largest, renormalised to sum 1 when ``norm_topk_prob``."""
        probs = torch.softmax(fused.linear(self.gate, x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            gate = torch.sigmoid(fused.linear(self.shared_expert_gate, x))
            out = out + gate * self.shared_expert(x)
        return out
