"""A rank (> 0) of a tensor-parallel bundled engine whose KV cache is a kvpool gang:
``python -m kvpool.engine_adapters.bundled.gang_rank SPEC`` (the engine's
``tp_rank_module`` when :func:`kvpool.engine_adapters.bundled.enable` sees
``tensor_parallel_size`` > 1).

It is the engine's own rank (:mod:`kvpool.engine.tp.rank`) with :class:`GangRank` as its
hooks: rank 0's adapter (:mod:`.bridge`, over :mod:`kvpool.engine_adapters.gang`) tells
it, in order with the steps, to join the gang (:class:`~.gang_messages.Join`: a tenant
of its own on its device, registered into the gang with the token, and the gang's one
region group) and to take its part of every grant and release (:class:`~.gang_messages.Grant` /
``Release``: the same units as rank 0, mapped before the call returns, unmapped before
the part is sent). Its KV cache is tensor views over that group, as rank 0's is. It runs
no allocator, no refill and no shrink: rank 0 decides everything (the daemon mirrors a
reclaim ask to every rank; this rank's tenant answers its own with nothing freed, and
rank 0's collective release counts for every rank).

A grant the daemon refuses (``NoMemory``) is refused on every rank alike (nothing to do
here). Any other error on a grant (no answer in time: the daemon may still commit it), or
a mapping that fails after a granted part, ends the rank (its session ends, which ends the gang:
every rank's pages go back); rank 0's next step fails with one line.
"""

from __future__ import annotations

import logging
import math
import sys

import torch

from kvpool.client_lib import KvpoolError, NoMemory, RegionGroup, Tenant, connect
from kvpool.engine.tp import rank as tp_rank
from kvpool.engine.kv_cache import KVCache, KVCacheSpec
from kvpool.engine_adapters.bundled import gang_messages

log = logging.getLogger("kvpool.engine_adapters.bundled")


class GangRank:
    """:class:`kvpool.engine.tp.rank.RankHooks` of a gang rank (see the module)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.tenant: Tenant | None = None
        self.group: RegionGroup | None = None
        self.block_stride = 0  # rank 0's (Join)

    def handle(self, payload: bytes) -> None:
        msg = gang_messages.decode(payload)
        if isinstance(msg, gang_messages.Join):
            self._join(msg)
            return
        group = self.group
        if group is None:
            raise RuntimeError("a gang grant or release before the join")
        if isinstance(msg, gang_messages.Grant):
            try:
                group.grant(msg.units)
            except NoMemory as e:  # the daemon's answer to every part alike (all or none)
                log.debug("gang grant of %d units refused: %s", len(msg.units), e)
            # any other error (no answer in time: the daemon may still commit it) ends
            # this rank: its session's end ends the gang, every rank's pages go back
        else:
            try:
                group.release(msg.units)
            except (KvpoolError, ValueError) as e:  # the gang ended; nothing mapped
                log.warning("gang release of %d units: %s", len(msg.units), e)

    def _join(self, msg: gang_messages.Join) -> None:
        if self.tenant is not None:
            raise RuntimeError("joined a gang twice")
        layout = [(msg.n_regions, msg.capacity)]
        self.tenant = connect(msg.name, device=msg.devices[self.rank], run_dir=msg.run_dir,
                              kind="engine", gang=msg.token, rank=self.rank, layout=layout)
        self.group = self.tenant.region_group(msg.n_regions, msg.capacity, label=msg.label,
                                              chunk_units=msg.chunk_units)
        self.block_stride = msg.block_stride

    def make_kv_cache(self, spec: KVCacheSpec, num_blocks: int,
                      device: torch.device) -> KVCache:
        group = self.group
        if group is None:
            raise RuntimeError("the KV cache was built before the gang join")
        per_region = self.block_stride  # rank 0's stride: the same units hold the same blocks
        if spec.num_buffers != group.n_regions or per_region < spec.buffer_block_bytes or \
                math.ceil(num_blocks * per_region / group.page_size) > group.npages:
            raise RuntimeError(f"{num_blocks} blocks of {spec.num_buffers} x "
                               f"{spec.buffer_block_bytes} bytes ({per_region} apart) do not "
                               f"fit the gang's group")
        buffers = [group.tensor(i, torch.uint8, nbytes=num_blocks * per_region)
                   for i in range(spec.num_buffers)]
        if device.type != buffers[0].device.type:
            raise RuntimeError(f"the engine runs on {device} but the gang's memory is on "
                               f"{buffers[0].device}")
        return KVCache.from_buffers(spec, buffers, num_blocks, block_stride=per_region)

    def close(self) -> None:
        if self.tenant is not None:
            tenant, self.tenant = self.tenant, None
            tenant.close()
        self.group = None


if __name__ == "__main__":
    sys.exit(tp_rank.main(sys.argv[1:], lambda spec: GangRank(spec.rank)))
