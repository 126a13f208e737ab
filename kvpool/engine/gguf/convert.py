"""GGUF file -> Hugging Face checkpoint folder (``kvpool make-model --from-gguf FILE DIR``).

The folder holds what the bundled engine, transformers and vLLM load: ``config.json``
(``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``), ``model.safetensors``
with Hugging Face tensor names in the engine dtype, ``tokenizer.json`` +
``tokenizer_config.json`` (:mod:`kvpool.engine.gguf.tokenizer`), ``generation_config.json``
and, when the file has one, ``chat_template.jinja``.

Rotary layout. llama.cpp's converter reorders the rows of every Llama q/k projection so that
each head's rotary pairs are interleaved: within a head of ``d`` rows, Hugging Face row
``j * d/2 + i`` (half ``j`` of the rotate-half layout) is stored at GGUF row ``2 * i + j``.
:func:`unpermute_rotary` undoes that (the same reshape/swap as transformers' GGUF loader).
Qwen 2/3 files are written without the reordering and are copied as they are.

Llama 3.1-style rope scaling is stored by llama.cpp as a tensor of per-frequency divisors
(``rope_freqs.weight``); :func:`llama3_rope_scaling` recovers the config's ``rope_scaling``
from it (and checks the recovered parameters reproduce every stored value).

All checks (magic, truncation, tensor types, every tensor present with the shape the
metadata implies, no stray tensor, the tokenizer) run before anything is written; the folder
is then written under a temporary name beside ``DIR`` and renamed into place, so a failure
leaves no ``DIR`` behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.engine.gguf.read import F32Array, GGUFError, GGUFFile
from kvpool.engine.gguf.tokenizer import GGUFTokenizer, build_tokenizer, tokenizer_config

# GGUF architecture -> (Hugging Face model_type, architecture class, q/k rows reordered)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}
DTYPES = ("float32", "bfloat16", "float16")
SHARD_BYTES = 4 << 30

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass
class ConvertResult:
    path: Path
    config: dict[str, Any]
    tensors: int
    seconds: float
    notes: list[str] = field(default_factory=list)


@dataclass
class _Plan:
    """Everything checked and decided before the first byte is written."""

    gguf: GGUFFile
    config: dict[str, Any]
    tokenizer: GGUFTokenizer
    names: dict[str, str]  # GGUF tensor name -> Hugging Face name
    unpermute: dict[str, int]  # GGUF tensor name -> heads to un-reorder (q/k of llama)
    notes: list[str]


def convert_gguf(src: str | Path, dst: str | Path, dtype: str = "float32",
                 log: Callable[[str], None] | None = None,
                 shard_bytes: int = SHARD_BYTES) -> ConvertResult:
    """Convert GGUF file ``src`` into the checkpoint folder ``dst`` (absent or empty).
    Weights beyond ``shard_bytes`` go into several safetensors files plus
    ``model.safetensors.index.json``; at most one shard is held in memory.

    Raises:
        GGUFError: ``dst`` is not empty, or the file cannot be converted (the message, one
            line, says why); ``dst`` is then left as it was.
    """
    t0 = time.perf_counter()
    dst = Path(dst)
    if dtype not in DTYPES:
        raise GGUFError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise GGUFError(f"{dst} exists and is not an empty folder")
    plan = _plan(GGUFFile(src))
    for note in plan.notes:
        if log:
            log(note)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        _write(plan, tmp, dtype, shard_bytes)
        _default_modes(tmp)
        if dst.exists():
            dst.rmdir()  # empty (checked above)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConvertResult(dst, plan.config, len(plan.names), time.perf_counter() - t0,
                         plan.notes)


def _plan(g: GGUFFile) -> _Plan:
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{g.path}: unsupported architecture {arch!r} (supported: "
                        f"{', '.join(ARCHITECTURES)})")
    bad = g.unsupported_tensors()
    if bad:
        from kvpool.engine.gguf.read import SUPPORTED_TYPES

        kinds = sorted({t.type_name for t in bad})
        raise GGUFError(f"{g.path}: unsupported tensor type(s) {', '.join(kinds)} (e.g. "
                        f"{bad[0].name}); supported: {', '.join(SUPPORTED_TYPES)}")
    tok = build_tokenizer(g.metadata)
    config = _config(g, arch, tok)
    names, unpermute = _check_tensors(g, arch, config)
    return _Plan(g, config, tok, names, unpermute, list(tok.notes))


def _need(g: GGUFFile, key: str) -> Any:
    value = g.get(key)
    if value is None:
        raise GGUFError(f"{g.path}: metadata key {key} is missing")
    return value


def _config(g: GGUFFile, arch: str, tok: GGUFTokenizer) -> dict[str, Any]:
    model_type, cls, _ = ARCHITECTURES[arch]
    hidden = int(_need(g, f"{arch}.embedding_length"))
    heads = int(_need(g, f"{arch}.attention.head_count"))
    kv_heads = int(g.get(f"{arch}.attention.head_count_kv") or heads)
    head_dim = int(g.get(f"{arch}.attention.key_length") or hidden // heads)
    value_dim = int(g.get(f"{arch}.attention.value_length") or head_dim)
    rope_dim = int(g.get(f"{arch}.rope.dimension_count") or head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise GGUFError(f"{g.path}: key/value/rotary dims {head_dim}/{value_dim}/{rope_dim} "
                        "differ (unsupported)")
    if heads % kv_heads:
        raise GGUFError(f"{g.path}: {heads} heads do not divide by {kv_heads} KV heads")
    embd = g.tensors.get("token_embd.weight")
    vocab = int(g.get(f"{arch}.vocab_size") or (embd.shape[0] if embd else
                                                len(g.get("tokenizer.ggml.tokens") or [])))
    config: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_need(g, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_need(g, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(g.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6),
        "max_position_embeddings": int(g.get(f"{arch}.context_length") or 2048),
        "rope_theta": float(g.get(f"{arch}.rope.freq_base") or 10000.0),
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in g.tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    scaling = g.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        factor = g.get(f"{arch}.rope.scaling.factor")
        if scaling != "linear" or not factor:
            raise GGUFError(f"{g.path}: unsupported rope scaling {scaling!r}")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    if "rope_freqs.weight" in g.tensors:
        config["rope_scaling"] = llama3_rope_scaling(
            g.dequantize("rope_freqs.weight"), config["rope_theta"], head_dim,
            g.get(f"{arch}.rope.scaling.original_context_length"), str(g.path))
    for key, value in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                       ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                       ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if g.get(value) is not None:
            config[key] = int(g.get(value))
    vocab_tokens = len(g.get("tokenizer.ggml.tokens") or [])
    if vocab_tokens > vocab:
        raise GGUFError(f"{g.path}: the tokenizer has {vocab_tokens} tokens, the model's "
                        f"vocabulary {vocab}")
    return config


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                        original: int) -> F32Array:
    """The per-frequency divisors llama.cpp's converter stores as ``rope_freqs.weight`` for
    Llama 3.1-style rope scaling: 1 for short wavelengths, ``factor`` for long ones, and a
    smooth blend between ``original / high`` and ``original / low``."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    blend = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original / high, 1.0,
                   np.where(wavelen > original / low, factor, blend))
    return out.astype(np.float32)


def llama3_rope_scaling(stored: F32Array, theta: float, head_dim: int,
                        original: int | None, where: str) -> dict[str, Any]:
    """The ``rope_scaling`` of config.json (rope_type llama3) that reproduces the stored
    ``rope_freqs.weight``: its factor is the largest divisor; low/high frequency factors and
    the original context are tried among the values Llama 3.x uses.

    Raises:
        GGUFError: no such parameters reproduce the stored divisors.
    """
    stored = np.asarray(stored, np.float32).reshape(-1)
    if stored.shape != (head_dim // 2,):
        raise GGUFError(f"{where}: rope_freqs.weight has {stored.size} values, head_dim "
                        f"{head_dim} implies {head_dim // 2}")
    factor = float(stored.max())
    for orig in dict.fromkeys(([int(original)] if original else []) + [8192]):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
            want = llama3_rope_factors(theta, head_dim, factor, low, high, orig)
            if np.allclose(stored, want, rtol=1e-4, atol=1e-5):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise GGUFError(f"{where}: rope_freqs.weight matches no Llama 3 rope scaling (factor "
                    f"{factor}); unsupported")


def expected_shapes(arch: str, c: dict[str, Any], present: set[str]
                    ) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape for every tensor the model of config ``c`` needs
    (optional ones -- biases, a lm head -- only when ``present`` has them)."""
    h, v, inter = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    hd = c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        out["output.weight"] = (v, h)
    layer = {"attn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
             "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_norm.weight": (h,),
             "ffn_gate.weight": (inter, h), "ffn_up.weight": (inter, h),
             "ffn_down.weight": (h, inter)}
    if arch == "qwen2" or c.get("attention_bias"):
        layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if c.get("attention_bias"):
        layer["attn_output.bias"] = (h,)
    if arch == "qwen3":
        layer |= {"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)}
    for i in range(c["num_hidden_layers"]):
        out |= {f"blk.{i}.{k}": s for k, s in layer.items()}
    return out


def _check_tensors(g: GGUFFile, arch: str, c: dict[str, Any]
                   ) -> tuple[dict[str, str], dict[str, int]]:
    want = expected_shapes(arch, c, set(g.tensors))
    missing = [n for n in want if n not in g.tensors]
    if missing:
        raise GGUFError(f"{g.path}: missing tensor(s) {_first(missing)} for the "
                        f"{c['num_hidden_layers']}-layer config in its metadata")
    extra = [n for n in g.tensors if n not in want and n != "rope_freqs.weight"]
    if extra:
        raise GGUFError(f"{g.path}: unexpected tensor(s) {_first(extra)}")
    for name, shape in want.items():
        got = g.tensors[name].shape
        if got != shape:
            raise GGUFError(f"{g.path}: tensor {name} has shape {list(got)}, the metadata "
                            f"implies {list(shape)}")
    names: dict[str, str] = {}
    unpermute: dict[str, int] = {}
    reorder = ARCHITECTURES[arch][2]
    for name in want:
        if name in _GLOBAL_TENSORS:
            names[name] = _GLOBAL_TENSORS[name]
            continue
        _, layer, leaf = name.split(".", 2)
        names[name] = f"model.layers.{layer}.{_LAYER_TENSORS[leaf]}"
        if reorder and leaf.startswith("attn_q."):
            unpermute[name] = c["num_attention_heads"]
        elif reorder and leaf.startswith("attn_k."):
            unpermute[name] = c["num_key_value_heads"]
    return names, unpermute


def unpermute_rotary(w: F32Array, heads: int) -> F32Array:
    """Undo llama.cpp's q/k row reordering (see the module docstring) of a weight
    ``(heads * d, in)`` or a bias ``(heads * d,)``."""
    d = w.shape[0] // heads
    return np.ascontiguousarray(
        w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def permute_rotary(w: F32Array, heads: int) -> F32Array:
    """llama.cpp's reordering (the inverse of :func:`unpermute_rotary`), for writing test
    files the way llama.cpp's converter does."""
    d = w.shape[0] // heads
    return np.ascontiguousarray(
        w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _write_weights(plan: _Plan, out: Path, dtype: str, shard_bytes: int) -> None:
    """model.safetensors, or shards of at most ``shard_bytes`` (a bigger tensor gets one of
    its own) named model-0000i-of-0000N.safetensors plus the index transformers writes."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    shards: list[list[str]] = []
    tensors: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal tensors, size
        if tensors:
            save_file(tensors, str(out / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
            shards.append(list(tensors))
            tensors, size = {}, 0

    for name, hf_name in plan.names.items():
        w = plan.gguf.dequantize(name)
        if name in plan.unpermute:
            w = unpermute_rotary(w, plan.unpermute[name])
        t = torch.from_numpy(np.ascontiguousarray(w)).to(torch_dtype)
        nbytes = t.numel() * t.element_size()
        if tensors and size + nbytes > shard_bytes:
            flush()
        tensors[hf_name] = t
        size += nbytes
        total += nbytes
    flush()
    if len(shards) == 1:
        (out / "shard-0.tmp").rename(out / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"shard-{i}.tmp").rename(out / file)
        weight_map |= dict.fromkeys(names, file)
    _json(out / "model.safetensors.index.json",
          {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write(plan: _Plan, out: Path, dtype: str, shard_bytes: int) -> None:
    _write_weights(plan, out, dtype, shard_bytes)
    config = {**plan.config, "dtype": dtype, "torch_dtype": dtype}
    tok = plan.tokenizer
    _json(out / "config.json", config)
    gen: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "pad_token_id")
                           if k in config}
    if tok.eos_token_ids:
        gen["eos_token_id"] = (tok.eos_token_ids if len(tok.eos_token_ids) > 1
                               else tok.eos_token_ids[0])
    _json(out / "generation_config.json", gen)
    tok.tokenizer.save(str(out / "tokenizer.json"))
    _json(out / "tokenizer_config.json",
          tokenizer_config(tok, config["max_position_embeddings"]))
    if tok.chat_template:
        (out / "chat_template.jinja").write_text(tok.chat_template)


def _default_modes(folder: Path) -> None:
    """mkdtemp made the folder private; give it and its files the modes of a plain mkdir."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def _json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _first(names: list[str], limit: int = 4) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
