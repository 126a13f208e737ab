"""ModelConfig: the fields of a Hugging Face ``config.json`` the Llama-family model needs,
with :class:`MoEConfig` for the Mixture-of-Experts members (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.engine.errors import CheckpointError

# model_type -> (q/k/v always biased, has q/k norm). Llama/Mistral/Qwen3 put
# ``attention_bias`` on q/k/v/o; Qwen2 always biases q/k/v and never o, whatever the config
# (Qwen2-MoE likewise, unless its config sets ``qkv_bias`` false).
_ARCHS = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "mixtral": (False, False),
    "qwen2_moe": (True, False),
    "qwen3_moe": (False, True),
}
_MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a Mixture-of-Experts model.

    Per token the router's softmax over ``num_experts`` logits picks the ``top_k`` largest
    probabilities (renormalised to sum 1 when ``norm_topk_prob``: always for Mixtral); the
    token's MLP output is the weighted sum of those experts' SwiGLU outputs, plus, with
    ``shared_expert_intermediate_size`` > 0 (Qwen2-MoE), a shared SwiGLU expert scaled by
    ``sigmoid(shared_expert_gate(x))``. Layer ``i`` is sparse unless it is in
    ``mlp_only_layers`` or ``(i + 1) % sparse_step != 0``; the others have the dense MLP of
    ``ModelConfig.intermediate_size``. ``weights_in_model_dtype``: the routing weights are
    cast to the activations' dtype before scaling (Qwen) rather than scaling in float32
    (Mixtral); the same in float32.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    weights_in_model_dtype: bool = False

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0


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
    moe: MoEConfig | None = None  # None: every layer has the dense MLP

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
        if mt == "qwen2_moe":
            qwen2_bias = bool(d.get("qkv_bias", True))
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
            moe=_read_moe(d) if mt in _MOE_ARCHS else None,
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


def _read_moe(d: dict[str, Any]) -> MoEConfig | None:
    """Mixtral: ``num_local_experts`` experts of ``intermediate_size`` on every layer, top-k
    always renormalised. Qwen2/3-MoE: ``num_experts`` (transformers 5 may write it as
    ``num_local_experts``) of ``moe_intermediate_size``, ``norm_topk_prob``,
    ``decoder_sparse_step``, ``mlp_only_layers``, and for Qwen2-MoE a shared expert."""
    mt = d["model_type"]
    _refuse_sliding_window(d)
    experts = d.get("num_experts") if mt != "mixtral" else None
    experts = int(experts or d.get("num_local_experts") or 0)
    if experts == 0:  # Qwen-MoE with no experts: every layer dense
        return None
    top_k = int(d.get("num_experts_per_tok", 2 if mt == "mixtral" else 4))
    if not 0 < top_k <= experts:
        raise CheckpointError(f"num_experts_per_tok={top_k} must be in 1..{experts} "
                              "(the number of experts)")
    if mt == "mixtral":
        return MoEConfig(num_experts=experts, top_k=top_k,
                         intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True)
    if "moe_intermediate_size" not in d:
        raise CheckpointError("config.json lacks required key(s): moe_intermediate_size")
    step = int(d.get("decoder_sparse_step") or 1)
    return MoEConfig(
        num_experts=experts, top_k=top_k, intermediate_size=int(d["moe_intermediate_size"]),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0)
        if mt == "qwen2_moe" else 0,
        sparse_step=step, mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        weights_in_model_dtype=True)


def _refuse_sliding_window(d: dict[str, Any]) -> None:
    """The engine attends over the whole context: refuse a checkpoint whose attention is
    windowed (Mixtral ``sliding_window`` shorter than the context, Qwen
    ``use_sliding_window``) rather than answer differently from the reference."""
    window = d.get("sliding_window")
    if d["model_type"] == "mixtral":
        windowed = window is not None and int(window) < int(d.get("max_position_embeddings",
                                                                  2048))
    else:
        windowed = bool(d.get("use_sliding_window", False)) or \
            "sliding_attention" in (d.get("layer_types") or ())
    if windowed:
        raise CheckpointError(f"sliding-window attention (sliding_window={window}) is not "
                              f"supported for model_type {d['model_type']!r}")


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
