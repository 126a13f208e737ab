"""Small hand-made GGUF files for the converter tests, written with ``gguf.GGUFWriter`` the
way llama.cpp's converter writes them: metadata under ``<arch>.*``, the tokenizer as
``tokenizer.ggml.*``, q/k rows of Llama reordered for interleaved rotary, 1-D tensors in F32
and 2-D ones in the type under test (quantized with ``gguf.quants``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from kvpool.engine.gguf.convert import permute_rotary

_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    _, _, layer, leaf = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[leaf]}"


def encode_tensor(w: np.ndarray, qtype: str) -> tuple[np.ndarray, Any]:
    """(array to write, raw_dtype) for ``w`` stored as GGUF type ``qtype``."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    return quants.quantize(w.astype(np.float32), T[qtype]), T[qtype]


def hf_to_gguf(hf_dir: Path, out: Path, qtype: str = "F32", *,
               edit_meta: Callable[[dict[str, Any]], None] | None = None,
               drop: tuple[str, ...] = (), extra: dict[str, tuple[np.ndarray, Any]] | None = None,
               chat_template: str | None = "{% for m in messages %}{{ m['content'] }}"
               "{% endfor %}") -> Path:
    """Write the tiny HF checkpoint ``hf_dir`` as a GGUF file ``out``.

    ``edit_meta`` may change the metadata dict before it is written, ``drop`` leaves GGUF
    tensors out, ``extra`` adds tensors (name -> (array, raw_dtype))."""
    import gguf

    c = json.loads((hf_dir / "config.json").read_text())
    arch = c["model_type"]
    weights = load_file(str(hf_dir / "model.safetensors"))
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"] | {a["content"]: a["id"] for a in tok["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    eos = vocab["<|endoftext|>"]
    # pad the vocabulary to the model's rows, as real files do
    tokens += [f"[PAD{i}]" for i in range(len(tokens), c["vocab_size"])]
    meta: dict[str, Any] = {
        "block_count": c["num_hidden_layers"], "context_length":
        c["max_position_embeddings"], "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"], "head_count":
        c["num_attention_heads"], "head_count_kv": c["num_key_value_heads"],
        "rope_freq_base": c["rope_theta"], "layer_norm_rms_eps": c["rms_norm_eps"],
        "rope_dimension_count": c["head_dim"], "vocab_size": c["vocab_size"],
    }
    if edit_meta:
        edit_meta(meta)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(meta["block_count"])
    w.add_context_length(meta["context_length"])
    w.add_embedding_length(meta["embedding_length"])
    w.add_feed_forward_length(meta["feed_forward_length"])
    w.add_head_count(meta["head_count"])
    w.add_head_count_kv(meta["head_count_kv"])
    w.add_rope_freq_base(meta["rope_freq_base"])
    w.add_layer_norm_rms_eps(meta["layer_norm_rms_eps"])
    w.add_rope_dimension_count(meta["rope_dimension_count"])
    w.add_vocab_size(meta["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    for hf_name, t in weights.items():
        name = gguf_name(hf_name)
        if name in drop:
            continue
        t = t.astype(np.float32)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = c["num_attention_heads"] if ".attn_q." in name else c["num_key_value_heads"]
            t = permute_rotary(t, heads)
        data, raw = encode_tensor(t, qtype if t.ndim == 2 else "F32")
        w.add_tensor(name, data, raw_dtype=raw)
    for name, (data, raw) in (extra or {}).items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
