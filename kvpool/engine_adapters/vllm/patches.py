"""The seams kvpool patches in vLLM (see docs/VLLM-ADAPTER.md for why each one).

API server process (where the config is built):
  ``EngineArgs.create_engine_config``   checks (one-line errors) and sets the KV size to
                                        kvpool's virtual capacity; one rank on CPU runs the
                                        uniprocess executor so the scheduler and the KV
                                        cache share a process (as on a one-GPU server).
  ``dev.sleep.api_router.attach_router``  kvpool's ``POST /wake_up`` (503 of one line
                                        when the memory does not come) and ``GET
                                        /kvpool/sleep`` before vLLM's (sleep_routes.py);
  ``launchers.app.register_api_routers``  also ``POST /kvpool/weights``
                                        (weight_routes.py), dev mode or not;
  ``EngineArgs.create_engine_config``   also: the weight transfer backend ``kvpool``
                                        when none is configured;
  ``instrumentator.metrics.get_prometheus_registry``  the registry vLLM's ``/metrics``
                                        serves gets kvpool's gauges beside vLLM's
                                        (gauges.py: the daemon's ``stats``, read-only).
Both processes:
  ``weight_transfer.factory``           registers the ``kvpool`` weight transfer engine
                                        (weight_transfer.py: an update loads a checkpoint
                                        through ``model.load_weights``).
Engine-core process:
  ``CPUWorker/Worker.determine_available_memory``  registers the tenant, reports the
                                        virtual capacity (no static slice, no free-memory
                                        check against pages the daemon holds);
  ``gpu_worker.request_memory``         the start-up free-memory guard: a warning, not an
                                        error (the daemon holds the memory);
  ``engine.core.get_kv_cache_configs``  rounds the block count to whole chunks;
  ``allocate_kv_cache`` (V1 runner and Model Runner V2)  views over a region group;
  ``kv_cache_coordinator.BlockPool``    the elastic block pool;
  ``KVCacheManager.allocate_slots``     asks kvpool for a shortfall (the coordinator's
                                        block count is read only when vLLM refused),
                                        never raises;
  ``Scheduler.__init__``                binds the pool to the scheduler (shrink callback,
                                        idle release); starts the KV-events stream with
                                        ``AllBlocksCleared`` (kv_events.py);
  ``EngineCore.step/add_request/abort_requests`` and ``EngineCoreProc._process_engine_step/
  _handle_client_request``              one lock per step, so a shrink runs between steps;
  ``EngineCore.add_request``            wakes a sleeping engine first (:mod:`.sleep`);
  ``EngineCoreProc._process_engine_step``  reports busy/idle to the daemon after a step;
  ``EngineCore.is_sleeping``            also true when kvpool put the engine to sleep;
  ``EngineCore.wake_up``                also wakes a sleep of kvpool's (vLLM's own wake
                                        ends at "Executor is not sleeping");
  ``EngineCore.kvpool_sleep_state``     (added) the sleep's state and counts, a utility
                                        call of the API server's ``GET /kvpool/sleep``;
  ``EngineCore.kvpool_wake``            (added) ``wake_up`` answering its failure, a
                                        utility call of kvpool's ``POST /wake_up``;
  ``CPUWorker.sleep/wake_up``           (a no-op on CPU in vLLM) KV-level sleep and wake.
Tensor parallelism (:mod:`.tp`):
  ``Executor.initialize_from_config``   (engine core) the allocator over the gang;
  ``EngineCore._initialize_kv_caches``  under the step lock (no RPC beside the warm-up's);
  ``EngineCoreProc._process_engine_step``  polls rank 0's reclaim asks after a step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvpool.engine_adapters.vllm.hooks import when_imported
from kvpool.engine_adapters.vllm.settings import AdapterError, say

if TYPE_CHECKING:
    import torch
    from vllm.config import CacheConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.utils.mem_utils import MemorySnapshot

    from kvpool.engine_adapters.vllm.bridge import VllmBridge

log = logging.getLogger("kvpool.vllm")
_ours: set[Callable[..., object]] = set()  # our wrappers: a second patch leaves them as is


# ---- API server process ------------------------------------------------------------------
def _patch_arg_utils(b: VllmBridge, mod: ModuleType) -> None:
    from kvpool.engine_adapters.vllm.checks import check_config

    cls = mod.EngineArgs
    original: Callable[..., VllmConfig] = cls.create_engine_config
    if original in _ours:
        return

    @functools.wraps(original)
    def create_engine_config(self: EngineArgs, *args: Any, **kwargs: Any) -> VllmConfig:
        from kvpool.engine_adapters.vllm.bridge import served_name

        config = original(self, *args, **kwargs)
        check_config(config)
        if config.weight_transfer_config is None:  # POST /kvpool/weights (weight_routes.py)
            from vllm.config import WeightTransferConfig

            from kvpool.engine_adapters.vllm.weight_transfer import BACKEND

            config.weight_transfer_config = WeightTransferConfig(backend=BACKEND)
        b.served = served_name(b.settings.name, config)  # the tenant /metrics reports
        return config

    _ours.add(create_engine_config)
    cls.create_engine_config = create_engine_config


def _patch_sleep_routes(b: VllmBridge, mod: ModuleType) -> None:
    from kvpool.engine_adapters.vllm.sleep_routes import attach_first

    original: Callable[..., None] = mod.attach_router
    if original in _ours:
        return
    attach = attach_first(original)
    _ours.add(attach)
    setattr(mod, "attach_router", attach)


def _patch_api_routers(b: VllmBridge, mod: ModuleType) -> None:
    """The API server's routes, dev mode or not, include ``POST /kvpool/weights``."""
    from kvpool.engine_adapters.vllm import weight_routes

    original: Callable[..., None] = mod.register_api_routers
    if original in _ours:
        return

    @functools.wraps(original)
    def register_api_routers(args: Any, app: Any, *rest: Any, **kw: Any) -> None:
        app.include_router(weight_routes.router())
        original(args, app, *rest, **kw)

    _ours.add(register_api_routers)
    setattr(mod, "register_api_routers", register_api_routers)


def _register_transfer(b: VllmBridge, mod: ModuleType) -> None:
    """vLLM's weight transfer engines learn ``kvpool`` (:mod:`.weight_transfer`, loaded
    by vLLM when a server names it)."""
    from kvpool.engine_adapters.vllm.weight_transfer import BACKEND

    factory = mod.WeightTransferEngineFactory
    if BACKEND not in factory._registry:
        factory.register_engine(BACKEND, "kvpool.engine_adapters.vllm.weight_transfer",
                                "CheckpointTransfer")


def _patch_metrics(b: VllmBridge, mod: ModuleType) -> None:
    from kvpool.engine_adapters.vllm.gauges import collector

    original: Callable[[], Any] = mod.get_prometheus_registry
    if original in _ours:
        return
    gauges = collector(b.settings.run_dir, lambda: b.served)
    done: set[int] = set()

    @functools.wraps(original)
    def get_prometheus_registry() -> Any:
        registry = original()
        if id(registry) not in done:  # vLLM's global registry, or its multiprocess one
            done.add(id(registry))
            registry.register(gauges)
        return registry

    _ours.add(get_prometheus_registry)
    setattr(mod, "get_prometheus_registry", get_prometheus_registry)


# ---- engine-core process: memory sizing -------------------------------------------------
def _capacity_for(b: VllmBridge, worker: CPUWorker | Worker) -> int:
    from kvpool.engine_adapters.vllm.bridge import served_name

    name = served_name(b.settings.name, worker.vllm_config)
    tp = worker.vllm_config.parallel_config.tensor_parallel_size
    if tp == 1:
        b.connect(name)
        return b.capacity()
    from kvpool.engine_adapters.vllm.tp import broadcast, tp_rank

    # tensor parallelism: rank 0 registers (the gang's first rank); every rank learns
    # the capacity (and any refusal) from it
    b.tp_size, b.name = tp, name
    cap, err = 0, None
    if tp_rank()[0] == 0:
        try:
            b.connect(name)
            cap = b.capacity()
        except AdapterError as e:
            err = str(e)
    cap, err = broadcast((cap, err))
    if err is not None:
        raise AdapterError(err)
    return int(cap)


def _patch_cpu_worker(b: VllmBridge, mod: ModuleType) -> None:
    cls = mod.CPUWorker

    def determine_available_memory(self: CPUWorker) -> int:
        if self._should_warm_up_model():
            self.model_runner.warming_up_model()
        return _capacity_for(b, self)

    # only __wrapped__ (the original is not called, so its name and doc are not ours)
    functools.update_wrapper(determine_available_memory, cls.determine_available_memory,
                             assigned=(), updated=())
    cls.determine_available_memory = determine_available_memory
    _patch_cpu_worker_sleep(b, cls)


def _patch_gpu_worker(b: VllmBridge, mod: ModuleType) -> None:
    cls = mod.Worker
    original: Callable[[Worker], int] = cls.determine_available_memory

    @functools.wraps(original)
    def determine_available_memory(self: Worker) -> int:
        original(self)  # the profile run (compiles, sizes activations); its figure is ours
        return _capacity_for(b, self)

    cls.determine_available_memory = determine_available_memory
    request: Callable[..., int] = mod.request_memory

    @functools.wraps(request)
    def request_memory(init_snapshot: MemorySnapshot, cache_config: CacheConfig, *args: Any,
                       **kwargs: Any) -> int:
        try:
            return request(init_snapshot, cache_config, *args, **kwargs)
        except ValueError as e:
            say(f"kvpool: ignoring vLLM's start-up free-memory check ({str(e)[:120]}...): "
                "the KV cache comes from kvpool")
            return cache_config.kv_cache_memory_bytes or 0

    # setattr: vLLM's modules, whose attributes mypy does not let us assign
    setattr(mod, "request_memory", request_memory)


def _patch_engine_core(b: VllmBridge, mod: ModuleType) -> None:

    original: Callable[[VllmConfig, list[dict[str, KVCacheSpec]], list[int]],
                       list[KVCacheConfig]] = mod.get_kv_cache_configs

    @functools.wraps(original)
    def get_kv_cache_configs(vllm_config: VllmConfig, kv_cache_specs: list[dict[str, KVCacheSpec]],
                             available_memory: list[int]) -> list[KVCacheConfig]:
        tp = vllm_config.parallel_config.tensor_parallel_size > 1
        # (a TP engine core registers no tenant)
        if b.tenant is None and not tp:
            return original(vllm_config, kv_cache_specs, available_memory)
        from kvpool.engine_adapters.vllm.kv_units import whole_chunks

        # whole chunks, and the layers of a block side by side when that makes a
        # chunk small (kv_units.py)
        return whole_chunks(lambda avail: original(vllm_config, kv_cache_specs, avail),
                            available_memory, b.page_size(), b.settings.kv_unit == "small",
                            b.capacity() if b.tenant is not None else sum(available_memory))

    setattr(mod, "get_kv_cache_configs", get_kv_cache_configs)

    # The engine core's loop (a server) and its in-process form (offline LLM without
    # multiprocessing) both reach the scheduler only through these.
    for cls, names in ((mod.EngineCore, ("step", "step_with_batch_queue", "add_request",
                                         "abort_requests")),
                       (mod.EngineCoreProc, ("_process_engine_step", "_handle_client_request"))):
        for name in names:
            method: Callable[..., Any] = getattr(cls, name)

            def locked(self: object, *args: Any, _m: Callable[..., Any] = method,
                       **kwargs: Any) -> Any:
                with b.step_lock:
                    return _m(self, *args, **kwargs)

            functools.update_wrapper(locked, method)
            setattr(cls, name, locked)
    init_kv: Callable[..., Any] = mod.EngineCore._initialize_kv_caches

    @functools.wraps(init_kv)
    def _initialize_kv_caches(self: Any, vllm_config: VllmConfig) -> Any:
        if vllm_config.parallel_config.tensor_parallel_size == 1:
            return init_kv(self, vllm_config)
        # tensor parallelism: the allocator's refill thread sends its RPCs under the step
        # lock; the warm-up's RPC (after the allocator exists) must not interleave
        with b.step_lock:
            return init_kv(self, vllm_config)

    setattr(mod.EngineCore, "_initialize_kv_caches", _initialize_kv_caches)
    _patch_sleep(b, mod)


def _patch_sleep(b: VllmBridge, mod: ModuleType) -> None:
    """A request wakes a sleeping engine (before it is added), every step reports whether
    the engine has work, and ``is_sleeping`` sees kvpool's sleep too (:mod:`.sleep`)."""

    add: Callable[..., Any] = mod.EngineCore.add_request

    @functools.wraps(add)
    def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        if b.waker is not None:
            with b.step_lock:
                b.waker.for_request(self)
        return add(self, *args, **kwargs)

    setattr(mod.EngineCore, "add_request", add_request)
    step: Callable[..., Any] = mod.EngineCoreProc._process_engine_step

    @functools.wraps(step)
    def _process_engine_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = step(self, *args, **kwargs)
        if b.waker is not None:
            with b.step_lock:
                b.waker.after_step(self)
        return out

    setattr(mod.EngineCoreProc, "_process_engine_step", _process_engine_step)
    stepped: Callable[..., Any] = mod.EngineCoreProc._process_engine_step

    @functools.wraps(stepped)
    def poll_after_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = stepped(self, *args, **kwargs)
        if b.poll is not None:  # tensor parallelism: the ranks' asks
            from kvpool.engine_adapters.vllm.block_pool import VllmElasticPool

            with b.step_lock:
                b.poll.after_step(b.pool if isinstance(b.pool, VllmElasticPool) else None)
        return out

    setattr(mod.EngineCoreProc, "_process_engine_step", poll_after_step)
    is_sleeping: Callable[[Any], bool] = mod.EngineCore.is_sleeping

    @functools.wraps(is_sleeping)
    def is_sleeping_too(self: Any) -> bool:
        return is_sleeping(self) or (b.sleep is not None and b.sleep.is_sleeping)

    setattr(mod.EngineCore, "is_sleeping", is_sleeping_too)
    wake_up: Callable[..., bool] = mod.EngineCore.wake_up

    @functools.wraps(wake_up)
    def wake_up_too(self: Any, tags: list[str] | None = None) -> bool:
        # vLLM's wake reaches the worker only when vLLM's own sleep paused the executor
        # ("Executor is not sleeping" otherwise): a sleep of kvpool's is woken here, so
        # the route's answer is the wake (core_sleep.py)
        if self.model_executor.is_sleeping or b.sleep is None or \
                (tags is not None and "kv_cache" not in tags):
            return wake_up(self, tags)
        if b.sleep.is_sleeping and not b.sleep.wake("http"):
            raise AdapterError(f"kvpool: cannot wake: {b.sleep.last_error}")
        if self.is_scheduler_paused():
            self.resume_scheduler()
        return True

    setattr(mod.EngineCore, "wake_up", wake_up_too)

    def kvpool_wake(self: Any, tags: list[str] | None = None) -> tuple[bool, str]:
        """``wake_up`` for kvpool's route (sleep_routes.py): (fully awake, '') or (False,
        why in one line); a failure is an answer, not an exception vLLM logs with its
        traceback."""
        try:
            return wake_up_too(self, tags), ""
        except Exception as e:
            from kvpool.engine_adapters.vllm.sleep_routes import wake_failure

            return False, wake_failure(e)

    setattr(mod.EngineCore, "kvpool_wake", kvpool_wake)

    def kvpool_sleep_state(self: Any) -> dict[str, Any]:
        """The state and counts of kvpool's sleep (``GET /kvpool/sleep``, sleep_routes.py)."""
        from kvpool.engine_adapters.vllm.sleep_routes import sleep_state

        return sleep_state(b.sleep, is_sleeping_too(self))

    setattr(mod.EngineCore, "kvpool_sleep_state", kvpool_sleep_state)


def _patch_cpu_worker_sleep(b: VllmBridge, cls: Any) -> None:
    """vLLM CPU's worker ``sleep``/``wake_up`` (no-ops that log a warning) become the
    KV-level sleep: what ``EngineCore.sleep`` (after pausing the scheduler) and
    ``wake_up`` call. A refusal or a failed wake raises one line (vLLM's route answers
    with it)."""

    def sleep(self: Any, level: int = 1) -> None:
        c = _controller(b)
        if not c.sleep("http"):
            raise AdapterError("kvpool: the engine still has requests (mode=keep?); it "
                               "sleeps only without them")

    def wake_up(self: Any, tags: list[str] | None = None) -> None:
        if tags and "kv_cache" not in tags:
            return  # weights: they never left (no sleep mode for them on CPU)
        c = _controller(b)
        if not c.wake("http"):
            raise AdapterError(f"kvpool: cannot wake: {c.last_error}")

    for name, fn in (("sleep", sleep), ("wake_up", wake_up)):
        functools.update_wrapper(fn, getattr(cls, name), assigned=(), updated=())
        setattr(cls, name, fn)


def _controller(b: VllmBridge) -> Any:
    if b.sleep is None:
        raise AdapterError("kvpool: this process has no elastic KV cache to put to sleep")
    return b.sleep


# ---- engine-core process: the KV cache ------------------------------------------------------
def _patch_allocate(b: VllmBridge, mod: ModuleType) -> None:
    if not hasattr(mod, "allocate_kv_cache"):
        raise AdapterError(f"kvpool: {mod.__name__} has no allocate_kv_cache: unknown vLLM")

    def _elastic_allocate(kv_cache_config: KVCacheConfig, device: torch.device,
                          layout: KVCacheLayout, kernel_block_sizes: list[int] | None = None
                          ) -> dict[str, torch.Tensor]:
        from vllm.v1.kv_cache_interface import create_kv_cache_views

        return b.allocate(kv_cache_config, device, layout, kernel_block_sizes,
                          create_kv_cache_views)

    setattr(mod, "allocate_kv_cache", _elastic_allocate)


# ---- engine-core process: the scheduler ------------------------------------------------------
def _patch_coordinator(b: VllmBridge, mod: ModuleType) -> None:
    from kvpool.engine_adapters.vllm.block_pool import VllmElasticPool

    # vLLM builds its pool as ``BlockPool(...)``: ours, over this process's adapter
    setattr(mod, "BlockPool", functools.partial(VllmElasticPool, bridge=b))


def _patch_manager(b: VllmBridge, mod: ModuleType) -> None:
    from kvpool.engine_adapters.vllm.block_pool import allocate_slots

    cls = mod.KVCacheManager
    cls.allocate_slots = allocate_slots(cls.allocate_slots)


def _patch_scheduler(b: VllmBridge, mod: ModuleType) -> None:
    from kvpool.engine_adapters.vllm.block_pool import VllmElasticPool
    from kvpool.engine_adapters.vllm.kv_events import publish_cleared

    cls = mod.Scheduler
    original: Callable[..., None] = cls.__init__

    @functools.wraps(original)
    def __init__(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        pool = self.kv_cache_manager.block_pool
        if isinstance(pool, VllmElasticPool):
            b.scheduler = self
            # a router that reconnects forgets a killed predecessor's blocks
            publish_cleared(self)
            if b.status is not None:  # tensor parallelism: no tenant here; asks are polled
                pool.start_idle_release(b.settings.idle_timeout_s)
                return
            assert b.tenant is not None  # the pool was built over its allocator
            b.tenant.set_shrink_callback(pool.shrink)
            pool.start_idle_release(b.settings.idle_timeout_s)
            from kvpool.engine_adapters.vllm import core_sleep as sleep

            sleep.attach(b, pool)

    cls.__init__ = __init__


def _patch_executor(b: VllmBridge, mod: ModuleType) -> None:
    """Tensor parallelism: once every worker allocated its KV cache (and before the
    warm-up), the engine core builds its allocator over the gang (:mod:`.tp`)."""

    cls = mod.Executor
    original: Callable[..., None] = cls.initialize_from_config

    @functools.wraps(original)
    def initialize_from_config(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.vllm_config.parallel_config.tensor_parallel_size > 1:
            from kvpool.engine_adapters.vllm.bridge import REFILL_TICK_S
            from kvpool.engine_adapters.vllm.tp import ReclaimPoll, scheduler_allocator

            b.allocator, b.status = scheduler_allocator(self, b.settings, b.step_lock,
                                                        REFILL_TICK_S)
            b.poll = ReclaimPoll(self, b.allocator)

    cls.initialize_from_config = initialize_from_config


def install(b: VllmBridge) -> None:
    """Register every patch (each applies when its module is imported) over ``b``, this
    process's one adapter object: each patched vLLM method holds it (a closure); no
    module global refers to it."""
    for name, patch in (("vllm.engine.arg_utils", _patch_arg_utils),
                        ("vllm.entrypoints.serve.dev.sleep.api_router", _patch_sleep_routes),
                        ("vllm.entrypoints.launchers.app", _patch_api_routers),
                        ("vllm.entrypoints.serve.instrumentator.metrics", _patch_metrics),
                        ("vllm.v1.worker.cpu_worker", _patch_cpu_worker),
                        ("vllm.v1.worker.gpu_worker", _patch_gpu_worker),
                        ("vllm.v1.engine.core", _patch_engine_core),
                        ("vllm.v1.worker.gpu_model_runner", _patch_allocate),
                        ("vllm.v1.worker.gpu.attn_utils", _patch_allocate),
                        ("vllm.v1.core.kv_cache_coordinator", _patch_coordinator),
                        ("vllm.v1.core.kv_cache_manager", _patch_manager),
                        ("vllm.v1.core.sched.scheduler", _patch_scheduler),
                        ("vllm.v1.executor.abstract", _patch_executor),
                        ("vllm.distributed.weight_transfer.factory", _register_transfer)):
        when_imported(name, functools.partial(patch, b))
