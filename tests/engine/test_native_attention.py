"""The native in-place paged kernel against the gather + SDPA backend on the same batch.

Batches mix decodes, cold prefill chunks, chunks after a cached prefix (prefix hits and
chunked prefill) and contexts that end mid-block, over shuffled block tables, in both
KV layouts; the engine picks the native backend on CPU/float32 (bf16: test_bf16.py) and still matches the torch
backend end to end.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvpool.engine import LLM, SamplingParams
from kvpool.engine.model.attention import (ForwardBatch, PrefillGroup, DecodeGroup, VarlenBatch,
                                     paged_attention, select_backend)
from kvpool.engine.model import native

from .helpers import prompts

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"no kernel: {native.error()}")


def _caches(layout: str, nb: int, bs: int, hkv: int, d: int):
    g = torch.Generator().manual_seed(3)
    if layout == "block_major":
        buf = torch.randn(nb, 3, 2, bs, hkv, d, generator=g)
        return buf[:, 1, 0], buf[:, 1, 1]
    return torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)


def _batch(seqs: list[tuple[int, int]], bs: int, nb: int, rng: random.Random):
    """seqs: (cached, new) per sequence; returns (native VarlenBatch, torch ForwardBatch
    parts) over disjoint shuffled blocks (block 0 stays the null block)."""
    free = list(range(1, nb))
    rng.shuffle(free)
    tables, slots, q_start, ctx = [], [], [0], []
    for cached, new in seqs:
        n = -(-(cached + new) // bs)
        tables.append([free.pop() for _ in range(n)])
        slots += [tables[-1][p // bs] * bs + p % bs for p in range(cached, cached + new)]
        q_start.append(q_start[-1] + new)
        ctx.append(cached + new)
    return tables, slots, q_start, ctx


def _torch_fb(seqs, tables, slots, bs):
    """The torch backend's metadata for the same batch (decodes must come first)."""
    t = sum(n for _, n in seqs)
    sl = torch.tensor(slots)
    fb = ForwardBatch(input_ids=torch.zeros(t, dtype=torch.long),
                      positions=torch.zeros(t, dtype=torch.long), slot_blocks=sl // bs,
                      slot_offsets=sl % bs, logits_indices=torch.zeros(0, dtype=torch.long))
    singles = [i for i, (_, n) in enumerate(seqs) if n == 1]
    if singles:
        ctx = [seqs[i][0] + 1 for i in singles]
        mb = -(-max(ctx) // bs)
        bt = torch.tensor([tables[i][:mb] + [0] * (mb - len(tables[i][:mb])) for i in singles])
        mask = (torch.arange(mb * bs)[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :]
        fb.decode = DecodeGroup(len(singles), bt, mask)
    start = len(singles)
    for i, (cached, new) in enumerate(seqs):
        if new == 1:
            continue
        g = PrefillGroup(start, start + new, cached)
        if cached:
            g.block_table = torch.tensor(tables[i])
            g.mask = torch.arange(cached + new)[None, :] <= torch.arange(cached, cached + new)[:, None]
        fb.prefills.append(g)
        start += new
    return fb


@pytest.mark.parametrize("layout", ["block_major", "per_layer"])
@pytest.mark.parametrize("heads,kv_heads,d,bs", [(8, 4, 64, 16), (4, 2, 32, 16), (4, 4, 128, 8),
                                                 (16, 2, 64, 16), (8, 1, 32, 5)])
def test_native_equals_gather_sdpa(layout, heads, kv_heads, d, bs):
    rng = random.Random(heads * 100 + d + bs)
    # decodes first (the torch backend's order), then cold, prefix-hit and mid-block chunks
    seqs = [(rng.randint(0, 90), 1) for _ in range(6)] + [(0, 1)] + \
           [(0, 37), (bs * 3, 20), (45, 1 + bs), (70, 70), (0, 2)]
    _check(layout, heads, kv_heads, d, bs, seqs, rng)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("seqs", [[(600, 1)], [(1000, 1), (300, 1)], [(257, 1)],
                                  [(899, 3)], [(700, 1), (0, 40)]],
                         ids=["one", "two", "short", "chunk3", "with-prefill"])
def test_split_sequences_equal_gather_sdpa(seqs, threads):
    """A small batch (fewer items than 2 per thread): long one-item sequences are split
    into key ranges attended by separate threads and merged; same result (float rounding)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check("block_major", 8, 4, 64, 5, seqs, random.Random(len(seqs)))
    finally:
        torch.set_num_threads(before)


def _check(layout, heads, kv_heads, d, bs, seqs, rng):
    nb = sum(-(-(c + n) // bs) for c, n in seqs) + 3
    tables, slots, q_start, ctx = _batch(seqs, bs, nb, rng)
    t = q_start[-1]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(t, heads, d, generator=g)
    k = torch.randn(t, kv_heads, d, generator=g)
    v = torch.randn(t, 7 + kv_heads * d, generator=g)[:, 7:].view(t, kv_heads, d)  # qkv split
    kc, vc = _caches(layout, nb, bs, kv_heads, d)
    kc2, vc2 = kc.clone(), vc.clone()
    mb = max(len(x) for x in tables)
    vb = VarlenBatch(q_start=torch.tensor(q_start, dtype=torch.int32),
                     ctx_len=torch.tensor(ctx, dtype=torch.int32),
                     block_tables=torch.tensor([x + [0] * (mb - len(x)) for x in tables],
                                               dtype=torch.int32),
                     slots=torch.tensor(slots), out=torch.full((t + 4, heads, d), float("nan")))
    fb = _torch_fb(seqs, tables, slots, bs)
    ref = paged_attention(q, k, v, kc2, vc2, fb)
    fb.varlen = vb
    got = paged_attention(q, k, v, kc, vc, fb)
    torch.testing.assert_close(kc, kc2, atol=0, rtol=0)  # stored K/V identical
    torch.testing.assert_close(vc, vc2, atol=0, rtol=0)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_engine_uses_native_on_cpu_and_matches_torch_backend(hf_dirs):
    """End to end: chunked prefill, a shared-prefix hit and batched decode; native and torch
    backends give the same greedy tokens and logits within 5e-5."""
    shared = prompts((40,), seed=4)[0]
    ps = [shared + p for p in prompts((5, 23, 1), seed=6)] + prompts((3, 33), seed=7)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, return_logits=True)
    outs = {}
    for backend in ("native", "torch"):
        llm = LLM(str(hf_dirs["qwen3"]), num_kv_blocks=64, block_size=16,
                  max_num_batched_tokens=24, attention_backend=backend)
        assert llm.engine.runner.backend == backend
        llm.generate([ps[0]], sp)  # caches the shared prefix
        outs[backend] = llm.generate(ps, sp)
        assert llm.engine.stats()["prefix_hit_tokens"] >= 32
    for a, b in zip(outs["native"], outs["torch"]):
        assert a.output_token_ids == b.output_token_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=5e-5,
                                   rtol=0)


def test_select_backend():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu, torch.float32, 8, 4, 64) == "native"
    assert select_backend("auto", cpu, torch.bfloat16, 8, 4, 64) == "native"
    assert select_backend("auto", cpu, torch.float16, 8, 4, 64) == "torch"
    assert select_backend("auto", cpu, torch.float32, 8, 4, 80) == "torch"
    assert select_backend("torch", cpu, torch.float32, 8, 4, 64) == "torch"
    with pytest.raises(RuntimeError, match="cpu and float32/bfloat16"):
        select_backend("native", torch.device("cuda"), torch.float32, 8, 4, 64)
