"""bfloat16 on CPU (issue 21 item 3): the native kernels' bf16 variants against the torch
expressions, half the bytes for weights and KV blocks, greedy agreement with transformers
in bf16, and prefix caching / chunked prefill giving the same tokens as one whole prefill.

The agreement figure is teacher-forced: at each of the reference's positions, does our
greedy token given transformers' own prefix equal transformers' token (a first mismatch
would otherwise make every later token of a free-running comparison count as wrong, on a
random model whose logit margins are often below bf16's resolution). Both figures are
printed (``pytest -s``).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F

from kvpool.engine import LLM, SamplingParams

from kvpool.engine.model import fused

from kvpool.engine.model import native
from kvpool.engine.model.attention import ForwardBatch, VarlenBatch, paged_attention
from kvpool.engine.kv_cache import KVCache, KVCacheSpec
from kvpool.engine.model.layers import RotaryEmbedding

from .helpers import agreement, prompts
from .test_native_attention import _batch, _torch_fb

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"no native ops: {native.error()}")

BF16 = torch.bfloat16
AGREE_LENGTHS = (3, 16, 17, 40, 9, 25)  # six prompts, below / at / across a 16-token block
AGREE_NEW = 32  # greedy tokens per prompt
MIN_AGREEMENT = 0.98


# --- kernels ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["block_major", "per_layer"])
@pytest.mark.parametrize("heads,kv_heads,d,bs", [(8, 4, 64, 16), (4, 2, 32, 16),
                                                 (9, 3, 64, 16), (8, 1, 128, 5)])
def test_native_bf16_attention_matches_fp32_of_the_same_values(layout, heads, kv_heads, d,
                                                                bs):
    """bf16 q/K/V through the native kernel equal the fp32 torch backend run on the same
    (bf16-representable) values, up to the bf16 rounding of the probabilities (torch's
    own bf16 rounding point) and the one final rounding to bf16; the stored K/V are
    bit-identical."""
    rng = random.Random(heads + d + bs)
    seqs = [(rng.randint(0, 90), 1) for _ in range(5)] + [(0, 37), (bs * 3, 20), (45, 1 + bs)]
    nb = sum(-(-(c + n) // bs) for c, n in seqs) + 3
    tables, slots, q_start, ctx = _batch(seqs, bs, nb, rng)
    t = q_start[-1]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(t, heads, d, generator=g).to(BF16)
    k = torch.randn(t, kv_heads, d, generator=g).to(BF16)
    v = torch.randn(t, 5 + kv_heads * d, generator=g)[:, 5:].to(BF16).view(t, kv_heads, d)
    if layout == "block_major":
        buf = torch.randn(nb, 2, 2, bs, kv_heads, d, generator=g).to(BF16)
        kc, vc = buf[:, 1, 0], buf[:, 1, 1]
    else:
        kc = torch.randn(nb, bs, kv_heads, d, generator=g).to(BF16)
        vc = torch.randn(nb, bs, kv_heads, d, generator=g).to(BF16)
    kc32, vc32 = kc.float(), vc.float()
    mb = max(len(x) for x in tables)
    vb = VarlenBatch(q_start=torch.tensor(q_start, dtype=torch.int32),
                     ctx_len=torch.tensor(ctx, dtype=torch.int32),
                     block_tables=torch.tensor([x + [0] * (mb - len(x)) for x in tables],
                                               dtype=torch.int32),
                     slots=torch.tensor(slots), out=torch.zeros(t, heads, d, dtype=BF16))
    fb = _torch_fb(seqs, tables, slots, bs)
    ref = paged_attention(q.float(), k.float(), v.float(), kc32, vc32, fb)
    fb.varlen = vb
    got = paged_attention(q, k, v, kc, vc, fb)
    assert got.dtype == BF16
    assert torch.equal(kc.float(), kc32) and torch.equal(vc.float(), vc32)
    # fp32 scores, softmax and accumulation; the probabilities rounded to bf16 before P @ V
    # (as torch's CPU flash attention does; each within 2^-9 relative, so the output within
    # 2^-9 * max|V| of the fp32 result) and one final rounding (one bf16 ulp)
    vmax = max(v.float().abs().max().item(), vc.float().abs().max().item())
    torch.testing.assert_close(got.float(), ref, atol=2 ** -9 * vmax + 1e-4, rtol=2 ** -8)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 37, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_accumulates_in_fp32(m: int, bias: bool) -> None:
    """kvpool_linear_bf16 (every M, odd N for the tail rows) equals the fp32 product of the
    bf16 values rounded once to bf16."""
    torch.manual_seed(m)
    lin = torch.nn.Linear(256, 203, bias=bias).to(BF16)
    x = torch.randn(m + 3, 256).to(BF16)[3:]  # a view with an offset
    y = fused.linear(lin, x)
    ref = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else
                   lin.bias.float())
    assert y.dtype == BF16
    torch.testing.assert_close(y.float(), ref, atol=1e-5, rtol=2 ** -8)


def test_elementwise_bf16_equal_torch_bf16() -> None:
    """rmsnorm (+ residual), silu_mul and rotary in bf16 give transformers' bf16 values:
    they round where the torch modules round."""
    torch.manual_seed(1)
    x, res, w = (torch.randn(9, 512).to(BF16), torch.randn(9, 512).to(BF16),
                 torch.randn(512).to(BF16))
    r_ref = res + x
    r32 = r_ref.float()
    ref = w * (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16)
    out, r = fused.rmsnorm(x, w, 1e-6, res)
    assert r is res and torch.equal(r, r_ref)
    assert (out != ref).float().mean() < 0.01  # rsqrt rounding may move a rare value 1 ulp
    torch.testing.assert_close(out, ref, atol=0, rtol=2 ** -7)

    gu = torch.randn(7, 512).to(BF16)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(gu), F.silu(gate) * up, atol=0, rtol=2 ** -7)

    d, t, h, hkv = 64, 11, 4, 2
    qkv = torch.randn(t, (h + 2 * hkv) * d).to(BF16)
    q, k = qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)
    rope = RotaryEmbedding(d, 10000.0, {}, torch.device("cpu"))
    pos = torch.tensor([0, 5, 17, 3, 200, 201, 202, 9, 1000, 4, 2])
    rp = rope.rope(pos, BF16, int(pos.max()))
    cos, sin = rp[0][rp[2]], rp[1][rp[2]]
    ref_q, ref_k = fused._rotary_torch(q.clone(), cos, sin), fused._rotary_torch(k.clone(),
                                                                                 cos, sin)
    q2, k2 = fused.rotary_(q, k, rp)
    assert q2.data_ptr() == q.data_ptr()  # in place
    assert torch.equal(q2, ref_q) and torch.equal(k2, ref_k)


# --- memory ----------------------------------------------------------------------------

def test_bf16_halves_kv_block_and_weight_bytes(hf_dirs) -> None:
    engines = {dt: LLM(str(hf_dirs["llama"]), dtype=dt, kv_cache_size="1MiB").engine
               for dt in ("float32", "bfloat16")}
    e32, e16 = engines["float32"], engines["bfloat16"]
    assert e16.kv_spec.dtype == BF16 and e16.runner.backend == "native"
    assert e16.kv_spec.block_bytes * 2 == e32.kv_spec.block_bytes
    assert e16.kv_cache.buffers[0].element_size() == 2
    # the same byte budget holds twice the blocks
    assert e16.pool.capacity == 2 * e32.pool.capacity
    assert e16.kv_cache.nbytes == e32.kv_cache.nbytes

    def weight_bytes(e) -> int:  # noqa: ANN001
        return sum(p.numel() * p.element_size() for p in e.model.parameters())

    assert all(p.dtype == BF16 for p in e16.model.parameters())
    assert weight_bytes(e16) * 2 == weight_bytes(e32)
    # no prepacked fp32 copy of the weights in bf16 (it would undo the saving)
    assert not any(hasattr(m, "_kvpool_packed") for m in e16.model.modules())


def test_injected_kv_buffers_hold_twice_the_bf16_blocks() -> None:
    """The elastic pool hands the engine raw bytes (KVCache.from_buffers over uint8 pages):
    its block count follows the KV dtype's element size."""
    spec32 = KVCacheSpec(2, 16, 2, 32, torch.float32)
    spec16 = KVCacheSpec(2, 16, 2, 32, BF16)
    assert spec16.block_bytes == spec32.block_bytes // 2 == 2 * 2 * 16 * 2 * 32 * 2
    pages = [torch.zeros(8 * spec32.block_bytes, dtype=torch.uint8)]
    assert KVCache.from_buffers(spec32, pages).num_blocks == 8
    kv = KVCache.from_buffers(spec16, pages)
    assert kv.num_blocks == 16 and kv.layers[0][0].dtype == BF16


# --- agreement with transformers -------------------------------------------------------

def _hf_bf16(path):  # noqa: ANN001, ANN202
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            m = AutoModelForCausalLM.from_pretrained(path, dtype=BF16)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=BF16)
    return m.eval()


def test_greedy_agreement_with_transformers_bf16(hf_dirs, monkeypatch) -> None:
    """Six prompts x 32 greedy tokens on a tiny random Llama (fixed seed): at least 98% of
    the tokens agree with transformers' bf16 generate (teacher-forced)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = hf_dirs["llama"]
    ref_model = _hf_bf16(path)
    ps = prompts(AGREE_LENGTHS, seed=11)
    refs = []
    with torch.no_grad():
        for p in ps:
            out = ref_model.generate(torch.tensor([p]), max_new_tokens=AGREE_NEW,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=128)
    assert llm.engine.runner.backend == "native"
    forced, free = agreement(llm, ps, refs)
    n = len(ps) * AGREE_NEW
    print(f"\nbf16 greedy agreement with transformers bf16 over {n} tokens: "
          f"{forced:.1%} teacher-forced, {free:.1%} free-running")
    assert forced >= MIN_AGREEMENT, f"{forced:.1%} of {n} greedy tokens agree"


# --- prefix caching and chunked prefill ------------------------------------------------

def test_bf16_chunked_and_prefix_cached_equal_whole_prefill(hf_dirs) -> None:
    """The same greedy tokens (and logits) whether prompts are prefilled whole without a
    prefix cache, in 7-token chunks, or after a cached shared prefix; the bf16 kernels are
    row-wise, so batch composition does not change a row's values."""
    shared = prompts((40,), seed=4)[0]
    ps = [shared + p for p in prompts((5, 23, 1), seed=6)] + prompts((3, 33), seed=7)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_logits=True)
    path = str(hf_dirs["qwen3"])
    whole = LLM(path, dtype="bfloat16", num_kv_blocks=96, enable_prefix_caching=False)
    base = whole.generate(ps, sp)
    for chunk in (7, 16):
        llm = LLM(path, dtype="bfloat16", num_kv_blocks=96, max_num_batched_tokens=chunk)
        llm.generate([ps[0]], sp)  # caches the shared prefix
        outs = llm.generate(ps, sp)
        assert llm.engine.stats()["prefix_hit_tokens"] >= 32
        for a, b in zip(outs, base):
            assert a.output_token_ids == b.output_token_ids
            torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=0,
                                       rtol=0)
