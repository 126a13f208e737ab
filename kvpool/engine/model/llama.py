"""The Llama family (Llama, Mistral-without-sliding-window, Qwen2, Qwen3, and the
Mixture-of-Experts Mixtral, Qwen2-MoE, Qwen3-MoE) in plain PyTorch.

Module names mirror transformers' so checkpoint tensor names map one to one, except the
packed projections (``qkv_proj`` <- q/k/v_proj, ``gate_up_proj`` <- gate/up_proj; the
experts of :mod:`kvpool.engine.model.moe` are MLPs too).
Inputs are flat: one [T] token vector for the whole mixed batch.

Tensor parallelism: built with a :class:`~kvpool.engine.tp.collective.Collective` of
``size`` ranks, each rank's model holds its share (:mod:`kvpool.engine.tp.layers`): its
``num_heads / size`` query heads and ``num_kv_heads / size`` KV heads (its KV cache holds
those only), its slice of the MLP, of the vocabulary in the embedding and the lm_head.
After each row-parallel projection every rank holds the whole residual stream, so the
norms run whole everywhere. Mixture-of-Experts models are not split
(:func:`~kvpool.engine.tp.layers.check_divisible`).
"""

from __future__ import annotations

import torch
from torch import nn

from kvpool.engine.model import fused
from kvpool.engine.model.attention import ForwardBatch, paged_attention
from kvpool.engine.tp.collective import SINGLE, Collective
from kvpool.engine.model.layers import PackedLinear, RMSNorm
from kvpool.engine.model.config import ModelConfig
from kvpool.engine.model.moe import SparseMoeBlock
from kvpool.engine.tp.layers import (ParallelLMHead, RowParallelLinear,
                                     VocabParallelEmbedding, check_divisible)

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)


class Attention(nn.Module):
    """This rank's heads: ``h`` query heads, ``kvh`` KV heads."""

    def __init__(self, c: ModelConfig, tp: Collective = SINGLE) -> None:
        super().__init__()
        self.h, self.kvh, self.d = c.num_heads // tp.size, c.num_kv_heads // tp.size, c.head_dim
        self.qkv_proj = PackedLinear(
            c.hidden_size,
            [("q_proj", self.h * self.d), ("k_proj", self.kvh * self.d),
             ("v_proj", self.kvh * self.d)],
            bias=c.qkv_bias, tp_rank=tp.rank, tp_size=tp.size)
        self.o_proj = RowParallelLinear(c.num_heads * self.d, c.hidden_size, c.o_bias, tp)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.d, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, c.rms_norm_eps)
        self.qk_norm = c.qk_norm

    def forward(self, x: torch.Tensor, fb: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor],
                last: bool = False) -> torch.Tensor:
        """Stores every row's K/V; with ``last`` (the final layer, when the batch allows it:
        ``fb.varlen_last``) returns the output of the ``fb.logits_indices`` rows only."""
        t = x.shape[0]
        # Tensor.split is not annotated in torch
        q, k, v = fused.linear(self.qkv_proj, x).split(  # type: ignore[no-untyped-call]
            [self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q = q.view(t, self.h, self.d)  # views into the packed qkv rows (no copies)
        k, v = k.view(t, self.kvh, self.d), v.view(t, self.kvh, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        assert fb.rope is not None
        q, k = fused.rotary_(q, k, fb.rope)
        o = paged_attention(q, k, v, kv[0], kv[1], fb, last)
        return self.o_proj.project(o.reshape(o.shape[0], self.h * self.d))


class MLP(nn.Module):
    """SwiGLU; under tensor parallelism this rank's ``intermediate / size`` columns."""

    def __init__(self, c: ModelConfig, intermediate_size: int | None = None,
                 tp: Collective = SINGLE) -> None:
        super().__init__()
        i = intermediate_size or c.intermediate_size
        il = i // tp.size
        self.gate_up_proj = PackedLinear(c.hidden_size, [("gate_proj", il), ("up_proj", il)],
                                         bias=c.mlp_bias, tp_rank=tp.rank, tp_size=tp.size)
        self.down_proj = RowParallelLinear(i, c.hidden_size, c.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.project(fused.silu_mul(fused.linear(self.gate_up_proj, x)))


def make_mlp(c: ModelConfig, layer: int, tp: Collective = SINGLE) -> nn.Module:
    """Layer ``layer``'s MLP: dense, or sparse where the MoE config says so (never split:
    :func:`check_divisible` refuses MoE models over several ranks)."""
    moe = c.moe
    if moe is None or not moe.is_sparse(layer):
        return MLP(c, tp=tp)
    return SparseMoeBlock(c.hidden_size, moe, lambda size: MLP(c, size))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0, tp: Collective = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(c, tp)
        self.mlp = make_mlp(c, layer, tp)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch,
                kv: tuple[torch.Tensor, torch.Tensor], last: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream travels next to the layer output (vLLM's convention): returns
        (mlp output, residual); the next norm adds them. ``residual`` None: ``x`` is the
        embedding. With ``last``, both come back for the ``fb.logits_indices`` rows only."""
        h, residual = fused.rmsnorm(x, self.input_layernorm.weight,
                                    self.input_layernorm.eps, residual)
        a = self.self_attn(h, fb, kv, last)
        if last:
            residual = residual[fb.logits_indices]
        h, residual = fused.rmsnorm(a, self.post_attention_layernorm.weight,
                                    self.post_attention_layernorm.eps, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig, tp: Collective = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(c, i, tp) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns the final hidden states of the ``fb.logits_indices`` rows;
    ``logits`` maps them to the
    vocabulary in float32. With tied embeddings ``lm_head.weight`` *is* the embedding.
    ``tp``: this rank's collective (see the module); raises ValueError (one line) for a
    model that does not split ``tp.size`` ways."""

    def __init__(self, c: ModelConfig, tp: Collective = SINGLE) -> None:
        super().__init__()
        why = check_divisible(c, tp.size)
        if why is not None:
            raise ValueError(why)
        self.config = c
        self.tp = tp
        self.model = LlamaModel(c, tp)
        self.lm_head = ParallelLMHead(c.hidden_size, c.vocab_size, tp)
        self.tie_weights()

    @property
    def num_local_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) of this rank."""
        return self.config.num_heads // self.tp.size, self.config.num_kv_heads // self.tp.size

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, kv_layers: KVLayers) -> torch.Tensor:
        x = self.model.embed_tokens.lookup(fb.input_ids)
        residual = None
        n = len(self.model.layers)
        for i, (layer, kv) in enumerate(zip(self.model.layers, kv_layers)):
            x, residual = layer(x, residual, fb, kv, i == n - 1 and fb.varlen_last is not None)
        assert residual is not None
        if fb.varlen_last is None and fb.logits_indices.shape[0] != x.shape[0]:
            # rows that get sampled only (all rows sampled: logits_indices is 0..T-1)
            x, residual = x[fb.logits_indices], residual[fb.logits_indices]
        norm = self.model.norm
        return fused.rmsnorm(x, norm.weight, norm.eps, residual)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[S, vocab] float32 on rank 0; None on the other ranks (they send theirs)."""
        return self.lm_head.logits(hidden)
