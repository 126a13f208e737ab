"""Weight sets (docs/ARCHITECTURE.md, "Weight sets"), against a real daemon and real
tenant processes: one copy in the pool for every holder, read-only for attachers,
never attachable before it is sealed, dropped when its creator dies loading, refused
whole when it can never fit, reclaimed first when nobody holds it, and gone from
every count when all its holders are killed."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool import protocol as p
from kvpool.client_lib import KvpoolError, NoMemory, OverLimit
from kvpool.client_lib.weights import WeightSet

from kvpool.demo.cluster import free_port

from .helpers import PAGE, REPO, read_event, wait_for
from .test_attacks_round3 import group_daemon, needs_root, nobody_proc
from observability.helpers import scrape, value

WORKER = Path(__file__).with_name("weight_worker.py")
KEY_A = "a1" * 32
KEY_B = "b2" * 32
PATTERN = bytes(i % 251 for i in range(3 * PAGE + 100))


def spawn(d, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), *args, "--run-dir", str(d.run_dir)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    d.workers.append(proc)
    return proc


def weights_bytes(d) -> int:
    with d.monitor() as m:
        pool = m.ps().pool
    assert pool is not None
    return pool.weights


def loaded(t, key: str = KEY_A, data: bytes = PATTERN) -> WeightSet:
    ws = WeightSet.create(t, key, len(data))
    ws.view[:] = data
    ws.seal()
    return ws


def test_two_tenants_share_one_read_only_copy(daemon):
    with daemon.connect("creator") as a, daemon.connect("reader") as b, \
            daemon.connect("raw") as c:
        ws = loaded(a)
        pages = -(-len(PATTERN) // PAGE)
        assert bytes(ws.view) == PATTERN and ws.state == "sealed"
        rd = WeightSet.attach(b, KEY_A)
        assert bytes(rd.view) == PATTERN  # the same bytes, no load
        assert rd.array("uint8", (4,), offset=PAGE).tolist() == list(PATTERN[PAGE:PAGE + 4])
        with daemon.monitor() as m:
            ps = m.ps()
        assert ps.pool is not None and ps.pool.weights == pages * PAGE  # one copy
        held = {x.name: x for x in ps.tenants}
        assert held["creator"].weights == held["reader"].weights == pages * PAGE
        assert held["reader"].weight_sets == [KEY_A[:12]] and held["raw"].weights == 0
        assert held["reader"].mapped == 0  # weights are not KV
        # a writable attach is refused; the descriptors of a read-only one refuse writes
        with pytest.raises(KvpoolError, match="read-only") as e:
            c.call(p.WeightAttach(key=KEY_A, write=True), p.WeightGranted)
        assert e.value.code == p.UNAUTHORIZED
        reply, fds = c.call(p.WeightAttach(key=KEY_A), p.WeightGranted)
        try:
            assert reply.nfds == len(fds) == pages
            with pytest.raises(PermissionError):
                mmap.mmap(fds[0], PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fds[0], b"x", 0)
            assert os.pread(fds[0], 4, 0) == PATTERN[:4]
        finally:
            for fd in fds:
                os.close(fd)
        c.call(p.WeightDetach(key=KEY_A), p.Done)
        assert daemon.check() == []
        rd.detach()
        ws.detach()
        assert daemon.check() == []
    # nobody holds it now: it stays cached (counted once), attachable by its key
    assert weights_bytes(daemon) == pages * PAGE
    with daemon.connect("again") as t:
        assert bytes(WeightSet.attach(t, KEY_A).view) == PATTERN


def test_write_through_the_read_only_mapping_faults(daemon):
    with daemon.connect("creator") as a:
        loaded(a)
        w = spawn(daemon, "write", KEY_A, "--name", "writer")
        read_event(w, "ready")
        assert w.wait(timeout=30) in (-signal.SIGSEGV, -signal.SIGBUS)
        wait_for(lambda: daemon.check() == [], what="the writer's session dropped cleanly")


def test_attach_of_unknown_forged_or_unsealed_key_is_refused(daemon):
    with daemon.connect("creator") as a, daemon.connect("other") as b:
        with pytest.raises(KvpoolError) as e:
            WeightSet.attach(b, KEY_B)  # nobody created it
        assert e.value.code == p.NOT_FOUND
        for forged in ("zz" * 32, KEY_A[:63], KEY_A + "0", KEY_A.upper(), ""):
            with pytest.raises(KvpoolError) as e:
                b.call(p.WeightAttach(key=forged), p.WeightGranted)
            assert e.value.code == p.BAD_REQUEST, forged
        ws = WeightSet.create(a, KEY_A, PAGE)  # loading: invisible to others
        with pytest.raises(KvpoolError) as e:
            WeightSet.attach(b, KEY_A)
        assert e.value.code == p.NOT_FOUND
        with pytest.raises(KvpoolError) as e:  # nor can anyone but its creator seal it
            b.call(p.WeightSeal(key=KEY_A), p.Done)
        assert e.value.code == p.NOT_FOUND
        with pytest.raises(KvpoolError) as e:  # the key is taken while it loads
            WeightSet.create(b, KEY_A, PAGE)
        assert e.value.code == p.BUSY
        with pytest.raises(KvpoolError, match="mapped writable") as e:
            a.call(p.WeightSeal(key=KEY_A), p.Done)  # the library unmaps first; raw: not
        assert e.value.code == p.BUSY
        ws.detach()  # detached unsealed: dropped, never attachable
        with pytest.raises(KvpoolError) as e:
            WeightSet.attach(b, KEY_A)
        assert e.value.code == p.NOT_FOUND
        assert weights_bytes(daemon) == 0 and daemon.check() == []


def test_creator_killed_mid_load_returns_the_pages(daemon):
    w = spawn(daemon, "create", KEY_A, str(8 * PAGE), "--name", "loader")
    assert read_event(w, "ready")["state"] == "loading"
    assert weights_bytes(daemon) == 8 * PAGE
    w.kill()
    w.wait(timeout=30)
    wait_for(lambda: weights_bytes(daemon) == 0, what="the half-loaded set dropped")
    with daemon.connect("other") as b:
        with pytest.raises(KvpoolError) as e:
            WeightSet.attach(b, KEY_A)
        assert e.value.code == p.NOT_FOUND
        assert daemon.check() == []
        loaded(b)  # the key is free again: a new creator loads it


def test_a_set_past_the_budget_or_the_max_is_refused_once(daemon):
    budget = 8 << 20
    with daemon.connect("big") as a, daemon.connect("small", max=4 * PAGE) as s:
        with pytest.raises(OverLimit, match="larger than the budget"):
            WeightSet.create(a, KEY_A, budget + 1)
        with pytest.raises(OverLimit, match="limit"):
            WeightSet.create(s, KEY_A, 5 * PAGE)
        loaded(a, KEY_B, bytes(6 * PAGE))
        with pytest.raises(OverLimit, match="limit"):  # attaching counts against max too
            WeightSet.attach(s, KEY_B)
        assert weights_bytes(daemon) == 6 * PAGE and daemon.check() == []


def test_unheld_set_is_reclaimed_first_and_a_held_one_never(daemon):
    budget_pages = (8 << 20) // PAGE  # 128
    with daemon.connect("holder") as h, daemon.connect("kv") as kv:
        held = loaded(h, KEY_A, bytes(40 * PAGE))
        cached = loaded(h, KEY_B, bytes(60 * PAGE))
        cached.detach()  # nobody holds it: cached
        assert weights_bytes(daemon) == 100 * PAGE
        g = kv.region_group(1, budget_pages * PAGE)
        g.grant(list(range(80)))  # fits only once the cached set is gone
        assert weights_bytes(daemon) == 40 * PAGE
        with pytest.raises(KvpoolError) as e:
            WeightSet.attach(kv, KEY_B)
        assert e.value.code == p.NOT_FOUND
        assert bytes(held.view[:8]) == bytes(8)
        with pytest.raises(NoMemory):  # the held set is not reclaimed for it
            g.grant(list(range(80, 80 + 9)))
        assert weights_bytes(daemon) == 40 * PAGE and daemon.check() == []


def test_a_create_that_does_not_fit_waits_for_reclaim_like_a_grant(daemon):
    """A model waking (or starting) while others' KV fills the pool: its weight set's
    create waits while the daemon asks the tenant above its fair share to shrink, then
    is made (it was refused NO_MEMORY at once, and nobody was asked)."""
    budget_pages = (8 << 20) // PAGE  # 128
    with daemon.connect("kv") as kv, daemon.connect("waker") as w:
        g = kv.region_group(1, budget_pages * PAGE)
        units = list(range(120))
        g.grant(units)
        freed: list[int] = []

        def shrink(nbytes: int, urgent: bool) -> None:
            give = units[-(-nbytes // PAGE):]
            del units[-len(give):]
            g.release(give)
            freed.extend(give)

        kv.set_shrink_callback(shrink)
        ws = loaded(w, KEY_A, bytes(40 * PAGE))  # 8 pages free; its fair share is 64
        assert len(freed) >= 32 and bytes(ws.view[:8]) == bytes(8)
        assert weights_bytes(daemon) == 40 * PAGE and daemon.check() == []
        kv.set_shrink_callback(None)
        with pytest.raises(NoMemory):  # past its fair share: refused, nobody shrinks
            WeightSet.create(w, KEY_B, 60 * PAGE)
        assert weights_bytes(daemon) == 40 * PAGE and daemon.check() == []


def test_kill_all_holders_leaves_check_clean(start_daemon):
    port = free_port()
    daemon = start_daemon(extra=("--metrics-address", f"127.0.0.1:{port}"))
    c = spawn(daemon, "create", KEY_A, str(5 * PAGE), "--seal", "--name", "c")
    assert read_event(c, "ready")["state"] == "sealed"
    r = spawn(daemon, "attach", KEY_A, "--name", "r")
    assert read_event(r, "ready")["first"] == 0
    with daemon.monitor() as m:
        assert sum(x.weights for x in m.ps().tenants) == 10 * PAGE
    # ps, ps --json and Prometheus show who holds what, and the one copy in the pool
    out = daemon.cli("ps").stdout
    assert "WEIGHTS" in out and KEY_A[:12] in out and "weight sets: 1" in out
    js = daemon.cli_json("ps")
    assert js["pool"]["weights"] == 5 * PAGE
    assert {t["name"]: t["weight_sets"] for t in js["tenants"]} == {"c": [KEY_A[:12]],
                                                                    "r": [KEY_A[:12]]}

    def scraped():
        got = scrape(port)
        return got if value(got, "kvpool_tenant_weights_bytes", tenant="r") else None

    metrics = wait_for(scraped, what="the tenants' weights in /metrics")
    assert value(metrics, "kvpool_pool_weights_bytes") == 5 * PAGE
    assert value(metrics, "kvpool_tenant_weights_bytes", tenant="c") == 5 * PAGE
    for w in (c, r):
        w.send_signal(signal.SIGKILL)
        w.wait(timeout=30)

    def holders_gone():
        with daemon.monitor() as m:
            return not any(x.weights for x in m.ps().tenants)

    wait_for(holders_gone, what="the killed holders dropped")
    assert daemon.check() == []
    assert weights_bytes(daemon) == 5 * PAGE  # cached for the next start


NOBODY_LOADS = """
    from kvpool.client_lib import connect, KvpoolError
    from kvpool.client_lib.weights import WeightSet
    t = connect(name="nob", run_dir=run_dir)
    admins = WeightSet.attach(t, sys.argv[1])  # an admin's set: anyone may attach it
    mine = WeightSet.create(t, sys.argv[2], 65536)
    mine.view[:4] = b"evil"
    mine.seal()
    print(json.dumps({"admins": bytes(admins.view[:4]).hex()}), flush=True)
    sys.stdin.readline()
"""


@needs_root
def test_ps_says_which_sets_are_held_and_which_cached(daemon):
    """Issue 34 item 7: ``ps`` said "(0 B cached, held by nobody)" of a held set."""
    def line() -> str:
        out = daemon.cli("ps").stdout
        return next(x for x in out.splitlines() if x.startswith("weight sets:"))

    with daemon.connect("holder") as t:
        a = loaded(t, KEY_A)  # 4 pages, held
        assert line().startswith("weight sets: 1, 256 KiB in the pool, all held by "
                                 "tenants"), line()
        assert "nobody" not in line()
        loaded(t, KEY_B).detach()  # cached
        assert line().startswith("weight sets: 2, 512 KiB in the pool: 256 KiB held by "
                                 "tenants, 256 KiB cached (held by nobody; reclaimed "
                                 "first)"), line()
        a.detach()
        assert line().startswith("weight sets: 2, 512 KiB in the pool, all cached (held "
                                 "by nobody; reclaimed first)"), line()


def test_another_uids_set_is_invisible(start_daemon, tmp_path):
    """A content key is computed from public bytes: uid 65534 loads "evil" under a key;
    the admin's tenants never see that set (NOT_FOUND, as for an unknown key), while
    uid 65534 may attach a set an admin loaded."""
    d = group_daemon(start_daemon, tmp_path)
    with d.connect("root") as a:
        loaded(a, KEY_A, PATTERN)
        proc = nobody_proc(d, NOBODY_LOADS.replace("sys.argv[1]", repr(KEY_A))
                           .replace("sys.argv[2]", repr(KEY_B)))
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        assert json.loads(line)["admins"] == PATTERN[:4].hex()
        with pytest.raises(KvpoolError) as e:
            WeightSet.attach(a, KEY_B)
        assert e.value.code == p.NOT_FOUND
        ours = loaded(a, KEY_B, b"good")  # its own copy, under the same key
        assert bytes(ours.view) == b"good"
        assert weights_bytes(d) == (-(-len(PATTERN) // PAGE) + 2) * PAGE
        assert d.check() == []
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_refused_seal_drops_the_set_and_a_raw_retry_seals(daemon):
    """A writable mapping kept elsewhere makes the seal fail for that page: the library
    drops the set (some pages may be sealed, it can no longer be loaded); a raw client
    that retries once that mapping is gone gets it sealed (sealing is idempotent)."""
    with daemon.connect("creator") as a, daemon.connect("reader") as b:
        ws = WeightSet.create(a, KEY_A, 2 * PAGE)
        fd = os.dup(ws.pages[1].handle)  # page 1 mapped writable besides the library's
        extra = mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(KvpoolError, match="mapped writable") as e:
            ws.seal()
        assert e.value.code == p.BUSY and ws.range is None
        assert weights_bytes(daemon) == 0 and daemon.check() == []
        extra.close()
        os.close(fd)
        reply, fds = a.call(p.WeightCreate(key=KEY_A, nbytes=2 * PAGE), p.WeightGranted)
        extra = mmap.mmap(fds[1], PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        extra[:4] = b"more"
        with pytest.raises(KvpoolError, match="mapped writable"):
            a.call(p.WeightSeal(key=KEY_A), p.Done)  # page 0 sealed, page 1 refused
        with pytest.raises(KvpoolError) as e:
            WeightSet.attach(b, KEY_A)
        assert e.value.code == p.NOT_FOUND  # still loading
        extra.close()
        a.call(p.WeightSeal(key=KEY_A), p.Done)
        for fd in fds:
            os.close(fd)
        assert bytes(WeightSet.attach(b, KEY_A).view[PAGE:PAGE + 4]) == b"more"
        assert daemon.check() == []


def test_open_attaches_what_another_tenant_is_loading_once_sealed(daemon):
    """Two starts of one checkpoint: the second ``open`` waits while the first loads
    and attaches the sealed set (one copy); it loads nothing itself."""
    import threading

    with daemon.connect("first") as a, daemon.connect("second") as b:
        ws = WeightSet.create(a, KEY_A, len(PATTERN))
        errors = daemon.stats().errors
        got: list = []
        second = threading.Thread(target=lambda: got.append(
            WeightSet.open(b, KEY_A, len(PATTERN), load=lambda buf: got.append("loaded"))))
        second.start()
        # its attach (NOT_FOUND: loading) and create (BUSY) were refused: it waits now
        wait_for(lambda: daemon.stats().errors >= errors + 2, what="the second open waits")
        assert second.is_alive()
        ws.view[:] = PATTERN
        ws.seal()
        second.join(timeout=60)
        assert not second.is_alive() and len(got) == 1, got
        assert got[0].state == "sealed" and bytes(got[0].view) == PATTERN
        assert weights_bytes(daemon) == -(-len(PATTERN) // PAGE) * PAGE
        assert daemon.check() == []
