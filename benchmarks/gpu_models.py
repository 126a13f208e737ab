"""Random-weight Llama checkpoints of realistic size for the GPU benchmarks, written fast.

``kvpool.engine.model.tiny.make_tiny_model`` writes float32 weights drawn on the CPU, which for a
1B-parameter model means ~4 GB of file and tens of seconds; here the tokenizer and the
config files come from ``make_tiny_model`` at a tiny size, then ``config.json`` gets the
real dimensions and ``model.safetensors`` is rewritten with weights drawn on the GPU (when
there is one) directly in the target dtype.

Presets: ``tiny`` (the CPU benchmarks' model), ``llama-1b`` (16 layers, hidden 2048,
16 heads / 8 KV heads of 128, MLP 5632, vocab 32000: about 1.1 B parameters, 2.2 GB bf16).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

PRESETS = {
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512),
    "llama-1b": dict(layers=16, hidden=2048, heads=16, kv_heads=8, intermediate=5632,
                     vocab=32000),
}


def model_dir(preset: str, dtype: str, default: str | Path) -> Path:
    """Where a preset's checkpoint lives: under $KVPOOL_BENCH_MODELS when set (shared by
    the benchmarks of one gpu_check.sh run, written once), else ``default``."""
    cache = os.environ.get("KVPOOL_BENCH_MODELS")
    return Path(cache) / f"{preset}-{dtype}" if cache else Path(default)


def make_model(path: str | Path, preset: str = "llama-1b", dtype: str = "bfloat16",
               seed: int = 0, device: str | None = None) -> Path:
    """Write a ``preset``-sized random Llama into ``path`` (kept if already there)."""
    from kvpool.engine.model.tiny import make_tiny_model, random_weights

    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[preset]
    path = Path(path)
    stamp = path / ".preset"
    want = f"{preset} {dtype} {seed}"
    if stamp.exists() and stamp.read_text() == want:
        return path
    make_tiny_model(path, layers=1, hidden=64, heads=4, kv_heads=2, vocab=p["vocab"], seed=seed)
    cfg = json.loads((path / "config.json").read_text())
    head_dim = p["hidden"] // p["heads"]
    cfg.update(hidden_size=p["hidden"], intermediate_size=p["intermediate"],
               num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
               num_key_value_heads=p["kv_heads"], head_dim=head_dim,
               initializer_range=0.02, dtype=dtype, torch_dtype=dtype)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    weights = random_weights(cfg, seed, dtype=getattr(torch, dtype),
                             device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    stamp.write_text(want)
    return path


def kv_bytes_per_token(preset: str, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token."""
    p = PRESETS[preset]
    return 2 * p["layers"] * p["kv_heads"] * (p["hidden"] // p["heads"]) * dtype_bytes



if __name__ == "__main__":  # python benchmarks/gpu_models.py DIR [PRESET] [DTYPE]
    import sys

    print(make_model(sys.argv[1], *sys.argv[2:]))
