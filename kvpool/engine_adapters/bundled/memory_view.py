"""The KV memory an elastic bundled engine could use now, for its ``/metrics``
(:class:`ElasticMemory`, the engine server's
:class:`~kvpool.engine.serving.metrics.MemorySource`).

Held: the blocks of the chunks its allocator maps (in use, cached or free), less the
null block. Grantable: the whole chunks the daemon would grant at once (``Room``'s
``headroom``, read through a :class:`~kvpool.engine_adapters.room_watch.RoomWatch`,
never waiting on the daemon), at most the chunks of its virtual capacity not mapped
yet. Asleep: every block given back until a wake (the pool's). The ``kvpool:`` byte
gauges are the same ``Room`` answer's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.engine.serving.metrics import MemoryView
from kvpool.engine_adapters.room_watch import RoomWatch

if TYPE_CHECKING:
    from kvpool.engine.engine import Engine
    from kvpool.engine_adapters.bundled.bridge import BundledBridge


class ElasticMemory:
    """``engine``'s memory view through ``bridge`` (its tenant and pool); :meth:`close`
    ends the room watch."""

    def __init__(self, engine: Engine, bridge: BundledBridge) -> None:
        self.engine = engine
        self.bridge = bridge
        tenant = bridge.tenant
        self.watch = RoomWatch(tenant.room) if tenant is not None else None

    def memory_view(self) -> MemoryView | None:
        pool = self.bridge.pool
        if pool is None or self.watch is None or self.bridge.tenant is None:
            return None
        alloc = pool.allocator
        per_chunk = alloc.blocks_per_chunk
        asleep = pool.asleep
        null = 0 if asleep else 1
        held = max(0, alloc.mapped_chunks * per_chunk - null)
        room = self.watch.latest()
        if room is None:
            return MemoryView(held=held, grantable=0, asleep=asleep)
        chunk_bytes = alloc.chunk_bytes * alloc.group.n_regions
        chunks = min(alloc.unmapped_chunks, room.headroom // chunk_bytes) if chunk_bytes else 0
        scalars = {"kvpool:headroom_bytes": float(room.headroom),
                   "kvpool:granted_bytes": float(room.granted),
                   "kvpool:min_bytes": float(room.min), "kvpool:max_bytes": float(room.max),
                   "kvpool:pool_free_bytes": float(room.pool_free)}
        return MemoryView(held=held, grantable=max(0, chunks) * per_chunk, asleep=asleep,
                          scalars=scalars)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
