"""The scheduler's stand-in for a tensor-parallel vLLM server's gang (issue 26, scope 4;
the gang driver of ``engine_adapters/gang.py``): an ElasticBlockAllocator drives a
CollectiveGroup whose every grant and release is applied by each rank's Member, on a
two-device daemon.

The ranks are in-process sessions on threads (a gang part waits for its peers), the
stand-in for vLLM's ``collective_rpc`` to its workers; no vLLM needed."""

from __future__ import annotations

import threading

import pytest

from kvpool.client_lib import ElasticBlockAllocator, Monitor
from kvpool.client_lib.errors import NoMemory
from kvpool.engine_adapters.gang import CollectiveGroup, GangOp, GroupShape, Member

from daemon.helpers import PAGE

BUDGET = 16  # pages per device
LAYOUT = [(2, 8 * PAGE)]  # 2 regions (layers): a unit is 2 pages on every device


class Threads:
    """A Collective over in-process members: each rank's apply on its own thread."""

    def __init__(self, members: list[Member]) -> None:
        self.members = members
        self.ops: list[GangOp] = []

    def __call__(self, op: GangOp) -> list[str | None]:
        self.ops.append(op)
        out: list[str | None] = [None] * len(self.members)

        def run(i: int) -> None:
            out[i] = self.members[i].apply(op)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(self.members))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
            assert not th.is_alive(), "a rank's part did not return"
        return out


def mapped_by_device(d, name):  # noqa: ANN001
    out = []
    for dev in (0, 1):
        with Monitor(d.run_dir, device=dev) as m:
            ps = m.ps()
            out.append(sum(t.mapped for t in ps.tenants if t.name == name))
            assert m.check() == [], (dev, m.check())
    return out


def test_every_grant_and_release_is_applied_on_every_rank(start_daemon):
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--devices", "2"))
    r0 = d.connect("tp", device=0)
    token = r0.create_gang([0, 1], LAYOUT)
    r1 = d.connect("tp", device=1, gang=token, rank=1, layout=LAYOUT)
    with r0, r1:
        g0, g1 = r0.region_group(*LAYOUT[0]), r1.region_group(*LAYOUT[0])
        coll = Threads([Member(g0), Member(g1)])
        group = CollectiveGroup(coll, GroupShape.of(g0), r0)
        alloc = ElasticBlockAllocator(group, PAGE // 2, low=0, high=0, background=False,
                                      take_first=1)
        assert alloc.first_blocks == [0]  # the null block, mapped on both ranks
        blocks = alloc.alloc(6, wait=False)
        assert blocks is not None and len(blocks) == 6
        # the grant returned only after both ranks mapped it: same units, same bytes
        assert g0.mapped == g1.mapped == group.mapped and group.mapped
        want = len(group.mapped) * PAGE * 2
        assert mapped_by_device(d, "tp") == [want, want]
        alloc.check_integrity()
        # device 1 full (another tenant): the gang grant fails on both ranks, none maps
        with d.connect("solo", device=1) as solo:
            solo.region_group(1, BUDGET * PAGE).grant(range(BUDGET - len(group.mapped) * 2))
            before = set(group.mapped)
            assert alloc.alloc(6, wait=False) is None
            assert g0.mapped == g1.mapped == group.mapped == before
            with pytest.raises(NoMemory):
                group.grant([7])
            assert g0.mapped == g1.mapped == before
        # freed blocks: their chunks go back on both ranks
        alloc.free(blocks + [0])
        alloc.release_reserve(BUDGET * PAGE * 2)
        assert g0.mapped == g1.mapped == group.mapped == set()
        assert mapped_by_device(d, "tp") == [0, 0]
        alloc.check_integrity()
        alloc.close()
        group.close()
    assert mapped_by_device(d, "tp") == [0, 0]


def test_only_pipeline_or_data_parallelism_is_refused_in_one_line():
    from kvpool.engine_adapters.vllm.checks import parallel_refusal

    assert parallel_refusal(2, 1, 1) is None  # tensor parallelism: one gang (vllm/tp.py)
    assert parallel_refusal(1, 1, 1) is None
    for tp, pp, dp in ((1, 2, 1), (1, 1, 2), (2, 2, 1)):
        why = parallel_refusal(tp, pp, dp)
        assert why is not None and "\n" not in why
        assert why.startswith("kvpool: KVPOOL_ENABLE=1 serves one rank")
        assert f"pipeline-parallel {pp}, data-parallel {dp}" in why


class FakeExecutor:
    """vLLM's executor as RpcCollective sees it: records each RPC and whether the step
    lock was held while it ran."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock, self.calls, self.is_failed = lock, [], False

    def collective_rpc(self, method, args=()):  # noqa: ANN001, ANN201
        other = threading.Thread(target=lambda: self.calls.append(
            ("free", self.lock.acquire(blocking=False))))
        other.start()
        other.join(10)
        self.calls.append((method.__name__, args))
        return [None, None]


def test_the_rpc_collective_holds_the_step_lock_and_the_status_follows_the_executor():
    from kvpool.engine_adapters.gang import UsageOp
    from kvpool.engine_adapters.vllm.tp import ExecutorStatus, RpcCollective

    lock = threading.RLock()
    ex = FakeExecutor(lock)
    op = UsageOp(1, (2,))
    assert RpcCollective(ex, lock)(op) == [None, None]
    # another thread could not take the step lock during the RPC: it ran beside no step
    assert ex.calls == [("free", False), ("worker_apply", (op,))]
    st = ExecutorStatus(ex)
    assert not st.closed and st.connected
    ex.is_failed = True
    assert st.closed and not st.connected
