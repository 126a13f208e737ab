"""Tensor parallelism: one gang per vLLM server, one rank per worker (issue 26, scope 4).

Workers (each its own process, device ``KVPOOL_DEVICE + rank``):

* ``determine_available_memory``: rank 0 registers (its device) and tells every rank the
  capacity over vLLM's TP group (:func:`tp_capacity`); the other ranks do not register
  yet (a gang rank registers with the gang's token);
* ``allocate_kv_cache`` (:func:`join_gang`, inside the collective
  ``initialize_from_config``): rank 0 creates the gang with the layout, the token goes to
  the other ranks over vLLM's TP group (a private gloo broadcast), each joins, creates
  the same group and builds its views over it; its
  :class:`~kvpool.engine_adapters.gang.Member` answers the scheduler's operations
  (:func:`worker_apply`).

Engine core (no KV memory): after ``initialize_from_config`` (:func:`scheduler_allocator`)
the allocator is built over the gang driver's
:class:`~kvpool.engine_adapters.gang.CollectiveGroup` whose transport is
``executor.collective_rpc(worker_apply, ...)`` (:class:`RpcCollective`), taken under
the bridge's step lock (the executor's queue sees one RPC at a time); block 0 (the null block) is granted then,
before the warm-up. Reclaim asks reach each rank's tenant; rank 0's are polled by the
engine core once per step (:func:`poll_reclaim`), which shrinks the scheduler's pool.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.engine_adapters.gang import CollectiveGroup, GangOp, GroupShape, Member
from kvpool.engine_adapters.vllm.settings import AdapterError

POLL_S = 0.25  # the engine core asks rank 0 for pending reclaim asks at most this often

if TYPE_CHECKING:
    from kvpool.client_lib import ElasticBlockAllocator, RegionGroup, Tenant
    from kvpool.engine_adapters.vllm.settings import Settings


class Shrinkable(Protocol):
    """The scheduler's pool as the reclaim poll needs it (``VllmElasticPool.shrink``)."""

    def shrink(self, nbytes: int, urgent: bool) -> None: ...


class WorkerGang:
    """This worker process's part of the gang: its member, and reclaim asks its tenant
    received that the engine core has not collected yet."""

    def __init__(self) -> None:
        self.member: Member | None = None
        self.block_bytes = self.num_blocks = 0
        self._asked = 0
        self._lock = threading.Lock()

    def asked(self, nbytes: int, urgent: bool) -> None:
        """(the tenant's shrink callback) Remember the ask for the engine core's poll."""
        with self._lock:
            self._asked = max(self._asked, nbytes)

    def take_asked(self) -> int:
        with self._lock:
            n, self._asked = self._asked, 0
            return n


WORKER = WorkerGang()  # this process's (a vLLM worker's)


def tp_rank() -> tuple[int, int]:
    """(this worker's rank, the TP size) from vLLM's TP group; (0, 1) without one."""
    from vllm.distributed.parallel_state import get_tp_group

    g = get_tp_group()
    return g.rank_in_group, g.world_size


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (vLLM's TP group, collective)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().broadcast_object(obj, src=0)


class ExecutorStatus:
    """The gang's status as the engine core sees it (a GroupStatus): closed once the
    executor failed or the engine core closed the group."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor
        self.stopped = False

    @property
    def closed(self) -> bool:
        return self.stopped or bool(getattr(self._executor, "is_failed", False))

    @property
    def connected(self) -> bool:
        return not self.closed


class RpcCollective:
    """The Collective over vLLM's executor: one ``collective_rpc`` per op, under the
    bridge's step lock (so never beside a step's ``execute_model``)."""

    def __init__(self, executor: Any, lock: threading.RLock) -> None:
        self._executor = executor
        self._lock = lock

    def __call__(self, op: GangOp) -> list[str | None]:
        with self._lock:
            out: list[str | None] = self._executor.collective_rpc(worker_apply, args=(op,))
            return out


# ---- worker side (functions sent by collective_rpc: ``worker`` is vLLM's worker) --------
def worker_apply(worker: Any, op: GangOp) -> str | None:
    m = WORKER.member
    if m is None:
        return "INTERNAL: this worker holds no kvpool gang group"
    return m.apply(op)


def worker_shape(worker: Any) -> tuple[GroupShape, int, int]:
    """(the group's shape, block bytes per region, vLLM's block count) of this worker."""
    m = WORKER.member
    if m is None:
        raise AdapterError("kvpool: this worker holds no kvpool gang group")
    return GroupShape.of(m.group), WORKER.block_bytes, WORKER.num_blocks


def worker_reclaim(worker: Any) -> int:
    """Bytes the daemon asked this rank for since the last call (0: none)."""
    return WORKER.take_asked()


def join_gang(tenant: Tenant | None, s: Settings, name: str, n_regions: int,
              region_bytes: int, block_bytes: int, num_blocks: int, chunk_units: int = 1
              ) -> tuple[Tenant, RegionGroup]:
    """(every worker, collectively) The gang and this rank's group of it: (this rank's
    tenant, its group, granted ``chunk_units`` units at a time); rank 0 passes the tenant
    it registered as."""
    from kvpool.client_lib import KvpoolError, connect

    rank, size = tp_rank()
    layout = [(n_regions, region_bytes)]
    token: str | None = None
    err: str | None = None
    if rank == 0:
        assert tenant is not None, "rank 0 registered in determine_available_memory"
        try:
            token = tenant.create_gang([s.device + r for r in range(size)], layout)
        except KvpoolError as e:
            err = f"kvpool: cannot create the gang of {size} ranks ({e})"
    token, err = broadcast((token, err))
    if err is not None:
        raise AdapterError(err)
    if rank > 0:
        try:
            tenant = connect(name=name, device=s.device + rank, run_dir=s.run_dir,
                               kind="engine", gang=token, rank=rank, layout=layout)
        except (KvpoolError, OSError) as e:
            raise AdapterError(f"kvpool: rank {rank} cannot join the gang ({e})") from None
    assert tenant is not None
    tenant.set_shrink_callback(WORKER.asked)
    group = tenant.region_group(n_regions, region_bytes, label=name, chunk_units=chunk_units)
    WORKER.member = Member(group)
    WORKER.block_bytes, WORKER.num_blocks = block_bytes, num_blocks
    return tenant, group


# ---- engine core ------------------------------------------------------------------------
def scheduler_allocator(executor: Any, s: Settings, step_lock: threading.RLock,
                        tick_s: float) -> tuple[ElasticBlockAllocator, ExecutorStatus]:
    """(engine core, after the workers allocated) The allocator over the gang, its null
    block taken (granted on every rank), and the gang's status."""
    from kvpool.client_lib import ElasticBlockAllocator

    shapes: list[tuple[GroupShape, int, int]] = executor.collective_rpc(worker_shape)
    shape, block_bytes, num_blocks = shapes[0]
    def same(sh: tuple[GroupShape, int, int]) -> tuple[int, ...]:
        g = sh[0]  # each rank's group id is its own
        return g.page_size, g.npages, g.capacity, g.n_regions, sh[1], sh[2]

    if any(same(sh) != same(shapes[0]) for sh in shapes[1:]):
        raise AdapterError(f"kvpool: the workers' KV layouts differ: {shapes}")
    status = ExecutorStatus(executor)
    group = CollectiveGroup(RpcCollective(executor, step_lock), shape, status)
    alloc = ElasticBlockAllocator(
        group, block_bytes, low=s.low, high=s.high, populate=True, tick_s=tick_s,
        idle_timeout_s=s.idle_timeout_s, max_blocks=num_blocks, take_first=1)
    if alloc.num_blocks != num_blocks:
        raise AdapterError(f"kvpool: allocator holds {alloc.num_blocks} blocks, "
                           f"vLLM expects {num_blocks}")
    if alloc.first_blocks != [0]:
        raise AdapterError("kvpool: cannot map vLLM's null block on every rank; is the "
                           "daemon's budget smaller than one KV chunk per device?")
    return alloc, status


class ReclaimPoll:
    """(engine core) Collects the ranks' reclaim asks after a step, at most every
    ``POLL_S``, and acts on the largest: reserve chunks first, then the pool's shrink."""

    def __init__(self, executor: Any, allocator: ElasticBlockAllocator) -> None:
        self._executor = executor
        self._allocator = allocator
        self._next = 0.0

    def after_step(self, pool: Shrinkable | None) -> None:
        """(step lock held)"""
        now = time.monotonic()
        if pool is None or now < self._next:
            return
        self._next = now + POLL_S
        asked: list[int] = self._executor.collective_rpc(worker_reclaim)
        n = max(asked) if asked else 0
        if n > 0:
            n -= self._allocator.release_reserve(n)
            if n > 0:
                pool.shrink(n, urgent=False)
