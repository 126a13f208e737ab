"""Prefix caching: hits are exact, give the same logits as a cold run, and ref counts
go back to zero."""

from __future__ import annotations

import torch

from kvpool.engine import LLM, Engine, EngineConfig, SamplingParams
from kvpool.engine.request import Request

from .helpers import prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, return_logits=True)


def _pair():
    (shared,) = prompts((40,), seed=7)
    return shared + [5, 6, 7], shared[:35] + [9, 9, 9, 9, 9]


def _assert_same(a, b):
    assert a.output_token_ids == b.output_token_ids
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-5, rtol=0)


def test_hit_gives_cold_logits(hf_dirs):
    first, second = _pair()
    warm = LLM(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=16)
    warm.generate([first], GREEDY)
    hit = warm.generate([second], GREEDY)[0]
    assert hit.num_prefix_hit_tokens == 32  # two full shared blocks
    cold = LLM(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=16,
               enable_prefix_caching=False).generate([second], GREEDY)[0]
    assert cold.num_prefix_hit_tokens == 0
    _assert_same(hit, cold)
    stats = warm.engine.stats()
    assert stats["prefix_hit_tokens"] == 32 and stats["kv_blocks"]["used"] == 0


def test_hit_is_capped_below_the_prompt_length(hf_dirs):
    """A prompt made only of cached full blocks still computes its last token."""
    (p,) = prompts((32,), seed=3)
    llm = LLM(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=16)
    a = llm.generate([p], GREEDY)[0]
    b = llm.generate([p], GREEDY)[0]
    assert b.num_prefix_hit_tokens == 16
    _assert_same(a, b)


def test_shared_blocks_are_ref_counted_while_running(hf_dirs):
    first, second = _pair()
    eng = Engine(EngineConfig(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=16))
    ra = eng.add_request(first, GREEDY)
    eng.step()  # prefill of the first request: its full blocks are now cached
    rb = eng.add_request(second, GREEDY)
    eng.step()
    a, b = eng.requests[ra], eng.requests[rb]
    assert b.block_ids[:2] == a.block_ids[:2]
    assert [eng.pool.ref_count(x) for x in a.block_ids[:2]] == [2, 2]
    eng.check_integrity()
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
    assert eng.pool.num_used_blocks == 0
    assert all(eng.pool.ref_count(x) == 0 for x in range(1, eng.pool.capacity))


def test_equal_hash_with_other_tokens_is_a_miss(hf_dirs, monkeypatch):
    """Even if every block hashed alike, the stored tokens decide."""
    monkeypatch.setattr(Request, "block_hash", lambda self, i, bs: 42)
    first, second = prompts((40, 40), seed=11)
    llm = LLM(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=16)
    llm.generate([first], GREEDY)
    out = llm.generate([second], GREEDY)[0]
    assert out.num_prefix_hit_tokens == 0
    cold = LLM(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=16,
               enable_prefix_caching=False).generate([second], GREEDY)[0]
    _assert_same(out, cold)


def test_same_step_hit_reads_this_steps_kv(hf_dirs):
    """Two prompts sharing a prefix admitted in one step: the second hits the blocks the
    first fills in that very step (computed once), and both equal cold solo runs — with
    either attention backend."""
    first, second = _pair()
    for backend in ("native", "torch"):
        llm = LLM(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=16,
                  attention_backend=backend)
        a, b = llm.generate([first, second], GREEDY)
        assert (a.num_prefix_hit_tokens, b.num_prefix_hit_tokens) == (0, 32)
        assert llm.engine.stats()["steps"] == GREEDY.max_tokens  # both prefilled in step 1
        for got, p in ((a, first), (b, second)):
            cold = LLM(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=16,
                       enable_prefix_caching=False).generate([p], GREEDY)[0]
            assert got.output_token_ids == cold.output_token_ids
            torch.testing.assert_close(torch.stack(got.logits), torch.stack(cold.logits),
                                       atol=5e-5, rtol=0)  # hit vs cold: other summation order


def _hf_greedy(path, p, n):
    """transformers' greedy continuation of ``p`` and the logits of each new token."""
    from .helpers import load_hf

    ref = load_hf(path)
    with torch.no_grad():
        gen = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0]
        logits = ref(gen[None]).logits[0, len(p) - 1:-1]
    return gen[len(p):].tolist(), logits


def test_chunks_across_a_cached_prefix_match_transformers(hf_dirs):
    """The prefix is written by chunks that split its blocks (5, 12 tokens), the hit's
    remaining 33 tokens are prefilled in chunks that start mid-block after it (natively;
    the torch backend at 12): greedy tokens identical to transformers and logits within
    1e-4; the hit computes only the tokens after the prefix."""
    first, _ = _pair()
    (tail,) = prompts((33,), seed=8)
    second = first[:32] + tail
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True)
    ref_tokens, ref_logits = _hf_greedy(hf_dirs["llama"], second, sp.max_tokens)
    for backend, chunk in (("native", 5), ("native", 12), ("torch", 12)):
        llm = LLM(str(hf_dirs["llama"]), num_kv_blocks=64, block_size=16,
                  max_num_batched_tokens=chunk, attention_backend=backend)
        llm.generate([first], sp)
        before = llm.engine.stats()["computed_tokens"]
        out = llm.generate([second], sp)[0]
        assert out.num_prefix_hit_tokens == 32, (backend, chunk)
        # 33 prompt tokens after the prefix + 5 decode steps: nothing of the prefix
        assert llm.engine.stats()["computed_tokens"] - before == 33 + 5
        assert out.output_token_ids == ref_tokens, (backend, chunk)
        torch.testing.assert_close(torch.stack(out.logits), ref_logits, atol=1e-4,
                                   rtol=0)
