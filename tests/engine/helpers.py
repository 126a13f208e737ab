"""Helpers shared by the engine tests."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvpool.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from kvpool.engine import LLM

VOCAB = 512


def save_hf(arch: str, path: Path) -> Path:
    """A random tiny checkpoint written by transformers' own save_pretrained."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  initializer_range=0.2, max_position_embeddings=512)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    else:
        cfg = tf.Qwen3Config(**common, head_dim=64, tie_word_embeddings=True)
        cls = tf.Qwen3ForCausalLM
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls(cfg).save_pretrained(path)
    return path


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    try:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    return m.eval()


def prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_references(dirs: dict[str, Path], archs: tuple[str, ...], lengths: tuple[int, ...],
                  new: int) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    """Per arch: transformers' greedy continuation of each of ``prompts(lengths)`` (``new``
    tokens) and the logits each continuation token came from."""
    out = {}
    for arch in archs:
        ref = load_hf(dirs[arch])
        rows = []
        for p in prompts(lengths):
            with torch.no_grad():
                gen = ref.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0]
                logits = ref(gen[None]).logits[0, len(p) - 1:-1]
            rows.append((gen[len(p):].tolist(), logits))
        out[arch] = rows
    return out


def agreement(llm: "LLM", prompt_ids: list[list[int]], refs: list[list[int]]
              ) -> tuple[float, float]:
    """(teacher-forced, free-running) fraction of ``refs``' tokens our greedy decoding
    reproduces. Teacher-forced: after a mismatch at position i, decoding restarts from the
    prompt + ``ref[:i + 1]`` (a prefix-cache hit), so each position is judged on the
    reference's own context."""
    sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    total = sum(len(r) for r in refs)
    free = forced = 0
    for p, ref in zip(prompt_ids, refs):
        got = llm.generate([p], sp(len(ref)))[0].output_token_ids
        free += sum(a == b for a, b in zip(got, ref))
        i = misses = 0
        while True:
            j = next((j for j, (a, b) in enumerate(zip(got, ref[i:])) if a != b), None)
            if j is None:
                break
            misses += 1
            i += j + 1
            if i == len(ref):
                break
            got = llm.generate([p + ref[:i]], sp(len(ref) - i))[0].output_token_ids
        forced += len(ref) - misses
    return forced / total, free / total
