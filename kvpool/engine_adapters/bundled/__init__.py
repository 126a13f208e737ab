"""Makes the bundled engine's KV cache elastic: the only bridge between it and kvpool.

``enable(config)`` (what ``kvpool serve --elastic`` and ``KVPOOL_ENABLE=1`` call) checks
that the engine is one this adapter knows (:mod:`.checks`), then returns the engine's one
adapter object, a :class:`BundledBridge`: build the engine as ``Engine(bridge.config,
bridge.seams)`` (the config unchanged, or a ``dataclasses.replace`` variant; the seams
hold two factories):

* the KV storage becomes a kvpool *region group* (one region per KV buffer: one for the
  block-major layout, ``2 * layers`` for per-layer), reserved virtually for the whole
  configured KV size and backed by daemon pages only where blocks are in use, its blocks
  padded so one allocation unit is a few pages (:mod:`kvpool.engine_adapters.kv_unit`);
  ``kv_layout="auto"`` is :data:`ELASTIC_LAYOUT` on every device;
* the block pool becomes an :class:`BundledElasticPool` (:mod:`.block_pool`): the engine's
  own prefix-cache bookkeeping, with free blocks coming from and going back to the
  client library's :class:`~kvpool.client_lib.ElasticBlockAllocator`.

:mod:`.bridge` builds and owns the tenant, group, allocator and pool of one engine; the
engine binds itself to the pool and ``engine.close()`` closes the pool, which ends all of
them (no engine method is patched); :mod:`.settings` holds the ``KVPOOL_*`` settings.
With ``Settings.weights == "pool"`` (the default) the bridge also builds the model:
its parameters live in a weight set shared by every engine of the same checkpoint
(:mod:`.weights`; ``bridge_of(engine).weights``). With ``tensor_parallel_size`` > 1 the
engine's ranks form a kvpool gang (:mod:`.bridge`, :mod:`kvpool.engine_adapters.gang`,
:mod:`.gang_rank`): weights stay local, and request-aligned KV is refused.
"""

from __future__ import annotations

import dataclasses

from kvpool.engine.config import EngineConfig
from kvpool.engine.kv_cache import KVLayout
from kvpool.engine_adapters.bundled.block_pool import BundledElasticPool
from kvpool.engine_adapters.bundled.bridge import GANG_RANK_MODULE, BundledBridge, bridge_of
from kvpool.engine_adapters.bundled.checks import KNOWN_LAYOUTS, KNOWN_POOL_METHODS, check_engine
from kvpool.engine_adapters.bundled.settings import AdapterError, Settings

#: what ``kv_layout="auto"`` is for an elastic engine, on every device: one region whose
#: blocks hold every layer, so a page holds whole blocks and an allocation unit is a few
#: pages (SmolLM2-135M on 2 MiB pages: 6 MiB). ``per_layer`` (``2 * layers`` regions, a
#: unit of at least a page in each: 120 MiB and more) stays available when asked for.
ELASTIC_LAYOUT: KVLayout = "block_major"


def enable(config: EngineConfig, settings: Settings | None = None) -> BundledBridge:
    """The adapter of an engine built from ``config`` that allocates its KV cache through
    kvpool: ``Engine(bridge.config, bridge.seams)``; the engine's ``close()`` gives the
    memory and the daemon session back. Raises AdapterError (one line)."""
    check_engine(config)
    if settings is None:
        try:
            settings = Settings.from_env()
        except ValueError as e:  # a bad KVPOOL_* value: one line (SettingsError)
            raise AdapterError(str(e)) from None
    if config.tensor_parallel_size > 1 and settings.request_aligned:
        raise AdapterError("request-aligned KV (prefill/decode handoff) does not combine "
                           "with tensor_parallel_size > 1")
    if settings.request_aligned:  # a shared block would tie requests' units
        config = dataclasses.replace(config, enable_prefix_caching=False)
    if config.kv_layout == "auto":  # a small allocation unit (see ELASTIC_LAYOUT)
        config = dataclasses.replace(config, kv_layout=ELASTIC_LAYOUT)
    return BundledBridge(config, settings)


__all__ = ["AdapterError", "BundledBridge", "BundledElasticPool", "ELASTIC_LAYOUT",
           "GANG_RANK_MODULE", "KNOWN_LAYOUTS",
           "KNOWN_POOL_METHODS", "Settings", "bridge_of", "check_engine", "enable"]
