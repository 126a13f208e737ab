"""ModelConfig: the fields of a Hugging Face ``config.json`` the Llama-family model needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.engine.errors import CheckpointError

# model_type -> (q/k/v always biased, has q/k norm). Llama/Mistral/Qwen3 put
# ``attention_bias`` on q/k/v/o; Qwen2 always biases q/k/v and never o, whatever the config.
_ARCHS = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type + its parameters
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        mt = d.get("model_type")
        if mt not in _ARCHS:
            raise CheckpointError(
                f"unsupported model_type {mt!r} (architectures={d.get('architectures')}); "
                f"supported: {', '.join(sorted(_ARCHS))}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in d]
        if missing:
            raise CheckpointError(f"config.json lacks required key(s): {', '.join(missing)}")
        qwen2_bias, qk_norm = _ARCHS[mt]
        attention_bias = bool(d.get("attention_bias", False))
        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
        theta, scaling = _read_rope(d)
        eos = d.get("eos_token_id")
        return cls(
            model_type=mt,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qwen2_bias or attention_bias,
            o_bias=attention_bias and not qwen2_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=qk_norm,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
            eos_token_ids=_as_list(eos),
            bos_token_id=d.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        f = path / "config.json"
        if not path.is_dir():
            raise CheckpointError(f"model folder {path} does not exist")
        if not f.is_file():
            raise CheckpointError(f"model folder {path} has no config.json")
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{f} is not valid JSON: {e}") from None
        cfg = cls.from_dict(d)
        gen = path / "generation_config.json"  # its eos list (e.g. Llama 3 chat) wins
        if gen.is_file():
            try:
                g = json.loads(gen.read_text())
                cfg.eos_token_ids = _as_list(g.get("eos_token_id")) or cfg.eos_token_ids
            except json.JSONDecodeError:
                pass
        return cfg


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, list) else [int(x)]


def _read_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """transformers 5.x writes ``rope_parameters: {rope_theta, rope_type, ...}``; 4.x writes a
    top-level ``rope_theta`` plus an optional ``rope_scaling`` dict. Accept both."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # v5 per-layer-type form: {"full_attention": {...}, ...}
        params = next(iter(params.values()), None)
    scaling = dict(d.get("rope_scaling") or {})
    if isinstance(params, dict):
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = {**scaling, **{k: v for k, v in params.items() if k != "rope_theta"}}
    else:
        theta = d.get("rope_theta", 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    scaling["rope_type"] = rope_type
    if rope_type not in ("default", "linear", "llama3"):
        raise CheckpointError(f"unsupported rope_type {rope_type!r} (supported: default, "
                              "linear, llama3)")
    return float(theta), scaling
