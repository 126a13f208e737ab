"""Fused forward-pass ops: one native pass (csrc/cpu_ops.cpp) on CPU float32, the plain
torch expression everywhere else (CUDA, other dtypes, no compiler) — same results up to
float rounding, same in-place contract on both paths.

Why: on a 2-core CPU every torch op is a separate pass over the activations and, above a
few thousand elements, a separate OpenMP fork/join; a busy machine stalls each join. One
pass per (residual add + RMSNorm), (rotary on q and k), (SiLU x up) and argmax removes
about 20 ops per layer. ``linear`` picks the GEMM by batch rows: a bandwidth-bound native
pass for 1-4 rows (MKL's sgemm runs those at a third of the memory bandwidth here), oneDNN
with a weight prepacked once (``prepack``) for decode-sized batches, torch's own above.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.engine import native

SMALL_M = 4  # rows handled by kvpool_linear_small
PACKED_MAX_M = 256  # rows up to which the oneDNN prepacked weight beats F.linear (measured)


def _native(x: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel library when ``x`` is a CPU float32 tensor and the kernels are built."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return native.load()


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
    lib = _native(x)
    t, d = x.shape
    if lib is None or d % 8 or x.stride(1) != 1 or (residual is not None and (
            residual.stride(1) != 1 or residual.shape != x.shape)):
        r = x if residual is None else residual + x
        r32 = r.float()
        out = weight * (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)).to(r.dtype)
        return out, r
    out = torch.empty(t, d, dtype=x.dtype)
    with _label("kvpool::rmsnorm"):
        lib.kvpool_rmsnorm(x.data_ptr(), x.stride(0),
                           None if residual is None else residual.data_ptr(),
                           0 if residual is None else residual.stride(0), weight.data_ptr(),
                           out.data_ptr(), d, t, d, eps)
    return out, (x if residual is None else residual)


def rotary_(q: torch.Tensor, k: torch.Tensor,
            rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-interleaved rotary on q [T, H, D] and k [T, Hkv, D]. ``rope`` is ``(cos_table,
    sin_table, index)``: tables [n, 1, D] and each token's row in them. Native: q and k are
    rotated in place (they may be views into one packed qkv buffer); returns the rotated
    q, k (new tensors on the torch path)."""
    cos_t, sin_t, idx = rope
    lib = _native(q)
    if lib is None or q.stride()[1:] != (q.shape[2], 1) or k.stride()[1:] != (k.shape[2], 1) \
            or not (cos_t.is_contiguous() and sin_t.is_contiguous()):
        cos, sin = cos_t[idx], sin_t[idx]
        return _rotary_torch(q, cos, sin), _rotary_torch(k, cos, sin)
    t, h, d = q.shape
    with _label("kvpool::rotary"):
        if q.stride(0) == k.stride(0) and k.data_ptr() > q.data_ptr():  # one buffer: one pass
            lib.kvpool_rotary(q.data_ptr(), q.stride(0), (k.data_ptr() - q.data_ptr()) // 4,
                              h, k.shape[1], d, idx.data_ptr(), cos_t.data_ptr(),
                              sin_t.data_ptr(), t)
        else:
            for x in (q, k):
                lib.kvpool_rotary(x.data_ptr(), x.stride(0), 0, x.shape[1], 0, d,
                                  idx.data_ptr(), cos_t.data_ptr(), sin_t.data_ptr(), t)
    return q, k


def _rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    lib = _native(gate_up)
    t, i2 = gate_up.shape
    if lib is None or (i2 // 2) % 8 or gate_up.stride(1) != 1:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    out = torch.empty(t, i2 // 2, dtype=gate_up.dtype)
    with _label("kvpool::silu_mul"):
        lib.kvpool_silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), i2 // 2, t,
                            i2 // 2)
    return out


def argmax(logits: torch.Tensor) -> list[int]:
    """First index of each row's maximum of ``logits`` [S, V] (as ``torch.argmax``)."""
    lib = _native(logits)
    if lib is None or logits.stride(1) != 1 or logits.shape[1] == 0:
        return logits.argmax(dim=-1).tolist()
    s, v = logits.shape
    idx = torch.empty(s, dtype=torch.long)
    with _label("kvpool::argmax"):
        lib.kvpool_argmax(logits.data_ptr(), logits.stride(0), s, v, idx.data_ptr())
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
    lib = _native(x)
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
    if packed is not None and 0 < m <= PACKED_MAX_M and x.dtype == torch.float32:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, mod.bias, "none",
                                                               [], "")
        return out
    return F.linear(x, mod.weight, mod.bias)
