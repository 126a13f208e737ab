"""Sampling parameters: seeds, top-k/top-p, stop ids/strings, max tokens, EOS."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine import LLM, RequestError, SamplingParams
from kvpool.engine.sampling import sample

PROMPT = "Once upon a time there was a little cat"
OTHERS = ["The weather today is", "Question: What is the capital of France? Answer:"]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), num_kv_blocks=128, block_size=8)


def _greedy(llm, n=20):
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n,
                                                 ignore_eos=True))[0]


def test_seed_reproducible_alone_or_batched(llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPT], sp)[0].output_token_ids
    batched = llm.generate(OTHERS + [PROMPT], [SamplingParams(temperature=1.0, max_tokens=20),
                                               SamplingParams(temperature=0.7, seed=9), sp])
    assert batched[2].output_token_ids == alone
    other = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=4321, max_tokens=20,
                                                  ignore_eos=True))[0]
    assert other.output_token_ids != alone


def test_top_k_one_and_tiny_top_p_equal_greedy(llm):
    greedy = _greedy(llm).output_token_ids
    for sp in (SamplingParams(temperature=1.5, top_k=1, max_tokens=20, ignore_eos=True),
               SamplingParams(temperature=1.0, top_p=1e-6, seed=3, max_tokens=20,
                              ignore_eos=True)):
        assert llm.generate([PROMPT], sp)[0].output_token_ids == greedy


def test_max_tokens(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_ids(llm):
    toks = _greedy(llm).output_token_ids
    stop = toks[6]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20,
                                                stop_token_ids=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.output_token_ids == toks[:toks.index(stop) + 1]


def test_stop_strings(llm):
    text = _greedy(llm, 30).text
    stop = text[10:13]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert stop not in out.text


def test_eos_and_ignore_eos(llm):
    toks = _greedy(llm).output_token_ids
    eng = llm.engine
    saved = set(eng.eos_token_ids)
    eng.eos_token_ids = {toks[3]}
    try:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))[0]
        assert out.finish_reason == "stop"
        assert out.output_token_ids == toks[:toks.index(toks[3]) + 1]
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20,
                                                    ignore_eos=True))[0]
        assert out.output_token_ids == toks
    finally:
        eng.eos_token_ids = saved


def test_top_k_restricts_support():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, [SamplingParams(temperature=5.0, top_k=2)], [g])[0]
            for _ in range(200)}
    assert seen == {1, 2}
    seen = {sample(logits, [SamplingParams(temperature=5.0, top_p=0.5)], [g])[0]
            for _ in range(200)}
    assert seen <= {1, 2, 3} and 1 in seen


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1),
                                dict(top_p=0), dict(top_p=1.5), dict(stop=[""])])
def test_invalid_params(kw):
    with pytest.raises(RequestError):
        SamplingParams(**kw)
