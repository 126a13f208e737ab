"""The engine surface this adapter was written against; anything else is refused.

:func:`check_engine` verifies every engine name the adapter relies on: the abstract
``BlockPool`` methods, ``FixedBlockPool._release`` (the pool's one exit for freed blocks),
``KVCache.from_buffers``, the engine seams' factories, and ``Engine.preempt_until_free`` (what
:meth:`BundledElasticPool.shrink` calls to get memory back from running requests).
"""

from __future__ import annotations

from kvpool.engine.block_pool import BlockPool, FixedBlockPool
from kvpool.engine.config import EngineConfig
from kvpool.engine.kv_cache import KVCache
from kvpool.engine.seams import EngineSeams
from kvpool.engine_adapters.bundled.settings import AdapterError

KNOWN_POOL_METHODS = frozenset({
    "capacity", "get_new_blocks", "free_blocks", "touch", "get_cached_block",
    "cache_full_blocks", "evict_cached_blocks", "get_num_free_blocks", "num_used_blocks",
    "ref_count", "check_integrity",
})
KNOWN_LAYOUTS = ("block_major", "per_layer")


def check_engine(config: EngineConfig) -> None:
    """Refuse, with a message naming the difference, an engine this adapter does not know."""
    abstract = set(getattr(BlockPool, "__abstractmethods__", ()))
    if abstract != KNOWN_POOL_METHODS:
        raise AdapterError(
            "kvpool.engine_adapters.bundled does not know this engine version: BlockPool "
            f"methods differ (new: {sorted(abstract - KNOWN_POOL_METHODS)}, gone: "
            f"{sorted(KNOWN_POOL_METHODS - abstract)})")
    for owner, attr in ((FixedBlockPool, "_release"), (KVCache, "from_buffers"),
                        (EngineSeams, "kv_cache_factory")):
        if not hasattr(owner, attr) and attr not in {
                f.name for f in getattr(owner, "__dataclass_fields__", {}).values()}:
            raise AdapterError(f"engine lacks {owner.__name__}.{attr}: unknown engine version")
    from kvpool.engine.engine import Engine

    if not hasattr(Engine, "preempt_until_free"):
        raise AdapterError("engine lacks Engine.preempt_until_free: unknown engine version")
    if config.kv_layout not in (*KNOWN_LAYOUTS, "auto"):
        raise AdapterError(f"unknown KV layout {config.kv_layout!r}; the adapter knows "
                           f"{KNOWN_LAYOUTS}")
