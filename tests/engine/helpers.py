"""Helpers shared by the engine tests."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

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
