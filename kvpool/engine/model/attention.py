"""Paged attention: store this step's K/V by slot, then attend over the block tables.

One masking rule covers decode, chunked prefill and prefix-cache hits: a query at
absolute position p sees the keys at positions j <= p of its own sequence.

Two backends, chosen once per engine by :func:`select_backend`:

``native`` (CPU, float32 or bfloat16): :mod:`kvpool.engine.model.native`'s kernel reads K/V in
place (bf16 K/V widened to fp32 in registers; scores, softmax and accumulation in fp32) through
the block table, one varlen call per layer for the whole batch (decodes, prefill chunks and
prefix-hit chunks alike): no gather, no padding, and the output goes to a workspace reused
by every layer and step (``VarlenBatch.out``).

``torch`` (any device; the CUDA path and the reference): gather by block table, then SDPA.
The batch is ordered ``[q_len == 1 entries | one prefill chunk | one prefill chunk ...]`` so
queries are never padded: every q_len == 1 entry (decodes, 1-token chunks) goes through
one batched SDPA call, every longer chunk through its own call.
# NOTE: a GPU paged kernel (e.g. a flash-attention varlen kernel with a block table) plugs in
# as a third backend: it consumes the same ``VarlenBatch`` metadata as ``native``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math
from typing import Literal

import torch
import torch.nn.functional as F

from kvpool.engine.model import native

AttentionBackend = Literal["auto", "native", "torch"]
NATIVE_HEAD_DIMS = (32, 64, 128, 256)


@dataclass
class DecodeGroup:
    """The first ``n`` tokens of the batch, one per sequence.

    ``block_tables`` [n, max_blocks] (padded with the null block 0); ``mask`` [n, 1, 1,
    max_blocks * block_size] is True for the keys j < context length; None when all are valid.
    """

    n: int
    block_tables: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class PrefillGroup:
    """Tokens ``[start, end)`` of the batch: one chunk of one sequence whose first
    ``cached`` positions are already in the KV cache. With ``cached == 0`` the chunk attends
    to its own fresh K/V (no gather); otherwise ``block_table`` [num_blocks] covers the
    ``cached + (end - start)`` keys and ``mask`` [L, ctx] is the offset causal mask."""

    start: int
    end: int
    cached: int
    block_table: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class VarlenBatch:
    """Native-backend metadata, one row per sequence in batch order: sequence s owns the
    query tokens ``[q_start[s], q_start[s+1])``, has ``ctx_len[s]`` tokens of context after
    this step (its last query sits at ``ctx_len[s] - 1``) and keys in the blocks
    ``block_tables[s]`` (int32, padded with the null block 0). ``slots`` [T] (int64) is
    ``block * block_size + offset`` of each token's K/V; ``out`` [T, H, D] is the workspace
    every layer writes its attention output to (read by o_proj before the next layer)."""

    q_start: torch.Tensor
    ctx_len: torch.Tensor
    block_tables: torch.Tensor
    slots: torch.Tensor
    out: torch.Tensor


@dataclass
class ForwardBatch:
    """Everything one forward pass needs besides the weights; built once per step and
    shared by all layers. ``slot_blocks``/``slot_offsets`` [T] say where each token's K/V
    goes; ``logits_indices`` picks the rows whose logits are sampled. ``varlen_last``
    (native backend) is ``varlen`` restricted to those rows' queries, one per sampled
    sequence: the last layer attends for them only (every row's K/V is still stored).
    ``rope`` is what :func:`kvpool.engine.model.fused.rotary_` takes."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    logits_indices: torch.Tensor
    decode: DecodeGroup | None = None
    prefills: list[PrefillGroup] = field(default_factory=list)
    varlen: VarlenBatch | None = None
    varlen_last: VarlenBatch | None = None
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def select_backend(requested: AttentionBackend, device: torch.device, dtype: torch.dtype,
                   num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    """``native`` where the kernel applies (CPU, float32 or bfloat16, supported head_dim, at
    most 32 query heads per KV head) and builds; ``torch`` otherwise or when asked.

    Raises:
        RuntimeError: ``native`` was requested but cannot run here (says why).
    """
    if requested == "torch":
        return "torch"
    why = None
    if device.type != "cpu" or native.suffix(dtype) is None:
        why = f"native attention needs cpu and float32/bfloat16, not {device.type}/{dtype}"
    elif head_dim not in NATIVE_HEAD_DIMS or num_heads // num_kv_heads > 32:
        why = f"native attention supports head_dim {NATIVE_HEAD_DIMS}, <= 32 heads per kv head"
    elif native.load() is None:
        why = f"native attention kernel unavailable: {native.error()}"
    if why is None:
        return "native"
    if requested == "native":
        raise RuntimeError(why)
    return "torch"


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    fb: ForwardBatch, last: bool = False) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] ([H, D] rows contiguous, token stride free); caches
    [num_blocks, block_size, Hkv, D] (maybe strided views). Writes this step's K/V into the
    caches, then attends. Returns [T, H, D], or with ``last`` (needs ``fb.varlen_last``)
    [len(logits_indices), H, D] for the sampled rows only."""
    if fb.varlen is not None:
        if last:
            assert fb.varlen_last is not None
            _store_kv(k, v, k_cache, v_cache, fb.varlen)
            return _native_attention(q[fb.logits_indices], k_cache, v_cache, fb.varlen_last)
        _store_kv(k, v, k_cache, v_cache, fb.varlen)
        return _native_attention(q, k_cache, v_cache, fb.varlen)
    k_cache[fb.slot_blocks, fb.slot_offsets] = k
    v_cache[fb.slot_blocks, fb.slot_offsets] = v
    bs = k_cache.shape[1]
    out = torch.empty_like(q)
    if (d := fb.decode) is not None:
        kk = _gather(k_cache, d.block_tables)
        vv = _gather(v_cache, d.block_tables)
        res = F.scaled_dot_product_attention(q[: d.n].unsqueeze(2), kk, vv, attn_mask=d.mask,
                                             enable_gqa=True)
        out[: d.n] = res.squeeze(2)
    for p in fb.prefills:
        qs = q[p.start:p.end].transpose(0, 1).unsqueeze(0)
        if p.cached == 0:
            kk = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
            vv = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
            res = F.scaled_dot_product_attention(qs, kk, vv, is_causal=True, enable_gqa=True)
        else:
            ctx = p.cached + p.end - p.start
            assert p.block_table is not None and p.block_table.numel() * bs >= ctx
            kk = _gather(k_cache, p.block_table[None])[:, :, :ctx]
            vv = _gather(v_cache, p.block_table[None])[:, :, :ctx]
            res = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=p.mask, enable_gqa=True)
        out[p.start:p.end] = res[0].transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, nb] block ids -> [B, Hkv, nb * block_size, D]; block-granular index_select."""
    b, nb = block_tables.shape
    n, bs, h, dim = cache.shape
    # NOTE: on the 2-D row view (rows contiguous even in the strided block-major layout)
    # index_select is ~10x faster than on the 4-D view.
    g = cache.view(n, bs * h * dim).index_select(0, block_tables.reshape(-1))
    return g.view(b, nb * bs, h, dim).transpose(1, 2)


def _store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              vb: VarlenBatch) -> None:
    lib = native.load()
    assert lib is not None
    t, hkv, d = k.shape
    # invariants the kernels rely on: [.., Hkv, D] rows contiguous, same strides for K and V
    assert k_cache.stride()[1:] == v_cache.stride()[1:] == (hkv * d, d, 1)
    assert k_cache.stride(0) == v_cache.stride(0)
    assert k.stride()[1:] == (d, 1) and v.stride()[1:] == (d, 1)
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
    with torch.profiler.record_function("kvpool::store_kv"):  # a byte copy: any dtype
        lib.kvpool_store_kv(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                            k_cache.stride(0), k_cache.stride(1), vb.slots.data_ptr(), t,
                            k.stride(0), v.stride(0), k_cache.shape[1], k.element_size())


def _native_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      vb: VarlenBatch) -> torch.Tensor:
    lib = native.load()
    assert lib is not None
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    sfx = native.suffix(q.dtype)
    assert q.stride()[1:] == (d, 1) and sfx is not None
    assert q.dtype == k_cache.dtype == v_cache.dtype == vb.out.dtype
    out = vb.out[:t]
    with torch.profiler.record_function("kvpool::paged_attention"):
        rc = getattr(lib, "kvpool_paged_attention" + sfx)(
            q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            vb.block_tables.data_ptr(), vb.block_tables.stride(0), vb.q_start.data_ptr(),
            vb.ctx_len.data_ptr(), vb.ctx_len.numel(), h, hkv, d, k_cache.shape[1],
            1.0 / math.sqrt(d))
    assert rc == 0, "native attention rejected the shapes select_backend accepted"
    return out
