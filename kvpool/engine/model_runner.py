"""ModelRunner: turns a scheduled batch into a ForwardBatch and runs the model.

The attention backend is fixed at construction (see :func:`attention.select_backend`);
the native one gets its per-step metadata as a :class:`VarlenBatch` and writes into one
persistent output workspace of ``max_num_tokens`` rows (grown if a step ever needs more).
"""

from __future__ import annotations

import torch

from kvpool.engine import fused, native
from kvpool.engine.attention import (AttentionBackend, DecodeGroup, ForwardBatch,
                                     PrefillGroup, VarlenBatch, select_backend)
from kvpool.engine.kv_cache import KVCache
from kvpool.engine.layers import RotaryEmbedding
from kvpool.engine.model import LlamaForCausalLM
from kvpool.engine.request import Request


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int,
                 device: torch.device, dtype: torch.dtype,
                 attention_backend: AttentionBackend = "auto", max_num_tokens: int = 512,
                 prepack: bool = True) -> None:
        c = model.config
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, device)
        self.backend = select_backend(attention_backend, device, dtype, c.num_heads,
                                      c.num_kv_heads, c.head_dim)
        self._attn_out = torch.empty(0)
        if device.type == "cpu":
            native.tune_malloc()
            # bf16: no prepacked copy (it would be fp32); shared weights: none either
            if dtype == torch.float32 and prepack:
                fused.prepack(model)
        if self.backend == "native":
            self._attn_out = torch.empty(max_num_tokens, c.num_heads, c.head_dim, dtype=dtype)

    def run(self, scheduled: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor]:
        """Computes K/V for every scheduled token; returns the requests whose chunk reaches
        their last token (they sample next) and their logits [S, vocab] (float32)."""
        fb, samplers = self.prepare(scheduled)
        hidden = self.model(fb, self.kv_cache.layers)
        return samplers, self.model.logits(hidden)

    def prepare(self, scheduled: list[tuple[Request, int]]
                ) -> tuple[ForwardBatch, list[Request]]:
        bs = self.block_size
        ordered = [e for e in scheduled if e[1] == 1] + [e for e in scheduled if e[1] > 1]
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        logits_idx: list[int] = []
        samplers: list[Request] = []
        for req, n in ordered:
            start = req.num_computed_tokens
            assert len(req.block_ids) * bs >= start + n, f"{req} has no room for {n} tokens"
            ids.extend(req.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            slot_blocks.extend(req.block_ids[p // bs] for p in range(start, start + n))
            if start + n == req.num_tokens:
                logits_idx.append(len(ids) - 1)
                samplers.append(req)
        dev = self.device
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=positions,
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=positions % bs,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=dev),
            rope=self.rope.rope(positions, self.dtype, max(pos)))
        if self.backend == "native":
            fb.varlen = self._varlen(ordered, slot_blocks, fb)
            if 0 < len(logits_idx) < len(ids):
                fb.varlen_last = self._varlen_last(fb.varlen, ordered)
            return fb, samplers
        singles = [r for r, n in ordered if n == 1]
        if singles:
            fb.decode = self._decode_group(singles)
        t = len(singles)
        for req, n in ordered[len(singles):]:
            fb.prefills.append(self._prefill_group(req, t, n))
            t += n
        return fb, samplers

    def _varlen(self, ordered: list[tuple[Request, int]], slot_blocks: list[int],
                fb: ForwardBatch) -> VarlenBatch:
        bs = self.block_size
        q_start = [0]
        ctx = []
        for req, n in ordered:
            q_start.append(q_start[-1] + n)
            ctx.append(req.num_computed_tokens + n)
        mb = max(-(-c // bs) for c in ctx)
        tables = [r.block_ids[:mb] + [0] * (mb - min(len(r.block_ids), mb)) for r, _ in ordered]
        t = q_start[-1]
        if self._attn_out.shape[0] < t:
            self._attn_out = torch.empty(t, *self._attn_out.shape[1:], dtype=self.dtype)
        i32 = torch.int32
        return VarlenBatch(
            q_start=torch.tensor(q_start, dtype=i32), ctx_len=torch.tensor(ctx, dtype=i32),
            block_tables=torch.tensor(tables, dtype=i32),
            slots=fb.slot_blocks * bs + fb.slot_offsets, out=self._attn_out)

    def _varlen_last(self, vb: VarlenBatch, ordered: list[tuple[Request, int]]
                     ) -> VarlenBatch:
        """``vb`` restricted to the last query of each sequence that samples this step."""
        rows = [i for i, (req, n) in enumerate(ordered)
                if req.num_computed_tokens + n == req.num_tokens]
        sel = torch.tensor(rows, dtype=torch.long)
        return VarlenBatch(q_start=torch.arange(len(rows) + 1, dtype=torch.int32),
                           ctx_len=vb.ctx_len[sel], block_tables=vb.block_tables[sel],
                           slots=vb.slots, out=vb.out)

    def _decode_group(self, reqs: list[Request]) -> DecodeGroup:
        bs = self.block_size
        ctx = [r.num_computed_tokens + 1 for r in reqs]
        mb = -(-max(ctx) // bs)
        tables = [r.block_ids[:mb] + [0] * (mb - min(len(r.block_ids), mb)) for r in reqs]
        bt = torch.tensor(tables, dtype=torch.long, device=self.device)
        mask = None
        if any(c != mb * bs for c in ctx):
            lens = torch.tensor(ctx, dtype=torch.long, device=self.device)
            mask = (torch.arange(mb * bs, device=self.device)[None, :] < lens[:, None])
            mask = mask[:, None, None, :]
        return DecodeGroup(len(reqs), bt, mask)

    def _prefill_group(self, req: Request, start: int, n: int) -> PrefillGroup:
        cached = req.num_computed_tokens
        g = PrefillGroup(start, start + n, cached)
        if cached:
            ctx = cached + n
            nb = -(-ctx // self.block_size)
            g.block_table = torch.tensor(req.block_ids[:nb], dtype=torch.long, device=self.device)
            q_pos = torch.arange(cached, ctx, device=self.device)
            g.mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos[:, None]
        return g
