"""The sparse Mixture-of-Experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE.

A router scores every token against every expert; each token goes to its ``top_k`` experts
and gets their SwiGLU outputs summed with the routing weights (plus, for Qwen2-MoE, a
gated shared expert). Tokens are grouped by expert: the (token, expert) pairs of the whole
step are sorted by expert id, each chosen expert runs once (one gate/up and one down
matmul) on all its rows, and the weighted rows are summed back per token. The Python loop
is over experts (at most ``num_experts`` iterations a layer), never over tokens.

The module replaces the MLP only: attention, the paged KV cache, prefix caching, chunked
prefill and preemption do not know it is there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvpool.engine.model import fused
from kvpool.engine.model.config import MoEConfig


ExpertFactory = Callable[[int], nn.Module]  # intermediate size -> a SwiGLU MLP [T, H] -> [T, H]


class Experts(nn.ModuleList):
    """``num_experts`` SwiGLU MLPs, one module each (``experts.{e}``), so that every
    expert's projections take the engine's linear fast paths (the native small-row GEMM
    for decode, the prepacked oneDNN weight for larger batches). The loader fills them from
    per-expert tensors or from transformers 5's fused 3-D ``experts.gate_up_proj`` /
    ``experts.down_proj``."""

    def __init__(self, num_experts: int, intermediate: int, make_expert: ExpertFactory
                 ) -> None:
        super().__init__(make_expert(intermediate) for _ in range(num_experts))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids [T, k] (the expert of each of a token's k slots) and
        topk_weights [T, k] (its routing weight, in the dtype the scaling happens in).
        Returns sum over slots of weight * expert(x) [T, H] in x's dtype."""
        t, k = topk_ids.shape
        if t == 0:
            return torch.zeros_like(x)
        flat = topk_ids.reshape(-1)  # slot s = token * k + j
        # Stable: within an expert, rows keep token order (deterministic results).
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self)).tolist()
        rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
        outs: list[torch.Tensor] = []
        start = 0
        for e, n in enumerate(counts):  # each chosen expert once, on all its rows
            if n:
                outs.append(self[e](rows[start:start + n]))
                start += n
        grouped = torch.cat(outs) if len(outs) > 1 else outs[0]
        # Back to slot order by a gather (cheaper than a scatter-add here), weight (float32
        # weights: scaled in float32, rounded per slot, as transformers), and sum each
        # token's k slots; for k = 2 the sum is exactly transformers' accumulation.
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.shape[0], device=order.device)
        slots = (grouped.index_select(0, unsort) * topk_weights.reshape(-1, 1)).to(x.dtype)
        return slots.view(t, k, -1).sum(dim=1)


class SparseMoeBlock(nn.Module):
    """Router (``gate``, a bias-free [E, H] linear) + :class:`Experts` built by
    ``make_expert``, and with ``c.shared_expert_intermediate_size`` a shared expert (from
    the same factory) and its ``shared_expert_gate`` [1, H]. Attribute names mirror
    transformers' so checkpoint tensor names map one to one (``mlp.gate``,
    ``mlp.experts.{e}``, ``mlp.shared_expert``, ``mlp.shared_expert_gate``)."""

    def __init__(self, hidden: int, c: MoEConfig, make_expert: ExpertFactory) -> None:
        super().__init__()
        self.top_k = c.top_k
        self.norm_topk_prob = c.norm_topk_prob
        self.weights_in_model_dtype = c.weights_in_model_dtype
        self.gate = nn.Linear(hidden, c.num_experts, bias=False)
        self.experts = Experts(c.num_experts, c.intermediate_size, make_expert)
        shared = c.shared_expert_intermediate_size
        self.shared_expert = make_expert(shared) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared else None

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
        out: torch.Tensor = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            gate = torch.sigmoid(fused.linear(self.shared_expert_gate, x))
            shared: torch.Tensor = self.shared_expert(x)
            out = out + gate * shared
        return out
