"""The demo's p99 TTFT tail breakdown: reclaim wait is the part of a tail request's wait
for its first token during which its model's tenant had a request waiting for reclaim."""

from __future__ import annotations

from kvpool.demo.driver import Outcome
from kvpool.demo.tail import breakdown, overlap, waits_by_tenant

T0 = 1000.0


def ev(kind, tenant, t, waited=None):
    return {"kind": kind, "tenant": tenant, "time": T0 + t,
            "detail": {} if waited is None else {"waited_s": waited}}


def test_overlap_counts_the_union_inside_the_window():
    assert overlap([(0, 2), (1, 3), (5, 6)], 1, 5.5) == 2.5
    assert overlap([], 0, 1) == 0
    assert overlap([(2, 3)], 0, 1) == 0


def test_tail_split_into_reclaim_wait_and_compute_queue():
    outs = [Outcome(i, "a", arrival=float(i), prompt_len=4, max_tokens=4, ttft=0.1)
            for i in range(99)]
    outs.append(Outcome(99, "a", arrival=10.0, prompt_len=4, max_tokens=4, ttft=1.0))
    outs.append(Outcome(100, "b", arrival=0.0, prompt_len=4, max_tokens=4, error="x"))
    events = [ev("grant", "a", 10.6, waited=0.4),  # waited 10.2 .. 10.6: inside the window
              ev("grant", "b", 10.5, waited=0.5),  # another tenant's wait: not a's
              ev("grant", "a", 10.1),  # served at once
              ev("deny", "a", 12.0, waited=1.5)]  # 10.5 .. 12.0: 10.6 .. 11.0 counts more
    assert set(waits_by_tenant(events)) == {"a", "b"}
    b = breakdown(outs, events, T0, q=99)
    assert b["requests"] == 1 and abs(b["ttft_s"] - 1.0) < 1e-9
    assert abs(b["reclaim_wait_s"] - 0.8) < 1e-9  # 10.2 .. 11.0
    assert abs(b["compute_queue_s"] - 0.2) < 1e-9
    assert breakdown([], events, T0) == {}
