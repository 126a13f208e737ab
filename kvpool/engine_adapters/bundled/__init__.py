"""Makes the bundled engine's KV cache elastic: the only bridge between it and kvpool.

``enable(config)`` (what ``kvpool serve --elastic`` and ``KVPOOL_ENABLE=1`` call) checks
that the engine is one this adapter knows (:mod:`.checks`), then installs two factories on
its ``EngineConfig``:

* the KV storage becomes a kvpool *region group* (one region per KV buffer: one for the
  block-major layout, ``2 * layers`` for per-layer), reserved virtually for the whole
  configured KV size and backed by daemon pages only where blocks are in use;
* the block pool becomes an :class:`ElasticBlockPool` (:mod:`.block_pool`): the engine's
  own prefix-cache bookkeeping, with free blocks coming from and going back to the
  client library's :class:`~kvpool.client_lib.ElasticBlockAllocator`.

:mod:`.bridge` builds and owns the tenant, group, allocator and pool of one engine; the
engine binds itself to the pool and ``engine.close()`` closes the pool, which ends all of
them (no engine method is patched); :mod:`.settings` holds the ``KVPOOL_*`` settings.
With ``Settings.weights == "pool"`` (the default) the bridge also builds the model:
its parameters live in a weight set shared by every engine of the same checkpoint
(:mod:`.weights`; ``bridge_of(config).weights``). With ``tensor_parallel_size`` > 1 the
engine's ranks form a kvpool gang (:mod:`.bridge`, :mod:`kvpool.engine_adapters.gang`,
:mod:`.gang_rank`): weights stay local, and request-aligned KV is refused.
"""

from __future__ import annotations

from kvpool.engine.config import EngineConfig
from kvpool.engine_adapters.bundled.block_pool import ElasticBlockPool
from kvpool.engine_adapters.bundled.bridge import ADAPTER_KEY, Bridge, bridge_of
from kvpool.engine_adapters.bundled.checks import KNOWN_LAYOUTS, KNOWN_POOL_METHODS, check_engine
from kvpool.engine_adapters.bundled.settings import AdapterError, Settings

GANG_RANK_MODULE = "kvpool.engine_adapters.bundled.gang_rank"


def enable(config: EngineConfig, settings: Settings | None = None) -> None:
    """Make the engine built from ``config`` allocate its KV cache through kvpool; the
    engine gets a ``close()`` that gives the memory and the daemon session back."""
    check_engine(config)
    if settings is None:
        try:
            settings = Settings.from_env()
        except ValueError as e:  # a bad KVPOOL_* value: one line (SettingsError)
            raise AdapterError(str(e)) from None
    tp = config.tensor_parallel_size > 1
    if tp and settings.request_aligned:
        raise AdapterError("request-aligned KV (prefill/decode handoff) does not combine "
                           "with tensor_parallel_size > 1")
    if settings.request_aligned:
        config.enable_prefix_caching = False  # a shared block would tie requests' units
    bridge = Bridge(config, settings)
    if tp:  # every rank a member of one gang (.bridge); each rank loads its own weights
        config.tp_rank_module = GANG_RANK_MODULE
        config.tp_started = bridge.tp_started
    elif settings.weights == "pool":  # the parameters in a shared weight set (.weights)
        config.model_factory = bridge.make_model
        config.prepack = False  # a private oneDNN copy would undo the sharing
    config.block_pool_factory = bridge.make_pool
    config.kv_cache_factory = bridge.make_kv_cache
    config.extra[ADAPTER_KEY] = bridge


__all__ = ["ADAPTER_KEY", "AdapterError", "Bridge", "ElasticBlockPool", "KNOWN_LAYOUTS",
           "KNOWN_POOL_METHODS", "Settings", "bridge_of", "check_engine", "enable"]
