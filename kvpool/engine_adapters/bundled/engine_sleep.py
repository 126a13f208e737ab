"""Sleep and wake of an elastic bundled engine: what it releases and takes back (its HTTP
routes: :mod:`kvpool.elastic_server.sleep_routes`).

:class:`BundledSleep` is the bundled engine's :class:`~kvpool.engine_adapters.sleep_controller.
SleepTarget`: asleep, the tenant holds nothing in the pool. ``release_all`` (under the
engine's ``step_lock``, refused if a request is in the engine) evicts the prefix cache,
frees the null block and suspends the allocator (every chunk released, no refill: the
pool's :meth:`~kvpool.engine_adapters.elastic.ElasticPolicy.sleep`), then releases the weight set
(:meth:`~kvpool.engine_adapters.bundled.weights.PoolWeights.release`: unmapped and
detached, the virtual range kept, so the parameters keep their addresses). ``restore``
re-attaches the weights (warm when the daemon still caches the set, else reloaded from
the checkpoint) and takes the null block's chunk back; the rest of the KV comes back
lazily as requests allocate. With ``--weights local`` (no pool weights) only the KV goes.

:func:`attach` builds the :class:`~kvpool.engine_adapters.sleep_controller.SleepController` of a
built engine (its tenant's sleep handler, the idle timer of ``KVPOOL_SLEEP_AFTER``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvpool.engine_adapters.bundled.block_pool import elastic_pool
from kvpool.engine_adapters.sleep_controller import SleepController, SleepRefused

if TYPE_CHECKING:
    from kvpool.engine.engine import Engine
    from kvpool.engine_adapters.bundled.block_pool import BundledElasticPool



class Weights(Protocol):
    """The engine's weights in the pool (:class:`~.weights.PoolWeights`)."""

    held: bool

    def release(self) -> None: ...

    def restore(self) -> bool: ...


class BundledSleep:
    """What a bundled engine gives back asleep and takes back awake (see the module)."""

    def __init__(self, engine: Engine, pool: BundledElasticPool, weights: Weights | None
                 ) -> None:
        self.engine = engine
        self.pool = pool
        self.weights = weights
        self.warm_wakes = self.cold_wakes = 0

    def busy(self) -> bool:
        return self.engine.has_unfinished() or bool(self.engine.detached)

    def release_all(self) -> None:
        with self.engine.step_lock:  # between steps; no request is admitted meanwhile
            if self.busy():
                raise SleepRefused("requests are running")
            self.pool.policy.sleep()
            if self.weights is not None and self.weights.held:
                self.weights.release()

    def restore(self) -> None:
        if self.weights is not None and not self.weights.held:
            if self.weights.restore():
                self.warm_wakes += 1
            else:
                self.cold_wakes += 1
        self.pool.policy.wake()


def attach(engine: Engine) -> SleepController | None:
    """The sleep controller of an elastic engine built from an enabled config, registered
    as its tenant's sleep handler and kept by its bridge (closed with it); its idle timer
    runs with ``KVPOOL_SLEEP_AFTER``. None when the engine is not elastic."""
    from kvpool.engine_adapters.bundled.bridge import bridge_of

    bridge = bridge_of(engine)
    if bridge is None or bridge.tenant is None:
        return None
    tenant = bridge.tenant
    controller = SleepController(BundledSleep(engine, elastic_pool(engine), bridge.weights),
                                 tenant, sleep_after_s=bridge.settings.sleep_after_s)
    bridge.sleep = controller
    tenant.set_sleep_handler(controller)
    controller.start()
    return controller
