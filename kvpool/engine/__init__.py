"""The bundled paged-attention engine (Llama family, pure PyTorch, CPU and CUDA).

Public API::

    LLM(model_dir, **EngineConfig fields).generate(prompts, SamplingParams(...))
    Engine(EngineConfig(...)): add_request / step / abort / has_unfinished / stats
    BlockPool (ABC), FixedBlockPool, KVCache, KVCacheSpec  -- the pluggable KV parts

Never imports kvpool.daemon, kvpool.client_lib or kvpool.vmm.
"""

from __future__ import annotations

from kvpool.engine.block_pool import NULL_BLOCK, BlockPool, FixedBlockPool
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.errors import CheckpointError, PoolExhausted, RequestError
from kvpool.engine.kv_cache import KVCache, KVCacheSpec
from kvpool.engine.llm import LLM
from kvpool.engine.request import RequestOutput
from kvpool.engine.sampling import SamplingParams

__all__ = [
    "LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "BlockPool",
    "FixedBlockPool", "NULL_BLOCK", "KVCache", "KVCacheSpec", "CheckpointError",
    "PoolExhausted", "RequestError",
]
