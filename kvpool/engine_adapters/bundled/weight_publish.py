"""A new checkpoint published to a running elastic bundled engine whose weights are in the
pool (``POST /kvpool/weights``, :mod:`kvpool.elastic_server.weight_routes`): the engine
switches weight sets at a step boundary while its KV stays (docs/ARCHITECTURE.md,
"Trainer tenant").

:func:`publish` checks the checkpoint against the engine's model (headers only: names and
shapes), then, under the engine's ``step_lock`` with no request in the engine, re-keys the
engine's :class:`~kvpool.engine_adapters.bundled.weights.PoolWeights`: the current set is
detached and the new checkpoint's set attached (another tenant made it) or created,
loaded from the checkpoint (one copy of the weights' bytes) and sealed, into the same
addresses, so the model's parameter tensors never change. The prefix cache is dropped
(its KV was computed with the old weights); the KV's pages stay mapped. A sleeping engine
only remembers the new set: its wake loads it. A new set that cannot be made leaves the
old one serving (the error raised).

This is the copy path (a new set per publish). The in-place path, :func:`follow`: the
engine reads a trainer's mutable set of its own layout (named by the trainer's nonce:
:func:`~kvpool.engine_adapters.bundled.weights.mutable_key`) and moves to each published
version by a remap at the same addresses, no byte copied (docs/ARCHITECTURE.md, "Mutable
weight sets").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool import protocol as p
from kvpool.client_lib.errors import KvpoolError
from kvpool.client_lib.weights import content_key
from kvpool.engine.model import loader
from kvpool.engine_adapters.bundled.block_pool import elastic_pool
from kvpool.engine_adapters.bundled.bridge import bridge_of
from kvpool.engine_adapters.bundled.weights import PoolWeights, mutable_key, set_key

if TYPE_CHECKING:
    from kvpool.engine.engine import Engine


class PublishError(ValueError):
    """A publish refused before anything changed (one line): not pool weights, a
    checkpoint that does not match the model, a busy engine (``busy``)."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


@dataclass(frozen=True)
class Published:
    """What one publish did: the new set's key, whether this engine loaded it (bytes
    copied from the checkpoint) or attached it, whether it was only remembered (asleep),
    the prefix-cache blocks dropped, and the seconds the engine was held."""

    key: str
    nbytes: int
    loaded: bool
    deferred: bool
    evicted: int
    seconds: float
    version: int = 0  # in place: the mutable set's version now read (0: the copy path)

    @property
    def bytes_copied(self) -> int:
        return self.nbytes if self.loaded else 0


SHOWN = 200  # characters of a checkpoint path an error repeats


def _pool_weights(engine: Engine) -> PoolWeights:
    bridge = bridge_of(engine)
    weights = bridge.weights if bridge is not None else None
    if weights is None:
        raise PublishError("this engine's weights are not in the pool (kvpool serve "
                           "--elastic --weights pool publishes; --weights local does not)")
    return weights


def _refuse_if_busy(engine: Engine) -> None:
    """:class:`PublishError` (busy) while requests are in the engine (call under its
    ``step_lock``)."""
    if engine.has_unfinished() or engine.detached:
        raise PublishError("the engine is serving requests; it switches weights only "
                           "between rollouts", busy=True)


def follow(engine: Engine, nonce: str, version: int | None = None) -> Published:
    """Serve the trainer's mutable set named by ``nonce`` (of this engine's layout) at
    ``version`` (None: its current one) from the next step on: attached the first time,
    remapped to the version's buffer after, no byte copied. Raises
    :class:`PublishError` (nothing changed) for a set of another layout or a version
    that is not the current one, ``KvpoolError`` for any other refusal (what served
    before serves on)."""
    weights = _pool_weights(engine)
    key = mutable_key(weights.layout, nonce)
    with engine.step_lock:  # between steps: no forward pass reads the parameters
        _refuse_if_busy(engine)
        t0 = time.perf_counter()
        held = weights.held
        before = weights.version if weights.mutable == key else -1
        try:
            now = weights.follow(key, version)
        except KvpoolError as e:
            if e.code == p.NOT_FOUND:
                raise PublishError("no mutable weight set of this engine's layout has that "
                                   "nonce (a trainer of another dtype or layout publishes a "
                                   "checkpoint)") from None
            if e.code == p.BAD_REQUEST:
                raise PublishError(f"the mutable weight set refused: {e.message}") from None
            raise
        evicted = elastic_pool(engine).reset_prefix_cache() if held and now != before else 0
        seconds = time.perf_counter() - t0
    return Published(key, weights.layout.nbytes, False, not held, evicted, seconds, now)


def publish(engine: Engine, checkpoint: str | Path) -> Published:
    """Serve ``checkpoint``'s weights from the next step on (see the module). Raises
    :class:`PublishError` (nothing changed), ``KvpoolError`` when the daemon cannot give
    the new set its memory (the old set serves on)."""
    weights = _pool_weights(engine)
    path = Path(checkpoint)
    shown = repr(str(path)[:SHOWN]) + ("..." if len(str(path)) > SHOWN else "")
    try:  # a hostile name (NUL, too long, a loop) is a refusal, not a server error
        if not path.is_dir():
            raise PublishError(f"no checkpoint folder at {shown}")
        plan = loader.check_checkpoint(path, loader.meta_model(engine.model_config),
                                       engine.model_config)
        key = set_key(content_key(path).key, weights.layout)
    except PublishError:
        raise
    except (OSError, ValueError) as e:  # CheckpointError: missing, unexpected, unreadable
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise PublishError(f"cannot read the checkpoint at {shown}: "
                           f"{why.splitlines()[0] if why else type(e).__name__}") from None
    with engine.step_lock:  # between steps: no forward pass reads the parameters
        _refuse_if_busy(engine)
        t0 = time.perf_counter()
        held = weights.held
        loaded = weights.rekey(key, lambda tensors: loader.fill(plan, tensors))
        evicted = elastic_pool(engine).reset_prefix_cache() if held else 0
        seconds = time.perf_counter() - t0
    return Published(key, weights.layout.nbytes, loaded, not held, evicted, seconds)
