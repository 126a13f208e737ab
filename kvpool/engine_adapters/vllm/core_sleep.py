"""KV-level sleep of a vLLM engine core (vLLM CPU has no sleep mode of its own).

:class:`VllmSleep` is the :class:`~kvpool.engine_adapters.sleep_controller.SleepTarget` of the
engine core's :class:`~kvpool.engine_adapters.vllm.block_pool.VllmElasticPool`: asleep,
every KV page is back in the pool (prefix cache reset, the null block freed, the
allocator suspended: no refill); a wake takes the null block's chunk back (block 0
again) and the rest comes back as requests allocate. The model weights stay where vLLM
put them (vLLM's own sleep mode, CUDA only, would offload them: docs/VLLM-ADAPTER.md).

Who calls it (all in the engine core process, the one :class:`SleepController` of
:func:`attach`):

* vLLM's own routes (``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``, served
  with ``VLLM_SERVER_DEV_MODE=1``): ``EngineCore.sleep`` pauses the scheduler (its
  ``mode``: abort or wait for the requests) and calls the worker's ``sleep``, which on
  CPU was a no-op and is now the controller's :meth:`~SleepController.sleep`; the
  worker's ``wake_up`` is its :meth:`~SleepController.wake` (patches.py);
* ``kvpool sleep/wake NAME`` and the daemon's pressure: the tenant's worker thread
  calls the controller (refused while the scheduler has requests);
* the idle timer (``KVPOOL_SLEEP_AFTER``);
* a request: ``EngineCore.add_request`` wakes the engine first (vLLM's ``wake_up`` when
  its sleep paused the scheduler, else the controller's), so it is served; if the memory
  does not come, the request waits in the scheduler like any request short of KV, and
  every step tries the wake again (at most every ``WAKE_RETRY_S``).

Lock order: the engine core thread holds the bridge's ``step_lock`` when it calls the
controller; the controller's other callers take ``step_lock`` inside a transition. So
this target takes ``step_lock`` with a timeout (a sleep that cannot get it is refused,
a wake fails and is retried): never a deadlock.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from kvpool.engine_adapters.sleep_controller import SleepController, SleepRefused
from kvpool.engine_adapters.vllm.settings import AdapterError

if TYPE_CHECKING:
    from vllm.v1.engine.core import EngineCore

    from kvpool.engine_adapters.elastic import ElasticPolicy
    from kvpool.engine_adapters.vllm.bridge import VllmBridge

log = logging.getLogger("kvpool.vllm")

STEP_LOCK_WAIT_S = 10.0  # a transition waits this long for the engine's step
WAKE_RETRY_S = 0.5  # a wake for waiting requests that failed is retried this often


class SleepingPool(Protocol):
    """The engine core's :class:`~kvpool.engine_adapters.vllm.block_pool.VllmElasticPool`
    as sleep uses it: its policy's ``sleep`` and ``wake`` (the adapter contract's,
    :class:`~kvpool.engine_adapters.elastic.ElasticPolicy`), called with the bridge's
    ``step_lock`` held and no request in the scheduler."""

    @property
    def policy(self) -> ElasticPolicy: ...


class VllmSleep:
    """What a vLLM engine core gives back asleep (its KV) and takes back awake."""

    def __init__(self, bridge: VllmBridge, pool: SleepingPool) -> None:
        self.bridge = bridge
        self.pool = pool

    def busy(self) -> bool:
        sched = self.bridge.scheduler
        return sched is not None and sched.has_unfinished_requests()

    def release_all(self) -> None:
        lock = self.bridge.step_lock
        if not lock.acquire(timeout=STEP_LOCK_WAIT_S):
            raise SleepRefused("the engine is in a step")
        try:
            if self.busy():
                raise SleepRefused("requests are running")
            self.pool.policy.sleep()
        finally:
            lock.release()

    def restore(self) -> None:
        lock = self.bridge.step_lock
        if not lock.acquire(timeout=STEP_LOCK_WAIT_S):
            raise AdapterError("kvpool: the engine did not end its step in time")
        try:
            self.pool.policy.wake()
        finally:
            lock.release()


class Waker:
    """The engine core's side: wake for a request, retry for waiting ones, report work."""

    def __init__(self, controller: SleepController) -> None:
        self.controller = controller
        self._retry_at = 0.0

    def for_request(self, core: EngineCore) -> None:
        """(engine core thread, ``step_lock`` held) A request is being added: wake the
        engine first. Never raises (the request waits for the memory instead)."""
        self.controller.note_work(True)
        self._wake(core)

    def after_step(self, core: EngineCore) -> None:
        """(engine core thread, ``step_lock`` held) After each step: report whether the
        engine has work; retry a failed wake while requests wait."""
        sched = core.scheduler
        busy = sched.has_unfinished_requests()
        self.controller.note_work(busy)
        if busy and self.controller.is_sleeping and time.monotonic() >= self._retry_at:
            self._wake(core)

    def _wake(self, core: EngineCore) -> None:
        try:
            if core.is_scheduler_paused() and core.model_executor.is_sleeping:
                core.wake_up(None)  # vLLM's sleep: its wake (ours runs in the worker)
            elif self.controller.is_sleeping:
                if not self.controller.wake("request"):
                    raise AdapterError(self.controller.last_error)
        except Exception as e:
            self._retry_at = time.monotonic() + WAKE_RETRY_S
            log.warning("kvpool: a request found the model asleep and it cannot wake yet "
                        "(%s); the request waits", e)


def attach(bridge: VllmBridge, pool: SleepingPool) -> SleepController:
    """The engine core's sleep controller: the tenant's sleep handler, kept (and closed)
    by the bridge, its idle timer running with ``KVPOOL_SLEEP_AFTER``."""
    tenant = bridge.tenant
    assert tenant is not None, "the pool is built over the tenant's allocator"
    controller = SleepController(VllmSleep(bridge, pool), tenant,
                                 sleep_after_s=bridge.settings.sleep_after_s)
    bridge.sleep = controller
    bridge.waker = Waker(controller)
    tenant.set_sleep_handler(controller)
    controller.start()
    return controller
