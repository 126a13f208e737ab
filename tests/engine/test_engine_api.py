"""Step-level Engine API: abort, staggered arrivals, input validation, stats and the
injection points for KV storage and block pools."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine import (LLM, Engine, EngineConfig, FixedBlockPool, KVCache, RequestError,
                           SamplingParams)

from .helpers import prompts

SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LENGTHS = (9, 30, 17)


@pytest.fixture(scope="module")
def solo(hf_dirs):
    llm = LLM(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=8)
    return [llm.generate([p], SP)[0].output_token_ids for p in prompts(LENGTHS)]


def _engine(hf_dirs, **kw):
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("block_size", 8)
    return Engine(EngineConfig(str(hf_dirs["llama"]), **kw))


def _drain(eng):
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done


def test_staggered_arrivals_equal_solo_runs(hf_dirs, solo):
    eng = _engine(hf_dirs, max_num_batched_tokens=12)
    ps = prompts(LENGTHS)
    done = {}
    for i, p in enumerate(ps):
        eng.add_request(p, SP, request_id=f"r{i}")
        for _ in range(3):
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
    done |= _drain(eng)
    assert [done[f"r{i}"].output_token_ids for i in range(3)] == solo


def test_abort_waiting_and_running(hf_dirs, solo):
    eng = _engine(hf_dirs, max_num_seqs=1)
    ps = prompts(LENGTHS)
    ids = [eng.add_request(p, SP) for p in ps]
    eng.step()
    eng.step()
    assert eng.requests[ids[0]].block_ids  # running
    assert not eng.requests[ids[2]].block_ids  # waiting
    out = eng.abort(ids[0])
    assert out.finished and out.finish_reason == "abort" and len(out.output_token_ids) >= 1
    assert eng.abort(ids[2]).finish_reason == "abort"
    assert eng.abort(ids[2]) is None and eng.abort("nope") is None
    eng.check_integrity()
    done = _drain(eng)
    assert list(done) == [ids[1]] and done[ids[1]].output_token_ids == solo[1]
    assert eng.pool.num_used_blocks == 0
    assert eng.stats()["finished_requests"] == 3


def test_request_validation(hf_dirs):
    eng = _engine(hf_dirs, max_model_len=64)
    with pytest.raises(RequestError, match="max_model_len"):
        eng.add_request(list(range(64)))
    with pytest.raises(RequestError, match="token ids"):
        eng.add_request([1, 2, 10_000])
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([])
    with pytest.raises(RequestError, match="tokenizer"):
        eng.add_request("hello")  # the transformers-written folder has no tokenizer.json
    eng.add_request([1, 2, 3], SP, request_id="x")
    with pytest.raises(RequestError, match="duplicate"):
        eng.add_request([1, 2, 3], SP, request_id="x")
    _drain(eng)


def test_generation_stops_at_max_model_len(hf_dirs):
    eng = _engine(hf_dirs, max_model_len=40)
    eng.add_request(prompts((30,))[0], SamplingParams(temperature=0, max_tokens=100,
                                                      ignore_eos=True))
    (out,) = _drain(eng).values()
    assert out.finish_reason == "length" and len(out.output_token_ids) == 10


def test_injected_kv_buffers(hf_dirs, solo):
    """KV storage handed in from outside (raw byte buffers, as a kvpool adapter maps them)
    is used in place, for both layouts."""
    ps = prompts(LENGTHS)
    for layout in ("block_major", "per_layer"):
        made = []

        def factory(spec, num_blocks, device, made=made):
            raw = [torch.zeros(num_blocks * spec.buffer_block_bytes + 100, dtype=torch.uint8)
                   for _ in range(spec.num_buffers)]
            made.append(raw)
            return KVCache.from_buffers(spec, raw)

        llm = LLM(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=8, kv_layout=layout,
                  kv_cache_factory=factory)
        assert len(made[0]) == (1 if layout == "block_major" else 4)
        assert [o.output_token_ids for o in llm.generate(ps, SP)] == solo
        assert any(b.any() for b in made[0]), "KV was not written into the given buffers"


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("layout", ["block_major", "per_layer"])
def test_padded_kv_blocks_give_the_same_tokens(hf_dirs, solo, layout, backend):
    """Blocks spaced further apart than their size (``block_stride``: padding after each,
    as kvpool's adapters pad a block so it divides its allocation unit) give the same
    greedy tokens, and the padding is never written (it holds NaN bytes: a read of it
    would poison the scores; the blocks start zeroed, as fresh pages do)."""
    made = []

    def factory(spec, num_blocks, device):
        block, stride = spec.buffer_block_bytes, spec.buffer_block_bytes + 192
        raw = [torch.zeros((num_blocks * stride,), dtype=torch.uint8)
               for _ in range(spec.num_buffers)]
        for b in raw:
            b.view(num_blocks, stride)[:, block:] = 0xFF  # NaN as float32
        made.append((raw, block, stride, num_blocks))
        return KVCache.from_buffers(spec, raw, block_stride=stride)

    llm = LLM(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=8, kv_layout=layout,
              attention_backend=backend, kv_cache_factory=factory)
    assert [o.output_token_ids for o in llm.generate(prompts(LENGTHS), SP)] == solo
    ((raw, block, stride, n),) = made
    for b in raw:
        rows = b.view(n, stride)
        assert bool((rows[:, block:] == 0xFF).all()), "a block's padding was written"
        assert bool((rows[:, :block] != 0xFF).any()), "KV was not written into the buffers"


def test_from_buffers_rejects_a_stride_that_does_not_hold_a_block():
    from kvpool.engine import KVCacheSpec

    spec = KVCacheSpec(2, 8, 2, 16, torch.float32, "per_layer")  # 1 KiB blocks
    bufs = [torch.zeros(4096, dtype=torch.uint8) for _ in range(4)]
    for bad in (1000, 1026):  # smaller than a block; not whole float32 elements
        with pytest.raises(ValueError, match="stride"):
            KVCache.from_buffers(spec, bufs, block_stride=bad)
    kv = KVCache.from_buffers(spec, bufs, block_stride=2048)
    assert kv.num_blocks == 2 and kv.layers[0][0].stride(0) == 512  # elements


def test_from_buffers_rejects_bad_storage():
    from kvpool.engine import KVCacheSpec

    spec = KVCacheSpec(2, 8, 2, 16, torch.float32, "per_layer")
    with pytest.raises(ValueError, match="4 buffer"):
        KVCache.from_buffers(spec, [torch.zeros(10_000)])
    with pytest.raises(ValueError, match="hold"):
        KVCache.from_buffers(spec, [torch.zeros(10) for _ in range(4)], num_blocks=4)
    kv = KVCache.from_buffers(spec, [torch.zeros(4 * 8 * 2 * 16) for _ in range(4)])
    assert kv.num_blocks == 4 and kv.layers[1][0].shape == (4, 8, 2, 16)


def test_block_pool_instance_and_stats(hf_dirs, solo):
    pool = FixedBlockPool(48)
    eng = Engine(EngineConfig(str(hf_dirs["llama"]), block_size=8), block_pool=pool)
    assert eng.pool is pool and eng.kv_cache.num_blocks == 48
    for p in prompts(LENGTHS):
        eng.add_request(p, SP)
    done = _drain(eng)
    assert [o.output_token_ids for o in done.values()] == solo
    s = eng.stats()
    assert s["kv_blocks"]["total"] == 47 and s["kv_blocks"]["used"] == 0
    assert s["generated_tokens"] == 30 and s["finished_requests"] == 3
    assert s["ttft_s"]["count"] == 3 and s["tpot_s"]["p50"] > 0
    assert all(o.ttft > 0 and o.tpot > 0 for o in done.values())


def test_kv_cache_size_in_bytes(hf_dirs):
    eng = _engine(hf_dirs, num_kv_blocks=None, kv_cache_size="1MiB")
    assert eng.pool.capacity == (1 << 20) // eng.kv_spec.block_bytes
    with pytest.raises(TypeError, match="bogus"):
        LLM(str(hf_dirs["llama"]), bogus=1)
