"""The native fused ops (csrc/cpu_ops.cpp via kvpool.engine.model.fused) against the plain torch
expressions they replace, on the shapes and strides the model hands them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpool.engine.model import fused

from kvpool.engine.model import native
from kvpool.engine.model.layers import RotaryEmbedding

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"no native ops: {native.error()}")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert a.shape == b.shape
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol * max(1.0, b.abs().max().item()), err


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(m: int, bias: bool) -> None:
    torch.manual_seed(m)
    lin = torch.nn.Linear(256, 203, bias=bias)  # 203 output rows: the blocked loop's tail
    with torch.no_grad():
        lin.weight.mul_(0.1)
    assert fused.prepack(lin) in (0, 1)
    x = torch.randn(m + 3, 256)[3:]  # a view with an offset
    _close(fused.linear(lin, x), F.linear(x, lin.weight, lin.bias))


def test_rmsnorm_with_and_without_residual() -> None:
    torch.manual_seed(1)
    x, res, w = torch.randn(9, 512), torch.randn(9, 512), torch.randn(512)
    ref_r = res + x
    ref = w * (ref_r * torch.rsqrt(ref_r.pow(2).mean(-1, keepdim=True) + 1e-6))
    out, r = fused.rmsnorm(x, w, 1e-6, res)
    assert r is res  # updated in place on the native path
    _close(r, ref_r, 0)
    _close(out, ref)
    out0, r0 = fused.rmsnorm(x, w, 1e-5)
    assert r0 is x
    _close(out0, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)))


@pytest.mark.parametrize("d", [32, 64, 128])
def test_rotary_in_place_on_packed_qkv(d: int) -> None:
    torch.manual_seed(d)
    t, h, hkv = 11, 4, 2
    qkv = torch.randn(t, (h + 2 * hkv) * d)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)
    v_before = qkv[:, (h + hkv) * d:].clone()
    rope = RotaryEmbedding(d, 10000.0, {}, torch.device("cpu"))
    pos = torch.tensor([0, 5, 17, 3, 200, 201, 202, 9, 1000, 4, 2], dtype=torch.long)
    r = rope.rope(pos, torch.float32, int(pos.max()))
    cos, sin = r[0][r[2]], r[1][r[2]]
    ref_q = fused._rotary_torch(q.clone(), cos, sin)
    ref_k = fused._rotary_torch(k.clone(), cos, sin)
    q2, k2 = fused.rotary_(q, k, r)
    assert q2.data_ptr() == qkv.data_ptr()  # rotated where they are
    _close(q, ref_q)
    _close(k, ref_k)
    assert torch.equal(qkv[:, (h + hkv) * d:], v_before)  # v untouched
    qs, ks = torch.randn(t, h, d), torch.randn(t, hkv, d)  # separate tensors
    ref_qs, ref_ks = fused._rotary_torch(qs, cos, sin), fused._rotary_torch(ks, cos, sin)
    fused.rotary_(qs, ks, r)
    _close(qs, ref_qs)
    _close(ks, ref_ks)


def test_silu_mul_on_a_strided_view() -> None:
    torch.manual_seed(2)
    gu = torch.randn(6, 2 * 1024 + 8)[:, 8:] * 4  # rows 2056 apart, feature dim contiguous
    g, u = gu.chunk(2, dim=-1)
    _close(fused.silu_mul(gu), F.silu(g) * u)


def test_argmax_first_maximum() -> None:
    torch.manual_seed(3)
    x = torch.randn(5, 32003)
    x[1, 7] = x[1, 30000] = 100.0  # ties: the first one wins, as torch.argmax
    x[3, -1] = 100.0  # in the scalar tail
    x[4, 0] = 100.0
    assert fused.argmax(x) == x.argmax(dim=-1).tolist()
    assert fused.argmax(x[:, :5]) == x[:, :5].argmax(dim=-1).tolist()  # V < 8, strided rows


def test_torch_fallback_matches_native() -> None:
    """The non-native path (CUDA, other dtypes) computes the same values: float64 inputs
    take it on CPU."""
    torch.manual_seed(4)
    t, h, hkv, d = 5, 4, 2, 64
    rope = RotaryEmbedding(d, 10000.0, {}, torch.device("cpu"))
    pos = torch.tensor([3, 0, 9, 1, 4])
    q, k = torch.randn(t, h, d), torch.randn(t, hkv, d)
    r32 = rope.rope(pos, torch.float32, 9)
    q32, k32 = fused.rotary_(q.clone(), k.clone(), r32)
    q64, k64 = fused.rotary_(q.double(), k.double(), rope.rope(pos, torch.float64, 9))
    _close(q64.float(), q32)
    _close(k64.float(), k32)
    x, res, w = torch.randn(t, 512), torch.randn(t, 512), torch.randn(512)
    o32, r32_ = fused.rmsnorm(x, w, 1e-6, res.clone())
    o64, r64 = fused.rmsnorm(x.double(), w.double(), 1e-6, res.double())
    _close(o64.float(), o32)
    _close(r64.float(), r32_)
    gu = torch.randn(t, 2048)
    _close(fused.silu_mul(gu.double()).float(), fused.silu_mul(gu))
    lg = torch.randn(t, 1000)
    assert fused.argmax(lg.double()) == fused.argmax(lg)
