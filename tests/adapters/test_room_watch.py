"""RoomWatch: a scrape never waits on the daemon; a failed ask keeps the last answer."""

from __future__ import annotations

import threading

from kvpool import protocol as p
from kvpool.engine_adapters.room_watch import RoomWatch


def test_a_scrape_does_not_wait_behind_a_stuck_daemon_call() -> None:
    release, stuck = threading.Event(), threading.Event()
    calls = []

    def ask() -> p.RoomReply:
        calls.append(1)
        if len(calls) > 1:
            stuck.set()
            release.wait(60)  # the connection is held (a grant waiting for reclaim)
        return p.RoomReply(headroom=len(calls))

    w = RoomWatch(ask, max_age_s=0.0, first_wait_s=30.0)
    try:
        assert w.latest().headroom == 1  # the first answer is waited for
        assert w.latest().headroom == 1
        assert stuck.wait(30)  # the second ask is stuck: each scrape answers with the first
        for _ in range(5):
            assert w.latest().headroom == 1
        assert len(calls) == 2  # one call in flight at most
    finally:
        release.set()
        w.close()


def test_a_failed_ask_keeps_the_last_answer_and_is_counted() -> None:
    answers: list[object] = [p.RoomReply(headroom=7), RuntimeError("daemon gone")]
    done = threading.Event()

    def ask() -> p.RoomReply:
        a = answers.pop(0) if answers else RuntimeError("still gone")
        if not answers:
            done.set()
        if isinstance(a, Exception):
            raise a
        return a

    w = RoomWatch(ask, max_age_s=0.0, first_wait_s=30.0)
    try:
        assert w.latest().headroom == 7
        for _ in range(3000):  # each scrape asks again (max_age 0) until one has failed
            if w.failures:
                break
            assert w.latest().headroom == 7
            done.wait(0.01)
        assert w.failures >= 1
        assert w.latest().headroom == 7
    finally:
        w.close()
