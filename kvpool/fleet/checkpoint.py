"""What a fleet needs to know of a model folder before starting its server, read without
loading any weight: whether the engine can load it, the bytes of its weights and of one
KV block.

:func:`inspect` runs the bundled engine's own checks that need no tensor (``config.json``
through :meth:`kvpool.engine.model.config.ModelConfig.from_dir`: supported architecture,
required keys; the weight files through :func:`kvpool.engine.model.loader.find_shards`: the
safetensors files, every shard an index names). A vLLM checkpoint gets the
engine-neutral part (a folder with a ``config.json`` object and weight files): vLLM
loads more architectures than the bundled engine.

The sizes are what a server of this fleet will hold: the weights' bytes are the weight
files' bytes (their headers included), doubled when the server converts 16-bit weights
to float32 (the bundled engine on the CPU); one KV block is ``BLOCK_TOKENS`` tokens of
every layer's keys and values (:class:`kvpool.engine.kv_cache.KVCacheSpec`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 16  # the engines' default block size (kvpool serve --block-size)
#: vLLM's default block size where its KV lives (its CPU platform sets 128)
VLLM_BLOCK_TOKENS = {"cpu": 128, "cuda": 16}
_ELEM_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class CheckpointInfo:
    weight_bytes: int  # as the server holds them
    kv_block_bytes: int  # one block: BLOCK_TOKENS tokens, every layer's K and V
    layers: int = 0  # (0: the config does not say)


def inspect(folder: Path, engine: str, float32: bool) -> CheckpointInfo:
    """Check ``folder`` for ``engine`` (see the module); ``float32``: the server holds
    weights and KV in float32 whatever the checkpoint's dtype. Raises ValueError (one
    line) when it cannot be loaded."""
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    config = _config(folder)
    if engine == "bundled":
        from kvpool.engine.errors import CheckpointError
        from kvpool.engine.model.loader import find_shards
        from kvpool.engine.model.config import ModelConfig

        try:
            ModelConfig.from_dir(folder)
            shards = find_shards(folder)
        except CheckpointError as e:
            raise ValueError(str(e)) from None
        except (ValueError, TypeError, KeyError) as e:  # a value of the wrong type
            raise ValueError(f"{folder / 'config.json'}: {type(e).__name__}: {e}") from None
    else:
        shards = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
        if not shards:
            raise ValueError(f"model folder {folder} has no weight files (*.safetensors)")
    stored = _elem_bytes(config)
    elem = 4 if float32 else stored
    files = sum(s.stat().st_size for s in shards)
    return CheckpointInfo(weight_bytes=files * elem // stored,
                          kv_block_bytes=_kv_block_bytes(config, elem),
                          layers=_int(config, "num_hidden_layers", 0))


def holds_float32(backend: str, args: tuple[str, ...], engine: str = "bundled") -> bool:
    """Whether a server on this backend holds float32 weights and KV: ``--dtype`` in
    ``args`` says; else a bundled one on the CPU does (its ``--dtype auto``), a vLLM one
    never (its ``auto`` is the checkpoint's dtype). ``auto`` is the backend this machine
    would open, as for the daemon."""
    from kvpool.vmm.registry import capabilities

    dtype = _arg(args, "--dtype")
    if dtype is not None:
        return dtype in ("float32", "float")
    return engine == "bundled" and capabilities(backend).tensor_device == "cpu"


def _arg(args: tuple[str, ...], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``; the last one)."""
    value = None
    for j, a in enumerate(args):
        if a == flag and j + 1 < len(args):
            value = args[j + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def vllm_kv_chunk_bytes(info: CheckpointInfo, page_size: int, backend: str,
                        args: tuple[str, ...]) -> int:
    """The least KV a vLLM member starts with: the whole units of the plugin's layout
    (:mod:`kvpool.engine_adapters.vllm.kv_units`: the layers apart, or interleaved and
    padded, whichever unit is smaller) that hold two blocks of ``--block-size`` tokens
    (vLLM's default where its KV lives: :data:`VLLM_BLOCK_TOKENS`). A page when the
    config or a ``--kv-cache-dtype`` leaves the block's size unknown here."""
    from kvpool.engine_adapters import kv_unit
    from kvpool.vmm.registry import capabilities

    kv_dtype = _arg(args, "--kv-cache-dtype")
    if info.kv_block_bytes <= 0 or info.layers <= 0 or kv_dtype not in (None, "auto"):
        return page_size
    given = _arg(args, "--block-size")
    tokens = int(given) if given is not None and given.isdigit() and int(given) > 0 else \
        VLLM_BLOCK_TOKENS.get(capabilities(backend).tensor_device, BLOCK_TOKENS)
    layer_page = info.kv_block_bytes // info.layers * tokens // BLOCK_TOKENS
    unit = kv_unit.plan_layers(layer_page, info.layers, page_size, pad=True)
    return -(-2 // unit.blocks_per_chunk) * unit.unit_bytes


def kv_chunk_bytes(info: CheckpointInfo, page_size: int) -> int:
    """The smallest KV allocation of a server (one buffer, block-major): whole pages
    holding whole blocks (:class:`kvpool.client_lib.allocator.ElasticBlockAllocator`)."""
    if info.kv_block_bytes <= 0:
        return page_size
    return math.lcm(page_size, info.kv_block_bytes)


def _config(folder: Path) -> dict[str, Any]:
    f = folder / "config.json"
    if not f.is_file():
        raise ValueError(f"model folder {folder} has no config.json")
    try:
        d = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{f} is not a JSON object")
    return d


def _elem_bytes(config: dict[str, Any]) -> int:
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return _ELEM_BYTES.get(str(dtype), 4)


def _int(config: dict[str, Any], key: str, default: int) -> int:
    v = config.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def _kv_block_bytes(config: dict[str, Any], elem: int) -> int:
    """0 when the config does not say (vLLM's own formats)."""
    layers = _int(config, "num_hidden_layers", 0)
    heads = _int(config, "num_attention_heads", 0)
    hidden = _int(config, "hidden_size", 0)
    if not (layers and heads and hidden):
        return 0
    kv_heads = _int(config, "num_key_value_heads", heads)
    head_dim = _int(config, "head_dim", hidden // heads)
    return layers * 2 * BLOCK_TOKENS * kv_heads * head_dim * elem
