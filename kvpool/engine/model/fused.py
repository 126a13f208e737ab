"""Fused forward-pass ops: one native pass (csrc/cpu_ops.cpp) on CPU float32 and bfloat16,
the plain torch expression everywhere else (CUDA, other dtypes, no compiler) — same results
up to float rounding, same in-place contract on both paths.

Why: on a 2-core CPU every torch op is a separate pass over the activations and, above a
few thousand elements, a separate OpenMP fork/join; a busy machine stalls each join. One
pass per (residual add + RMSNorm), (rotary on q and k), (SiLU x up) and argmax removes
about 20 ops per layer. ``linear`` picks the GEMM by batch rows: a bandwidth-bound native
pass for 1-4 rows (MKL's sgemm runs those at a third of the memory bandwidth here), oneDNN
with a weight prepacked once (``prepack``) for every larger batch, prefill chunks included
(at 512-2,048 rows it beats torch's MKL ``F.linear`` by 8-15% of CPU time on one thread
and 1.2-1.5x in wall time on two: issue 25; vLLM's CPU backend uses oneDNN at every size).

bfloat16 (storage only: every kernel widens to fp32, computes and rounds once per value
where transformers' bf16 modules round): rmsnorm, rotary and silu_mul have bf16 twins;
``linear`` on bf16 weights runs ``kvpool_linear_bf16`` at every batch size (weights widened
in registers, fp32 accumulation) because torch's bf16 GEMM on a CPU without AVX512-BF16/AMX
is 2-6x slower than its fp32 one. What stays on a slower path in bf16: no oneDNN prepacking
(it would need an fp32 copy of the weights, undoing the memory saving); ``argmax`` sees the
float32 logits in both dtypes. float16 and other dtypes take the torch expressions.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.engine.model import native

SMALL_M = 4  # rows handled by kvpool_linear_small


def _native(x: torch.Tensor, name: str) -> Any | None:
    """The native function ``name`` in ``x``'s dtype variant (``kvpool_rmsnorm`` or
    ``kvpool_rmsnorm_bf16``) when ``x`` is a CPU float32/bfloat16 tensor and the kernels are
    built; else None."""
    sfx = native.suffix(x.dtype)
    if x.device.type != "cpu" or sfx is None:
        return None
    lib = native.load()
    return None if lib is None else getattr(lib, name + sfx)


def _label(name: str) -> contextlib.AbstractContextManager[Any]:
    """A profiler range for a native call (ctypes calls are invisible to torch.profiler);
    free when no profiler runs."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = residual + x`` (or ``x``), then ``weight * r / rms(r)`` in float32.
    Returns (normed, r); ``residual`` is updated in place on the native path, so the caller
    must use the returned ``r`` and not the old tensor."""
    fn = _native(x, "kvpool_rmsnorm")
    t, d = x.shape
    if fn is None or d % 8 or x.stride(1) != 1 or weight.dtype != x.dtype \
            or not weight.is_contiguous() or (residual is not None and (
                residual.stride(1) != 1 or residual.shape != x.shape
                or residual.dtype != x.dtype)):
        r = x if residual is None else residual + x
        r32 = r.float()
        out = weight * (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)).to(r.dtype)
        return out, r
    out = torch.empty(t, d, dtype=x.dtype)
    with _label("kvpool::rmsnorm"):
        fn(x.data_ptr(), x.stride(0),
           None if residual is None else residual.data_ptr(),
           0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(), d,
           t, d, eps)
    return out, (x if residual is None else residual)


def rotary_(q: torch.Tensor, k: torch.Tensor,
            rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-interleaved rotary on q [T, H, D] and k [T, Hkv, D]. ``rope`` is ``(cos_table,
    sin_table, index)``: tables [n, 1, D] and each token's row in them. Native: q and k are
    rotated in place (they may be views into one packed qkv buffer); returns the rotated
    q, k (new tensors on the torch path)."""
    cos_t, sin_t, idx = rope
    fn = _native(q, "kvpool_rotary")
    if fn is None or q.stride()[1:] != (q.shape[2], 1) or k.stride()[1:] != (k.shape[2], 1) \
            or k.dtype != q.dtype or cos_t.dtype != q.dtype or sin_t.dtype != q.dtype \
            or not (cos_t.is_contiguous() and sin_t.is_contiguous()):
        cos, sin = cos_t[idx], sin_t[idx]
        return _rotary_torch(q, cos, sin), _rotary_torch(k, cos, sin)
    t, h, d = q.shape
    with _label("kvpool::rotary"):
        if q.stride(0) == k.stride(0) and k.data_ptr() > q.data_ptr():  # one buffer: one pass
            fn(q.data_ptr(), q.stride(0), (k.data_ptr() - q.data_ptr()) // q.element_size(),
               h, k.shape[1], d, idx.data_ptr(), cos_t.data_ptr(), sin_t.data_ptr(), t)
        else:
            for x in (q, k):
                fn(x.data_ptr(), x.stride(0), 0, x.shape[1], 0, d, idx.data_ptr(),
                   cos_t.data_ptr(), sin_t.data_ptr(), t)
    return q, k


def _rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    fn = _native(gate_up, "kvpool_silu_mul")
    t, i2 = gate_up.shape
    if fn is None or (i2 // 2) % 8 or gate_up.stride(1) != 1:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    out = torch.empty(t, i2 // 2, dtype=gate_up.dtype)
    with _label("kvpool::silu_mul"):
        fn(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), i2 // 2, t, i2 // 2)
    return out


def argmax(logits: torch.Tensor) -> list[int]:
    """First index of each row's maximum of ``logits`` [S, V] (as ``torch.argmax``)."""
    fn = _native(logits, "kvpool_argmax") if logits.dtype == torch.float32 else None
    if fn is None or logits.stride(1) != 1 or logits.shape[1] == 0:
        return logits.argmax(dim=-1).tolist()
    s, v = logits.shape
    idx = torch.empty(s, dtype=torch.long)
    with _label("kvpool::argmax"):
        fn(logits.data_ptr(), logits.stride(0), s, v, idx.data_ptr())
    return idx.tolist()


def prepack(model: nn.Module) -> int:
    """Gives every ``nn.Linear`` of a CPU float32 model a oneDNN-prepacked copy of its
    weight (``_kvpool_packed``; the original stays for the other paths). Returns how many;
    0 where oneDNN is unavailable. Costs one more copy of the linear weights in memory."""
    # torch.backends.mkldnn.is_available is not annotated in torch
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return 0
    n = 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and mod.weight.device.type == "cpu" \
                and mod.weight.dtype == torch.float32:
            try:
                mod._kvpool_packed = torch.ops.mkldnn._reorder_linear_weight(
                    mod.weight.detach(), 128)
            except (RuntimeError, AttributeError):
                return n
            n += 1
    return n


def linear(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)`` for x [M, K], with the GEMM chosen by M (see the module docstring)."""
    m, k = x.shape
    if x.dtype == torch.bfloat16:
        y16 = _linear_bf16(mod, x)
        if y16 is not None:
            return y16
    lib = native.load() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if lib is not None and 0 < m <= SMALL_M and x.stride(1) == 1 and k % 8 == 0 \
            and mod.weight.dtype == torch.float32 and mod.weight.is_contiguous():
        y = torch.empty(m, mod.out_features, dtype=x.dtype)
        b = mod.bias
        with _label("kvpool::linear_small"):
            rc = lib.kvpool_linear_small(x.data_ptr(), x.stride(0), mod.weight.data_ptr(),
                                         None if b is None else b.data_ptr(), y.data_ptr(),
                                         y.stride(0), m, mod.out_features, k)
        if rc == 0:
            return y
    packed = getattr(mod, "_kvpool_packed", None)
    if packed is not None and m > 0 and x.dtype == torch.float32:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, mod.bias, "none",
                                                               [], "")
        return out
    return F.linear(x, mod.weight, mod.bias)


def _linear_bf16(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """``kvpool_linear_bf16`` for a CPU bf16 ``x`` [M, K] and bf16 weight; None where it
    does not apply (the caller runs ``F.linear``)."""
    w, b = mod.weight, mod.bias
    m, k = x.shape
    lib = native.load() if x.device.type == "cpu" else None
    if lib is None or m == 0 or k % 8 or x.stride(1) != 1 or w.dtype != torch.bfloat16 \
            or not w.is_contiguous() or (b is not None and (
                b.dtype != torch.bfloat16 or not b.is_contiguous())):
        return None
    y = torch.empty(m, mod.out_features, dtype=x.dtype)
    with _label("kvpool::linear_bf16"):
        rc = lib.kvpool_linear_bf16(x.data_ptr(), x.stride(0), w.data_ptr(),
                                    None if b is None else b.data_ptr(), y.data_ptr(),
                                    y.stride(0), m, mod.out_features, k)
    return y if rc == 0 else None
