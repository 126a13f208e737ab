"""The one tensor-parallel gang driver (kvpool/engine_adapters/gang.py) as a rank that
holds memory itself uses it (the bundled engine's rank 0): its region group's grants and
releases become gang operations, each carried to the other ranks first by the engine's
transport, one at a time; a transport that cannot reach a rank (RankGone) refuses a
grant as NO_MEMORY without asking the daemon. On a two-device daemon, the other rank an
in-process session that applies each part on a thread of its own (the bundled ranks
apply what rank 0 posts on their pipe)."""

from __future__ import annotations

import threading

import pytest

from kvpool.client_lib import Monitor, RegionGroup
from kvpool.client_lib.errors import NoMemory
from kvpool.engine_adapters.gang import (GangDriver, GangOp, GangSession, GrantOp, Member,
                                         RankGone, ReleaseOp)

from daemon.helpers import PAGE

BUDGET = 16  # pages per device
LAYOUT = [(2, 8 * PAGE)]


class Posts:
    """A transport that posts each part to rank 1 (applied on a thread of its own, as a
    rank reads its pipe) and answers nothing: the daemon's reply to rank 0's own part is
    the answer for every rank."""

    def __init__(self, member: Member) -> None:
        self.member = member
        self.ops: list[GangOp] = []
        self.answers: list[str | None] = []
        self.threads: list[threading.Thread] = []
        self.gone = False

    def __call__(self, op: GangOp) -> list[str | None]:
        if self.gone:
            raise RankGone("rank 1 is gone")
        self.ops.append(op)
        th = threading.Thread(target=lambda: self.answers.append(self.member.apply(op)))
        th.start()
        self.threads.append(th)
        return []

    def join(self) -> None:
        for th in self.threads:
            th.join(60)
            assert not th.is_alive(), "rank 1's part did not return"


def test_a_rank_with_memory_posts_every_part_first_and_a_gone_rank_refuses_grants(
        start_daemon):
    d = start_daemon(budget=str(BUDGET * PAGE), extra=("--devices", "2"))
    r0 = d.connect("tp", device=0)
    token = r0.create_gang([0, 1], LAYOUT)
    r1 = d.connect("tp", device=1, gang=token, rank=1, layout=LAYOUT)
    with r0, r1:
        g1 = r1.region_group(*LAYOUT[0])
        posts = Posts(Member(g1))
        session = GangSession(r0, GangDriver(posts))
        g0 = RegionGroup(session, *LAYOUT[0])
        session.group_id = g0.id
        g0.grant([0, 1, 2])
        posts.join()
        assert g0.mapped == g1.mapped == {0, 1, 2}
        g0.release([2])
        posts.join()
        assert g0.mapped == g1.mapped == {0, 1}
        assert [type(op) for op in posts.ops] == [GrantOp, ReleaseOp]
        assert [op.units for op in posts.ops] == [(0, 1, 2), (2,)]
        assert posts.answers == [None, None]
        posts.gone = True
        with pytest.raises(NoMemory, match="gang grant not sent to every rank: rank 1"):
            g0.grant([3])
        assert g0.mapped == {0, 1} and len(posts.ops) == 2  # the daemon was not asked
        with Monitor(d.run_dir, device=0) as m:
            assert m.check() == []
            assert sum(t.mapped for t in m.ps().tenants if t.name == "tp") == 2 * 2 * PAGE
