"""The bundled paged-attention engine (Llama family, pure PyTorch, CPU and CUDA).

Public API::

    LLM(model_dir, **EngineConfig fields).generate(prompts, SamplingParams(...))
    Engine(EngineConfig(...), EngineSeams(...)): add_request / step / abort / has_unfinished
    / stats (the config is frozen values, the seams the hooks an adapter plugs in)
    BlockPool (ABC), FixedBlockPool, KVCache, KVCacheSpec  -- the pluggable KV parts

Plugging in external KV memory (what ``kvpool.engine_adapters.bundled.enable`` does):
pass ``EngineSeams(block_pool_factory=lambda num_blocks: MyPool(...)`` (a
:class:`BlockPool` whose ``get_new_blocks`` raises :class:`PoolExhausted` when memory is
short), ``kv_cache_factory=lambda spec, capacity, device:
KVCache.from_buffers(spec, buffers))`` with one buffer (block_major) or ``2 * layers``
(per_layer) tensors covering ``capacity`` blocks; or pass ``block_pool=`` / ``kv_cache=``
to :class:`Engine` directly. The scheduler only ever sees the ABC and re-reads free counts
every step, so the pool may grow and shrink between steps.

Never imports kvpool.daemon, kvpool.client_lib or kvpool.vmm.
"""

from __future__ import annotations

from kvpool.engine.block_pool import NULL_BLOCK, BlockPool, FixedBlockPool
from kvpool.engine.config import EngineConfig, EngineConfigError
from kvpool.engine.engine import Engine
from kvpool.engine.errors import CheckpointError, PoolExhausted, RequestError
from kvpool.engine.kv_cache import KVCache, KVCacheSpec
from kvpool.engine.llm import LLM
from kvpool.engine.request import RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.seams import EngineSeams

__all__ = [
    "LLM", "Engine", "EngineConfig", "EngineConfigError", "EngineSeams", "SamplingParams", "RequestOutput", "BlockPool",
    "FixedBlockPool", "NULL_BLOCK", "KVCache", "KVCacheSpec", "CheckpointError",
    "PoolExhausted", "RequestError",
]
