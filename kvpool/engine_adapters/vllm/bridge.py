"""The one kvpool tenant of a vLLM engine-core process: connection, region group, allocator.

vLLM's KV cache is one flat allocation in which layer ``l``'s page of block ``b`` starts at
``offset + l * layer_stride + b * block_stride`` (``KVCacheTensor``). The bridge turns that
into a kvpool *region group* without changing vLLM's view code:

* layer-outer placements (``LBHNC`` & co, the CPU and most GPU defaults, when their unit
  is small): one region per layer slot, each ``num_blocks * block_stride`` bytes; a block
  is ``block_stride`` bytes of every region, so one allocation unit maps a block's K and
  V pages in every layer;
* block-outer placements (``BLHNC`` & co, and the interleaved one the
  ``get_kv_cache_configs`` seam makes of a layer-outer config whose unit would be large,
  :mod:`.kv_units`): one region, a block is one ``block_stride`` run holding every
  layer's page (and padding).

Each layer's view is then built by vLLM's own ``create_kv_cache_views`` over its region.
Invariants: the allocator's block ids are vLLM's block ids; the allocator holds exactly
``num_blocks`` blocks (vLLM's count is rounded to whole chunks before the cache is sized,
:func:`round_num_blocks`); block 0 (vLLM's null block) is allocated here and never freed.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from kvpool.engine_adapters.vllm.kv_units import chunk_units, layer_outer
from kvpool.engine_adapters.vllm.settings import AdapterError, Settings

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvpool.client_lib import ElasticBlockAllocator, RegionGroup, Tenant
    from kvpool.engine_adapters.sleep_controller import SleepController
    from kvpool.engine_adapters.vllm.tp import ExecutorStatus, ReclaimPoll

log = logging.getLogger("kvpool.vllm")
REFILL_TICK_S = 0.5  # the allocator's background tick (idle trim, reports)


class CreateViews(Protocol):
    """vLLM's ``create_kv_cache_views``: one view per layer of ``kv_cache_tensor`` over
    the flat int8 buffer ``raw``."""

    def __call__(self, raw: torch.Tensor, spec: KVCacheSpec, num_blocks: int,
                 layout: KVCacheLayout, kv_cache_tensor: KVCacheTensor,
                 kernel_block_size: int | None = None) -> list[torch.Tensor]: ...


class RequestWaker(Protocol):
    """What the engine core's patched loop calls on the sleep side (:class:`.sleep.Waker`),
    with ``step_lock`` held."""

    def for_request(self, core: EngineCore) -> None: ...

    def after_step(self, core: EngineCore) -> None: ...


class Stoppable(Protocol):
    """What the bridge needs of the elastic block pool: stop its background thread."""

    def stop(self) -> None: ...


def served_name(name: str | None, vllm_config: VllmConfig) -> str:
    """The tenant name: ``name`` (``KVPOOL_TENANT``, ``Settings.name``), else vLLM's
    served model name, else the model directory's name."""
    if name:
        return name
    n: str | list[str] | tuple[str, ...] | None = vllm_config.model_config.served_model_name
    if isinstance(n, (list, tuple)):
        n = n[0] if n else None
    return n or os.path.basename(os.path.normpath(vllm_config.model_config.model))


class VllmBridge:
    """The process's one kvpool adapter object (see the module). Created once per process
    at plugin load (:func:`kvpool.engine_adapters.vllm.register`) and handed to
    :func:`.patches.install`, whose patched vLLM methods hold it; every other piece
    (block pool, sleep, TP) receives it as an argument. Nothing finds it through a
    global."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.tenant: Tenant | None = None
        self.group: RegionGroup | None = None
        self.allocator: ElasticBlockAllocator | None = None
        self.pool: Stoppable | None = None  # the VllmElasticPool, once the scheduler built it
        self.scheduler: Scheduler | None = None  # vLLM's Scheduler, once built
        self.engine_core: EngineCore | None = None
        self.step_lock = threading.RLock()  # held by the engine core's loop per step
        self.sleep: SleepController | None = None  # KV-level sleep (.sleep.attach)
        self.waker: RequestWaker | None = None
        self.num_blocks = 0
        self.block_bytes = 0  # per region
        self.n_regions = 0
        # tensor parallelism (:mod:`.tp`): the engine core's view of the gang and its
        # reclaim poll (a worker's part is ``tp.WORKER``)
        self.tp_size = 1
        self.name = ""  # the tenant's name (every TP rank joins the gang under it)
        self.status: ExecutorStatus | None = None
        self.poll: ReclaimPoll | None = None
        # the API server's: the tenant its /metrics reports (gauges.py), once vLLM built
        # the config
        self.served: str | None = None
        self._page_size = 0

    # ---- connection -------------------------------------------------------------------
    def connect(self, name: str) -> Tenant:
        """Register as tenant ``name`` (once per process); raises AdapterError when the
        daemon is not there."""
        if self.tenant is not None:
            return self.tenant
        from kvpool.client_lib import KvpoolError, connect

        s = self.settings
        try:
            self.tenant = connect(name=name, device=s.device, run_dir=s.run_dir, kind="engine",
                                  min=s.min_bytes, max=s.max_bytes, shares=s.shares,
                                  sleepable=s.sleepable, group=s.group,
                                  endpoint=s.endpoint, engine="vllm")
        except (KvpoolError, OSError) as e:
            raise AdapterError(f"kvpool: cannot reach the kvpool daemon ({e})") from None
        t = self.tenant
        log.warning("kvpool: pid %d registered as tenant %r (id %d, kind engine) on the %s "
                    "backend, page %d B, virtual KV capacity %d B", os.getpid(), name, t.id,
                    t.backend.name, t.page_size, self.capacity())
        return t

    def capacity(self) -> int:
        """The virtual KV capacity: the daemon's budget, or this tenant's max if lower."""
        t = self.tenant
        assert t is not None, "connect() first"
        cap = t.budget
        if t.limit and 0 < t.limit < cap:
            cap = t.limit
        return cap

    def page_size(self) -> int:
        """The daemon's page size (the tenant's; a TP engine core, which registers no
        tenant, asks the daemon once)."""
        if self.tenant is not None:
            return self.tenant.page_size
        if not self._page_size:
            from kvpool.client_lib import Monitor

            mon = Monitor(self.settings.run_dir, timeout_s=15.0)
            try:
                self._page_size = mon.stats().pool.page_size
            finally:
                mon.close()
        return self._page_size

    def blocks_per_chunk(self, block_bytes_per_region: int) -> int:
        ps = self.page_size()
        return math.lcm(ps, block_bytes_per_region) // block_bytes_per_region

    # ---- the KV cache -------------------------------------------------------------------
    def allocate(self, kv_cache_config: KVCacheConfig, device: torch.device,
                 layout: KVCacheLayout, kernel_block_sizes: list[int] | None,
                 create_views: CreateViews) -> dict[str, torch.Tensor]:
        """vLLM's ``allocate_kv_cache`` over a region group: same return value."""
        tensors = kv_cache_config.kv_cache_tensors
        if not tensors:
            return {}
        if self.tenant is None and self.tp_size == 1:
            raise AdapterError("kvpool: the KV cache is allocated in a process that is not "
                               "registered with kvpool")
        if self.group is not None:
            raise AdapterError("kvpool: vLLM allocated its KV cache twice in one process")
        num_blocks = kv_cache_config.num_blocks
        strides = {t.block_stride for t in tensors}
        if len(strides) != 1:
            raise AdapterError(f"kvpool: KV tensors with different block strides {strides}")
        block_stride = strides.pop()
        # one region when a block's layers share one run (block-outer, or the one tensor
        # kv_units.whole_chunks interleaved); else one region per layer
        block_outer = layout.is_block_outermost or (
            len(tensors) == 1 and len(tensors[0].layers) > 1 and not layer_outer(tensors[0]))
        specs = _layer_specs(kv_cache_config)
        for name, spec in specs.items():
            if not spec.has_layer_views:
                raise AdapterError(f"kvpool: layer {name} has a KV spec without layer views "
                                   f"({type(spec).__name__}); not supported")
        # Where each layer's block 0 sits, and which region holds it.
        slots: dict[str, int] = {}
        for t in tensors:
            for i, name in enumerate(t.layers):
                slots[name] = t.offset + i * t.layer_stride
        if block_outer:
            bases = [0]
            region_bytes = num_blocks * block_stride
        else:
            bases = sorted(set(slots.values()))
            region_bytes = num_blocks * block_stride
            for a, b in zip(bases, bases[1:]):
                if b - a < region_bytes:
                    raise AdapterError("kvpool: overlapping layer regions in the KV layout")
        bpc = self.blocks_per_chunk(block_stride)
        if num_blocks % bpc:
            raise AdapterError(f"kvpool: {num_blocks} KV blocks are not whole chunks of {bpc}")
        if num_blocks < 2:
            raise AdapterError("kvpool: the KV budget holds less than two blocks")
        from kvpool.client_lib import ElasticBlockAllocator

        s = self.settings
        if self.tp_size > 1:
            from kvpool.engine_adapters.vllm.tp import join_gang

            self.tenant, self.group = join_gang(self.tenant, s, self.name, len(bases),
                                                region_bytes, block_stride, num_blocks,
                                                chunk_units(block_stride, self.page_size()))
            self.num_blocks, self.block_bytes = num_blocks, block_stride
            self.n_regions = len(bases)
            return self._views(kv_cache_config, device, layout, kernel_block_sizes,
                               create_views, specs, slots, bases, region_bytes, block_outer)
        assert self.tenant is not None
        label = self.tenant.name
        self.group = self.tenant.region_group(
            len(bases), region_bytes, label=label,
            chunk_units=chunk_units(block_stride, self.tenant.page_size))
        # populate: pages are faulted in when mapped (on the refill thread or the grant),
        # not at the first KV write inside a model step. The refill thread is woken by
        # alloc/free when the reserve crosses a watermark and by demand; its tick only
        # paces idle trim and reports (second-scale), so it is slow: every wake of a
        # background thread takes the GIL from the step loop.
        self.allocator = ElasticBlockAllocator(
            self.group, block_stride, low=s.low, high=s.high, populate=True,
            tick_s=REFILL_TICK_S,
            idle_timeout_s=s.idle_timeout_s, max_blocks=num_blocks, take_first=1)
        if self.allocator.num_blocks != num_blocks:
            raise AdapterError(f"kvpool: allocator holds {self.allocator.num_blocks} blocks, "
                               f"vLLM expects {num_blocks}")
        null = self.allocator.first_blocks  # taken before its background thread ran
        if null != [0]:
            raise AdapterError(f"kvpool: cannot map vLLM's null block (got {null}); is the "
                               "daemon's budget smaller than one KV block?")
        self.num_blocks, self.block_bytes, self.n_regions = num_blocks, block_stride, len(bases)
        return self._views(kv_cache_config, device, layout, kernel_block_sizes, create_views,
                           specs, slots, bases, region_bytes, block_outer)

    def _views(self, kv_cache_config: KVCacheConfig, device: torch.device,
               layout: KVCacheLayout, kernel_block_sizes: list[int] | None,
               create_views: CreateViews, specs: dict[str, KVCacheSpec], slots: dict[str, int],
               bases: list[int], region_bytes: int, block_outer: bool
               ) -> dict[str, torch.Tensor]:
        """vLLM's per-layer views over this process's region group."""
        import torch

        assert self.group is not None and self.tenant is not None
        tensors = kv_cache_config.kv_cache_tensors
        num_blocks, block_stride = self.num_blocks, self.block_bytes
        bpc = self.blocks_per_chunk(block_stride)
        regions = [self.group.tensor(i, torch.int8, nbytes=region_bytes)
                   for i in range(len(bases))]
        if regions[0].device.type != torch.device(device).type:
            raise AdapterError(f"kvpool: vLLM runs on {device} but the daemon's "
                               f"{self.tenant.backend.name} backend maps memory on "
                               f"{regions[0].device}")
        index = {base: i for i, base in enumerate(bases)}
        kv_caches: dict[str, torch.Tensor] = {}
        for t in tensors:
            group_id = next(g for g, grp in enumerate(kv_cache_config.kv_cache_groups)
                            if t.layers[0] in grp.layer_names)
            kbs = None
            if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
                kbs = kernel_block_sizes[group_id]
            nb = kv_cache_config.num_blocks_of(t)
            for name in t.layers:
                slot = slots[name]
                raw, offset = (regions[0], slot) if block_outer else (regions[index[slot]], 0)
                one = replace(t, layers=[name], offset=offset, size=region_bytes)
                kv_caches[name] = create_views(raw, specs[name], nb, layout, one,
                                               kernel_block_size=kbs)[0]
        log.warning("kvpool: KV cache of %d blocks as %d region(s) of %d B (block %d B per "
                    "region, %d blocks per chunk: an allocation unit of %d B)", num_blocks,
                    len(bases), region_bytes, block_stride, bpc,
                    self.group.page_size * chunk_units(block_stride, self.group.page_size)
                    * len(bases))
        return kv_caches

    def close(self) -> None:
        if self.status is not None:
            self.status.stopped = True
        if self.sleep is not None:
            self.sleep.close()
        if self.pool is not None:
            self.pool.stop()
        if self.tenant is not None:
            self.tenant.close()
            self.tenant = None


def _layer_specs(kv_cache_config: KVCacheConfig) -> dict[str, KVCacheSpec]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    out: dict[str, KVCacheSpec] = {}
    for grp in kv_cache_config.kv_cache_groups:
        spec = grp.kv_cache_spec
        for name in grp.layer_names:
            out[name] = (spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs)
                         else spec)
    return out
