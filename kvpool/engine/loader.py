"""Load a Hugging Face checkpoint folder: config.json + *.safetensors (sharded or not).

Mixture-of-Experts checkpoints come in two namings, both accepted (per layer): the
per-expert one transformers writes by default (``mlp.experts.{e}.gate_proj/up_proj/
down_proj.weight``; Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``) and the fused
one of transformers 5's ``save_original_format=False`` (``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import safe_open

from kvpool.engine.errors import CheckpointError
from kvpool.engine.layers import PackedLinear
from kvpool.engine.model import LlamaForCausalLM
from kvpool.engine.model_config import ModelConfig
from kvpool.engine.moe import Experts

# Tensors some exporters write that carry no weights we need.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def find_shards(path: Path) -> list[Path]:
    """The safetensors files of a folder: those named by model.safetensors.index.json when
    present (every named shard must exist), else every ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is malformed: {e!r}") from None
        shards = [path / f for f in sorted(set(weight_map.values()))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shard(s) named in {index.name} are missing: "
                                  f"{', '.join(missing)}")
        return shards
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {', '.join(other)}; only safetensors are supported)" if other else ""
        raise CheckpointError(f"model folder {path} has no *.safetensors files{hint}")
    return shards


_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.weight$")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def canonical_name(key: str) -> str:
    """A checkpoint tensor name as :func:`expected_tensors` spells it: Mixtral's original
    ``block_sparse_moe`` / ``w1 w2 w3`` become ``mlp`` / ``gate_proj down_proj up_proj``;
    every other name is unchanged."""
    if ".block_sparse_moe." not in key:
        return key
    key = key.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(
        lambda m: f".experts.{m.group(1)}.{_MIXTRAL_PROJ[m.group(2)]}.weight", key)


def expected_tensors(model: LlamaForCausalLM, present: Collection[str] = ()
                     ) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Checkpoint tensor name (canonical, see :func:`canonical_name`) -> (destination,
    row offset, rows) for every tensor the model needs; the destination is our parameter or
    one expert's slice of it. A tied lm_head is absent: it shares the embedding's
    parameter. Experts are named per expert unless ``present`` (the checkpoint's canonical
    names) holds the fused ``experts.gate_up_proj`` of that layer."""
    modules = dict(model.named_modules())
    out: dict[str, tuple[torch.Tensor, int, int]] = {}
    for name, param in model.named_parameters():  # shared (tied) parameters listed once
        mod_name, _, leaf = name.rpartition(".")
        mod = modules[mod_name]
        if isinstance(mod, Experts) and f"{mod_name}.gate_up_proj" not in present:
            for e in range(mod.num_experts):
                if leaf == "gate_up_proj":
                    rows = param.shape[1] // 2
                    out[f"{mod_name}.{e}.gate_proj.weight"] = (param[e], 0, rows)
                    out[f"{mod_name}.{e}.up_proj.weight"] = (param[e], rows, rows)
                else:
                    out[f"{mod_name}.{e}.{leaf}.weight"] = (param[e], 0, param.shape[1])
        elif isinstance(mod, PackedLinear):
            parent = mod_name.rpartition(".")[0]
            offset = 0
            for part, rows in mod.parts:
                out[f"{parent}.{part}.{leaf}"] = (param, offset, rows)
                offset += rows
        else:
            out[name] = (param, 0, param.shape[0])
    return out


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype,
               config: ModelConfig | None = None) -> LlamaForCausalLM:
    """Build the model on ``device`` in ``dtype`` and fill every parameter from the folder.

    Raises:
        CheckpointError: missing config/shards, missing or unexpected tensors (the message
            lists them), or a tensor whose shape differs from what config.json implies.
    """
    path = Path(path)
    config = config or ModelConfig.from_dir(path)
    shards = find_shards(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty replaced the shared parameter by two copies
    where: dict[str, tuple[Path, str]] = {}  # canonical name -> (shard, name in the shard)
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as f:
                for key in f.keys():
                    where[canonical_name(key)] = (shard, key)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {shard}: {e}") from None
    present = {k for k in where if not k.endswith(_IGNORED_SUFFIXES)}
    expected = expected_tensors(model, present)
    if config.tie_word_embeddings:
        present.discard("lm_head.weight")  # some exporters keep the tied copy; it is redundant
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensor(s): {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected tensor(s): {_names(unexpected)}")
        raise CheckpointError(f"{path} does not match its config.json "
                              f"(model_type={config.model_type}): " + "; ".join(parts))
    by_shard: dict[Path, list[str]] = {}
    for name in expected:
        by_shard.setdefault(where[name][0], []).append(name)
    with torch.no_grad():
        for shard, names in by_shard.items():
            with safe_open(shard, framework="pt") as f:
                for name in names:
                    param, offset, rows = expected[name]
                    key = where[name][1]
                    t = f.get_tensor(key)
                    want = (rows, *param.shape[1:])
                    if tuple(t.shape) != want:
                        raise CheckpointError(f"{shard.name}: tensor {key} has shape "
                                              f"{tuple(t.shape)}, config.json implies {want}")
                    param[offset:offset + rows].copy_(t.to(dtype))
    return model.eval()


def _names(names: list[str], limit: int = 8) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
