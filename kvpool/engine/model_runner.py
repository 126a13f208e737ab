"""ModelRunner: turns a scheduled batch into a ForwardBatch and runs the model.

The attention backend is fixed at construction (see :func:`attention.select_backend`);
the native one gets its per-step metadata as a :class:`VarlenBatch` and writes into one
persistent output workspace of ``max_num_tokens`` rows (grown if a step ever needs more).

A step is a list of :class:`~kvpool.engine.step_input.StepEntry` (plain data, not
requests): :meth:`ModelRunner.run` makes them from the scheduled requests, hands them to
``followers`` (a tensor-parallel engine's other ranks, which run the same entries:
:mod:`kvpool.engine.tp.workers`) and runs them itself (:meth:`ModelRunner.execute`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvpool.engine.model import fused

from kvpool.engine.model import native
from kvpool.engine.model.attention import (AttentionBackend, DecodeGroup, ForwardBatch,
                                     PrefillGroup, VarlenBatch, select_backend)
from kvpool.engine.kv_cache import KVCache
from kvpool.engine.model.layers import RotaryEmbedding
from kvpool.engine.model.llama import LlamaForCausalLM
from kvpool.engine.request import Request
from kvpool.engine.step_input import StepEntry


class StepFollowers(Protocol):
    """The other ranks of a tensor-parallel engine, as the runner of rank 0 sees them.

    ``step(entries)`` is called once per step, before rank 0 runs the same entries; it
    must not block on the ranks' forward pass (they meet rank 0 in the model's
    collectives), and it raises (RuntimeError, one line) when a rank is gone."""

    def step(self, entries: list[StepEntry]) -> None: ...


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int,
                 device: torch.device, dtype: torch.dtype,
                 attention_backend: AttentionBackend = "auto", max_num_tokens: int = 512,
                 prepack: bool = True, followers: StepFollowers | None = None) -> None:
        c = model.config
        self.followers = followers
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, device)
        heads, kv_heads = model.num_local_heads
        self.backend = select_backend(attention_backend, device, dtype, heads, kv_heads,
                                      c.head_dim)
        self._attn_out = torch.empty(0)
        if device.type == "cpu":
            native.tune_malloc()
            # bf16: no prepacked copy (it would be fp32); shared weights: none either
            if dtype == torch.float32 and prepack:
                fused.prepack(model)
        if self.backend == "native":
            self._attn_out = torch.empty(max_num_tokens, heads, c.head_dim, dtype=dtype)

    def run(self, scheduled: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor]:
        """Computes K/V for every scheduled token; returns the requests whose chunk reaches
        their last token (they sample next) and their logits [S, vocab] (float32)."""
        ordered = [e for e in scheduled if e[1] == 1] + [e for e in scheduled if e[1] > 1]
        entries = [StepEntry.of(req, n, self.block_size) for req, n in ordered]
        if self.followers is not None:
            self.followers.step(entries)
        logits = self.execute(entries)
        assert logits is not None, "rank 0 gets the whole vocabulary's logits"
        return [req for (req, _), e in zip(ordered, entries) if e.samples], logits

    def execute(self, entries: list[StepEntry]) -> torch.Tensor | None:
        """One forward pass over ``entries`` (decodes first, as :meth:`run` orders them):
        stores their K/V; returns the sampled rows' logits [S, vocab] (float32) on rank 0,
        None on the other ranks of a tensor-parallel engine."""
        fb = self.prepare(entries)
        hidden = self.model(fb, self.kv_cache.layers)
        return self.model.logits(hidden)

    def prepare(self, entries: list[StepEntry]) -> ForwardBatch:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        logits_idx: list[int] = []
        for e in entries:
            ids.extend(e.tokens)
            pos.extend(range(e.start, e.end))
            slot_blocks.extend(e.block_ids[p // bs] for p in range(e.start, e.end))
            if e.samples:
                logits_idx.append(len(ids) - 1)
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
            fb.varlen = self._varlen(entries, fb)
            if 0 < len(logits_idx) < len(ids):
                fb.varlen_last = self._varlen_last(fb.varlen, entries)
            return fb
        singles = [e for e in entries if len(e.tokens) == 1]
        if singles:
            fb.decode = self._decode_group(singles)
        t = len(singles)
        for e in entries[len(singles):]:
            fb.prefills.append(self._prefill_group(e, t))
            t += len(e.tokens)
        return fb

    def _varlen(self, entries: list[StepEntry], fb: ForwardBatch) -> VarlenBatch:
        bs = self.block_size
        q_start = [0]
        ctx = []
        for e in entries:
            q_start.append(q_start[-1] + len(e.tokens))
            ctx.append(e.end)
        mb = max(-(-c // bs) for c in ctx)
        tables = [e.block_ids + [0] * (mb - len(e.block_ids)) for e in entries]
        t = q_start[-1]
        if self._attn_out.shape[0] < t:
            self._attn_out = torch.empty(t, *self._attn_out.shape[1:], dtype=self.dtype)
        i32 = torch.int32
        return VarlenBatch(
            q_start=torch.tensor(q_start, dtype=i32), ctx_len=torch.tensor(ctx, dtype=i32),
            block_tables=torch.tensor(tables, dtype=i32),
            slots=fb.slot_blocks * bs + fb.slot_offsets, out=self._attn_out)

    def _varlen_last(self, vb: VarlenBatch, entries: list[StepEntry]) -> VarlenBatch:
        """``vb`` restricted to the last query of each sequence that samples this step."""
        rows = [i for i, e in enumerate(entries) if e.samples]
        sel = torch.tensor(rows, dtype=torch.long)
        return VarlenBatch(q_start=torch.arange(len(rows) + 1, dtype=torch.int32),
                           ctx_len=vb.ctx_len[sel], block_tables=vb.block_tables[sel],
                           slots=vb.slots, out=vb.out)

    def _decode_group(self, singles: list[StepEntry]) -> DecodeGroup:
        bs = self.block_size
        ctx = [e.end for e in singles]
        mb = -(-max(ctx) // bs)
        tables = [e.block_ids + [0] * (mb - len(e.block_ids)) for e in singles]
        bt = torch.tensor(tables, dtype=torch.long, device=self.device)
        mask = None
        if any(c != mb * bs for c in ctx):
            lens = torch.tensor(ctx, dtype=torch.long, device=self.device)
            mask = (torch.arange(mb * bs, device=self.device)[None, :] < lens[:, None])
            mask = mask[:, None, None, :]
        return DecodeGroup(len(singles), bt, mask)

    def _prefill_group(self, e: StepEntry, start: int) -> PrefillGroup:
        cached, ctx = e.start, e.end
        g = PrefillGroup(start, start + len(e.tokens), cached)
        if cached:
            g.block_table = torch.tensor(e.block_ids, dtype=torch.long, device=self.device)
            q_pos = torch.arange(cached, ctx, device=self.device)
            g.mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos[:, None]
        return g
