"""The tenant keeper sleeps on the control socket: a Reclaim reaches an idle tenant when it
arrives (not at the end of a poll period), also when another thread's ``call()`` read it
off the socket, and ``close()`` ends the keeper's sleep. ``POLL_S`` (the keeper's longest
sleep) is set to an hour here, so only the wake-ups can pass these tests."""

from __future__ import annotations

import select
import threading

from kvpool import protocol as p
from kvpool.client_lib import Monitor, connect
from kvpool.client_lib import tenant as tenant_mod
from kvpool.client_lib.allocator import ElasticBlockAllocator

from .conftest import PAGE

HOUR = 3600.0
DEADLINE_S = 30.0  # generous: an outcome, not a latency


def idle_tenant(run_dir, monkeypatch):
    """A tenant holding 8 mapped pages whose Reclaims set the returned event."""
    monkeypatch.setattr(tenant_mod, "POLL_S", HOUR)
    t = connect("idle", run_dir=run_dir)
    got = threading.Event()

    def on_message(m: p.Reply) -> None:
        if isinstance(m, p.Reclaim):
            got.set()
        t.handle_message(m)

    t.on_message = on_message
    alloc = ElasticBlockAllocator(t.region_group(1, 32 * PAGE), PAGE, low=0, high=0)
    held = alloc.alloc(8)
    return t, alloc, held, got


def test_a_reclaim_wakes_the_idle_keeper(run_dir, monkeypatch):
    t, alloc, held, got = idle_tenant(run_dir, monkeypatch)
    with Monitor(run_dir) as mon:
        mon.set_limit("idle", 2 * PAGE)
    assert got.wait(DEADLINE_S), "the keeper slept through a Reclaim"
    alloc.free(held)
    alloc.close()
    closer = threading.Thread(target=t.close)
    closer.start()
    closer.join(DEADLINE_S)
    assert not closer.is_alive(), "close() did not wake the keeper"


def test_a_reclaim_read_by_another_call_wakes_the_waiter(run_dir, monkeypatch):
    t, alloc, held, got = idle_tenant(run_dir, monkeypatch)
    t._stop.set()  # no keeper: this test plays it, so the Reclaim waits on the socket
    t.conn.wake()
    assert t._keeper is not None
    t._keeper.join(DEADLINE_S)
    t.conn.wait_message(0)  # takes the wake above out of the pipe
    with Monitor(run_dir) as mon:
        mon.set_limit("idle", 2 * PAGE)
    with t.conn._lock:  # until the Reclaim is queued (this also uses up ZMQ_FD's signal)
        while not t.conn.sock.poll(100):
            pass
    t.ping()  # call() reads the Reclaim before its reply and queues it
    # ZMQ_FD may or may not be readable now (libzmq throttles command processing), so
    # look at the wake pipe itself: call() must have signalled it
    assert select.select([t.conn._wake_r], [], [], 0)[0], "queued without waking the keeper"
    t.conn.wait_message(HOUR)  # returns at once
    assert any(isinstance(m, p.Reclaim) for m in t.conn.poll())
    alloc.free(held)
    alloc.close()
    t.close()
