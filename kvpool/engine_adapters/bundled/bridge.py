"""The bridge between one bundled engine and kvpool: it builds the tenant, region group,
allocator and pool when the engine builds its KV storage, and tears all of it down again
on ``engine.close()``.

One bridge per engine, passed in, never found through a global: the engine's own seams
(:class:`~kvpool.engine.seams.EngineSeams`, :attr:`BundledBridge.seams`, handed to ``Engine``
alongside :attr:`BundledBridge.config`) do the rest, nothing is patched: ``block_pool_factory``
/ ``kv_cache_factory`` are :meth:`BundledBridge.make_pool` / :meth:`BundledBridge.make_kv_cache`; the
built engine binds itself to the pool
(``BlockPool.bind_engine``: the pool preempts through it and waits for its
``step_lock``); ``Engine.close`` closes the pool, whose ``on_close`` is :meth:`BundledBridge.close`.

With pool weights (``Settings.weights == "pool"``) the bridge is also the seams'
``model_factory`` (:meth:`BundledBridge.make_model`) and ``weights_shared`` (no private
oneDNN copy of shared weights): the tenant connects there, before the KV
cache, and the model's parameters become views into a weight set (:mod:`.weights`,
:attr:`BundledBridge.weights`); one tenant holds both the set and the KV.

Tensor parallelism (``tensor_parallel_size`` > 1): the engine hands the bridge its other
ranks once they joined (``EngineSeams.tp_started`` is :meth:`BundledBridge.tp_started`; the ranks run
:data:`GANG_RANK_MODULE`). The
tenant becomes rank 0 of a kvpool *gang* (docs/ARCHITECTURE.md, "Gangs"): the bridge
creates the gang (devices ``settings.device + r`` for rank ``r``), tells every rank to
join it and create the same group (:mod:`.gang_messages` ``Join``, :mod:`.gang_rank`),
and builds its own group over the gang driver's
:class:`~kvpool.engine_adapters.gang.GangSession` (its transport: the ranks' pipes,
:class:`~.gang_messages.PipeCollective`), so every grant and release the allocator makes
is made by every rank, all or none, mapped on every rank before a step can use it. Weights stay local (each rank loads its share).

Lifetime: connected in :meth:`BundledBridge.make_model` (pool weights) or
:meth:`BundledBridge.make_kv_cache` (during ``Engine(config)``); closed by
:meth:`BundledBridge.close` (``engine.close()``, or a failed start). After close the daemon no
longer lists the tenant, its pages are back in the pool and the adapter's threads (the
idle-cache watcher, the allocator's refill thread, the tenant's thread) have ended; the
engine must not step again.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from kvpool.engine.model import loader
from kvpool.engine.config import EngineConfig
from kvpool.engine.kv_cache import KVCache, KVCacheSpec
from kvpool.engine.model.llama import LlamaForCausalLM
from kvpool.engine.model.config import ModelConfig
from kvpool.engine.seams import EngineSeams
from kvpool.engine_adapters.bundled.block_pool import BundledElasticPool
from kvpool.engine_adapters.bundled import gang_messages
from kvpool.engine_adapters.bundled.checks import KNOWN_LAYOUTS
from kvpool.engine_adapters.bundled.settings import MEMORY_WAIT_S, AdapterError, Settings
from kvpool.engine_adapters.bundled.weights import Layout, PoolWeights, set_key
from kvpool.engine_adapters import kv_unit
from kvpool.engine_adapters.gang import GangDriver, GangSession

if TYPE_CHECKING:
    from kvpool.client_lib import RegionGroup, Tenant
    from kvpool.engine.tp.workers import TPWorkers
    from kvpool.engine_adapters.sleep_controller import SleepController

log = logging.getLogger("kvpool.engine_adapters.bundled")

#: what every other rank of a tensor-parallel engine runs (``EngineSeams.tp_rank_module``)
GANG_RANK_MODULE = "kvpool.engine_adapters.bundled.gang_rank"


class BundledBridge:
    """Builds the tenant, region group, allocator and pool for one engine.

    Caller: build the engine as ``Engine(bridge.config, bridge.seams)``, once."""

    def __init__(self, config: EngineConfig, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.seams = self._seams()
        self.pool: BundledElasticPool | None = None
        self.tenant: Tenant | None = None
        self.group: RegionGroup | None = None
        #: the model's parameters in the pool (None: local weights, or not built yet)
        self.weights: PoolWeights | None = None
        self.sleep: SleepController | None = None  # set by .sleep.attach; closed here
        #: the engine's other ranks (tensor parallelism; None: one rank)
        self.ranks: TPWorkers | None = None
        #: the KV cache's block stride and allocation unit (once it is built)
        self.unit: kv_unit.UnitPlan | None = None

    def _seams(self) -> EngineSeams:
        """The engine's hooks: this bridge's pool and KV storage; with tensor
        parallelism every rank a member of one gang (each loads its own weights), else
        with pool weights the parameters in a shared weight set (:mod:`.weights`)."""
        if self.config.tensor_parallel_size > 1:
            return EngineSeams(block_pool_factory=self.make_pool,
                               kv_cache_factory=self.make_kv_cache,
                               tp_rank_module=GANG_RANK_MODULE, tp_started=self.tp_started,
                               adapter=self)
        if self.settings.weights == "pool":
            return EngineSeams(block_pool_factory=self.make_pool,
                               kv_cache_factory=self.make_kv_cache,
                               model_factory=self.make_model,
                               weights_shared=self.shares_weights, adapter=self)
        return EngineSeams(block_pool_factory=self.make_pool,
                           kv_cache_factory=self.make_kv_cache, adapter=self)

    def shares_weights(self) -> bool:
        """(``EngineSeams.weights_shared``) The model's parameters are a weight set's."""
        return self.weights is not None

    def tp_started(self, workers: TPWorkers) -> None:
        """(``EngineSeams.tp_started``) The engine's other ranks joined: the KV cache
        will be a gang's (see the module)."""
        self.ranks = workers

    def _connect(self) -> Tenant:
        """The engine's one tenant (connected on the first call)."""
        from kvpool.client_lib import connect

        if self.tenant is None:
            s = self.settings
            self.tenant = connect(name=self.name, device=s.device, run_dir=s.run_dir,
                                  kind="engine", min=s.min_bytes, max=s.max_bytes,
                                  shares=s.shares, endpoint=s.endpoint,
                                  sleepable=s.sleepable, group=s.group or None,
                                  engine="kvpool")
        return self.tenant

    @property
    def name(self) -> str:
        return self.settings.name or self.config.served_model_name or os.path.basename(
            os.path.normpath(self.config.model))

    def make_model(self, path: Path, device: torch.device, dtype: torch.dtype,
                   model_config: ModelConfig) -> LlamaForCausalLM:
        """The engine's model with its parameters in a weight set (``model_factory``):
        attached when the pool has the set sealed, else loaded into it from the
        checkpoint and sealed. The checkpoint is checked as the local loader checks it
        (missing / unexpected tensors, shapes). A backend that cannot map pages
        read-only (``caps.read_only_maps``) gets local weights (logged). A set the daemon
        refuses (its code, e.g. ``OVER_LIMIT``) raises :class:`AdapterError`."""
        from kvpool.client_lib import KvpoolError
        from kvpool.client_lib.weights import content_key

        model = loader.meta_model(model_config)
        plan = loader.check_checkpoint(path, model, model_config)
        tenant = self._connect()
        try:
            if not tenant.backend.caps.read_only_maps:
                log.warning("the %s backend cannot map pages read-only: local weights",
                            tenant.backend.name)
                return loader.load_model(path, device, dtype, model_config)
            layout = Layout.of(model, dtype)
            key = set_key(content_key(path).key, layout)
            self.weights = PoolWeights(tenant, key, layout,
                                       load=lambda tensors: loader.fill(plan, tensors))
            try:
                tensors = self.weights.open()
            except KvpoolError as e:  # refused (past its max, the pool's cap): one line
                raise AdapterError(f"the daemon refused the model's weight set "
                                   f"({layout.nbytes} bytes): {e}") from None
            first = next(iter(tensors.values()))
            if first.device.type != device.type:
                raise AdapterError(f"the engine runs on {device} but kvpool's "
                                   f"{tenant.backend.name} backend maps memory on "
                                   f"{first.device}")
            log.info("weights: set %s (%d bytes), %s", key[:12], layout.nbytes,
                     "loaded" if self.weights.loads else "attached")
            return loader.place(model, tensors)
        except BaseException:
            self.close()
            raise
    def make_pool(self, num_blocks: int) -> BundledElasticPool:
        """The engine's block pool (``block_pool_factory``): closing it closes this."""
        self.pool = BundledElasticPool(num_blocks, on_close=self.close)
        return self.pool

    def make_kv_cache(self, spec: KVCacheSpec, capacity: int, device: torch.device) -> KVCache:
        from kvpool.client_lib import ElasticBlockAllocator

        if spec.layout not in KNOWN_LAYOUTS:
            raise AdapterError(f"unknown KV layout {spec.layout!r}")
        if self.pool is None:
            raise AdapterError("the engine built its KV storage before its block pool")
        s = self.settings
        name = self.name
        tenant = self._connect()
        try:
            unit = kv_unit.plan(spec.buffer_block_bytes, tenant.page_size, spec.num_buffers,
                                pad=s.kv_unit == "small")
            self.unit = unit
            per_region, chunk = unit.stride, unit.chunk_bytes
            region_bytes = math.ceil(capacity * per_region / chunk) * chunk
            if self.ranks is None:
                self.group = tenant.region_group(spec.num_buffers, region_bytes, label=name,
                                                 chunk_units=unit.pages_per_chunk)
            else:
                self.group = self._gang_group(tenant, self.ranks, spec.num_buffers,
                                              region_bytes, name, unit)
            allocator = ElasticBlockAllocator(
                self.group, per_region, low=s.low, high=s.high,
                idle_timeout_s=s.idle_timeout_s, populate=s.populate, take_first=1,
                first_wait_s=MEMORY_WAIT_S)  # block 0, waited for like the weight set
            self.pool.bind(allocator)  # (raises when the first chunk did not come)
            log.warning("kvpool: %s KV cache: %s", spec.layout, unit.describe())
            if s.request_aligned:
                self.pool.align_requests()
            tenant.set_shrink_callback(self.pool.shrink)
            self.pool.start_idle_release(s.idle_timeout_s)
            nblocks = allocator.num_blocks
            buffers = [self.group.tensor(i, torch.uint8, nbytes=nblocks * per_region)
                       for i in range(spec.num_buffers)]
            if device.type != buffers[0].device.type:
                raise AdapterError(f"the engine runs on {device} but kvpool's "
                                   f"{tenant.backend.name} backend maps memory on "
                                   f"{buffers[0].device}")
            return KVCache.from_buffers(spec, buffers, nblocks, block_stride=per_region)
        except BaseException:
            self.close()
            raise

    def _gang_group(self, tenant: Tenant, ranks: TPWorkers, n_regions: int,
                    region_bytes: int, label: str, unit: kv_unit.UnitPlan) -> RegionGroup:
        """Create the gang, have every rank join it and create its group (in order, before
        any grant: the pipe is ordered), then this rank's group over a GangSession."""
        from kvpool.client_lib import KvpoolError, RegionGroup

        devices = [self.settings.device + r for r in range(ranks.size)]
        try:
            token = tenant.create_gang(devices, [(n_regions, region_bytes)])
        except KvpoolError as e:  # e.g. a daemon that does not serve every rank's device
            raise AdapterError(f"cannot make the {ranks.size} ranks a kvpool gang on devices "
                               f"{devices}: {e}") from None
        ranks.post(gang_messages.encode(gang_messages.Join(
            token=token, name=tenant.name, devices=devices,
            run_dir=self.settings.run_dir,
            n_regions=n_regions, capacity=region_bytes, label=label,
            block_stride=unit.stride, chunk_units=unit.pages_per_chunk)))
        session = GangSession(tenant, GangDriver(gang_messages.PipeCollective(ranks)))
        group = RegionGroup(session, n_regions, region_bytes, label, unit.pages_per_chunk)
        session.group_id = group.id
        tenant.groups[group.id] = group  # the tenant's reclaim and close reach it
        return group

    def close(self) -> None:
        """Stop the sleep controller's timer and the idle watcher, let go of the weight
        set, then close the tenant (its thread, the allocator's thread, the mappings, the
        daemon session). Idempotent."""
        if self.sleep is not None:
            self.sleep.close()
        if self.pool is not None:
            self.pool.stop()
        if self.weights is not None:
            self.weights.close()  # the set stays cached in the daemon (evictable)
        if self.tenant is not None:
            tenant, self.tenant = self.tenant, None
            tenant.close()
        self.group = None


class HasSeams(Protocol):
    """An engine (:class:`~kvpool.engine.engine.Engine`): what :func:`bridge_of` reads."""

    @property
    def seams(self) -> EngineSeams: ...


def bridge_of(engine: HasSeams) -> BundledBridge | None:
    """The bridge an engine was built with (None: not elastic); the servers' routes and
    tests ask it."""
    adapter = engine.seams.adapter
    return adapter if isinstance(adapter, BundledBridge) else None
