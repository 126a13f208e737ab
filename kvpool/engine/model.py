"""The Llama family (Llama, Mistral-without-sliding-window, Qwen2, Qwen3, and the
Mixture-of-Experts Mixtral, Qwen2-MoE, Qwen3-MoE) in plain PyTorch.

Module names mirror transformers' so checkpoint tensor names map one to one, except the
packed projections (``qkv_proj`` <- q/k/v_proj, ``gate_up_proj`` <- gate/up_proj; the
experts of :mod:`kvpool.engine.moe` are MLPs too).
Inputs are flat: one [T] token vector for the whole mixed batch.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpool.engine import fused
from kvpool.engine.attention import ForwardBatch, paged_attention
from kvpool.engine.layers import PackedLinear, RMSNorm
from kvpool.engine.model_config import ModelConfig
from kvpool.engine.moe import SparseMoeBlock

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.h, self.kvh, self.d = c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_proj = PackedLinear(
            c.hidden_size,
            [("q_proj", self.h * self.d), ("k_proj", self.kvh * self.d),
             ("v_proj", self.kvh * self.d)],
            bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=c.o_bias)
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
        return fused.linear(self.o_proj, o.reshape(o.shape[0], self.h * self.d))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        i = intermediate_size or c.intermediate_size
        self.gate_up_proj = PackedLinear(c.hidden_size, [("gate_proj", i), ("up_proj", i)],
                                         bias=c.mlp_bias)
        self.down_proj = nn.Linear(i, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.linear(self.down_proj, fused.silu_mul(fused.linear(self.gate_up_proj, x)))


def make_mlp(c: ModelConfig, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP: dense, or sparse where the MoE config says so."""
    moe = c.moe
    if moe is None or not moe.is_sparse(layer):
        return MLP(c)
    return SparseMoeBlock(c.hidden_size, moe, lambda size: MLP(c, size))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = make_mlp(c, layer)
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
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns the final hidden states of the ``fb.logits_indices`` rows;
    ``logits`` maps them to the
    vocabulary in float32. With tied embeddings ``lm_head.weight`` *is* the embedding."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.model = LlamaModel(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, kv_layers: KVLayers) -> torch.Tensor:
        x = self.model.embed_tokens(fb.input_ids)
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
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return fused.linear(self.lm_head, hidden).float()
