"""What a tenant process links: a connection to the daemon, region groups, the elastic
block allocator (fast path / slow path) and zero-copy tensor views.

    from kvpool.client_lib import connect, ElasticBlockAllocator

    with connect(name="llama-8b") as tenant:
        group = tenant.region_group(n_regions=2 * layers, capacity_bytes=8 << 30)
        alloc = ElasticBlockAllocator(group, block_bytes_per_region=block_bytes)
        k0 = group.tensor(0, torch.float16, (alloc.num_blocks, block_size, heads, dim))
        blocks = alloc.alloc(4)      # None when memory is short: queue the request
        alloc.free(blocks)
        tenant.set_shrink_callback(lambda nbytes, urgent: evict(nbytes, urgent))

A training process: ``connect_trainer`` (:mod:`kvpool.client_lib.trainer`).
"""

from kvpool.client_lib.admin import Monitor
from kvpool.client_lib.allocator import ElasticBlockAllocator, Holdings
from kvpool.client_lib.errors import (
    DaemonUnavailable,
    KvpoolError,
    NoMemory,
    OverLimit,
    ProtocolError,
    StepDeadline,
    StepTooLarge,
)
from kvpool.client_lib.regions import RegionGroup
from kvpool.client_lib.lease import Lease
from kvpool.client_lib.tenant import Tenant, connect
from kvpool.client_lib.trainer import Trainer, connect_trainer

__all__ = [
    "DaemonUnavailable",
    "ElasticBlockAllocator",
    "Holdings",
    "Lease",
    "KvpoolError",
    "Monitor",
    "NoMemory",
    "OverLimit",
    "ProtocolError",
    "RegionGroup",
    "StepDeadline",
    "StepTooLarge",
    "Tenant",
    "Trainer",
    "connect",
    "connect_trainer",
]
