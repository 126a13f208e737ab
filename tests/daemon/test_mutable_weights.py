"""Mutable weight sets (docs/ARCHITECTURE.md, "Mutable weight sets"), against a real
daemon and real processes: one writer writes the back buffer while readers read the
published version at the same addresses, a publish moves no byte, the daemon refuses a
second writer, a reader's write, a write over a buffer a reader still reads, and a
writer killed mid-write leaves the readers on the last complete version with nothing
leaked."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool import protocol as p
from kvpool.client_lib import KvpoolError
from kvpool.client_lib.mutable_weights import MutableReader, MutableWriter
from kvpool.client_lib.weights import WeightSet

from .helpers import PAGE, REPO, read_event, wait_for

WORKER = Path(__file__).with_name("mutable_worker.py")
KEY = "c3" * 32
SEALED_KEY = "d4" * 32
NBYTES = 3 * PAGE + 100


def first(addr: int, n: int = 1) -> bytes:
    return ctypes.string_at(addr, n)


def pool_weights(d) -> tuple[int, int]:
    with d.monitor() as m:
        pool = m.ps().pool
    assert pool is not None
    return pool.weights, pool.weight_sets


def writer(t) -> MutableWriter:
    w = MutableWriter.create(t, KEY, NBYTES)
    for b in (0, 1):
        ctypes.memset(w.base(b), 1, NBYTES)
    assert w.seal() == 1
    return w


def test_readers_follow_published_versions_in_place(daemon):
    with daemon.connect("trainer", kind="trainer") as a, daemon.connect("engine") as e:
        w = writer(a)
        r = MutableReader.attach(e, KEY)
        base = r.range.base
        assert first(base) == b"\x01" and r.version == 1
        pages = -(-NBYTES // PAGE)
        assert pool_weights(daemon) == (2 * pages * PAGE, 1)  # two buffers, counted once
        b = w.begin_write()
        assert b == 1
        ctypes.memset(w.base(b), 7, NBYTES)  # the back buffer: the reader never sees it
        assert first(base, NBYTES) == b"\x01" * NBYTES
        assert w.publish() == 2
        assert first(base) == b"\x01"  # until it follows
        assert r.follow(2) and r.range.base == base  # same addresses, new bytes
        assert first(base, NBYTES) == b"\x07" * NBYTES
        assert w.begin_write() == 0  # the reader left buffer 0
        ctypes.memset(w.base(0), 9, NBYTES)
        assert w.publish() == 3
        with pytest.raises(KvpoolError, match="still read") as exc:
            w.begin_write()  # buffer 1 is version 2's, and the reader still reads it
        assert exc.value.code == p.BUSY
        assert first(base) == b"\x07"
        assert r.follow(3) and first(base, NBYTES) == b"\x09" * NBYTES
        assert w.begin_write() == 1
        assert daemon.check() == []
        r.detach()
        w.close()
    wait_for(lambda: pool_weights(daemon) == (0, 0), what="the mutable set dropped")
    assert daemon.check() == []


def test_second_writer_reader_writes_and_bad_versions_are_refused(daemon):
    with daemon.connect("trainer", kind="trainer") as a, daemon.connect("engine") as e, \
            daemon.connect("other", kind="trainer") as o:
        w = writer(a)
        with pytest.raises(KvpoolError) as exc:  # a second writer: the key is taken
            MutableWriter.create(o, KEY, NBYTES)
        assert exc.value.code == p.BUSY
        r = MutableReader.attach(e, KEY)
        for req in (p.WeightWrite(key=KEY), p.WeightPublish(key=KEY)):
            with pytest.raises(KvpoolError, match="only the writer") as exc:
                e.call(req, p.WeightVersion)  # a reader asks to write
            assert exc.value.code == p.UNAUTHORIZED
        with pytest.raises(KvpoolError) as exc:  # a set it does not hold
            o.call(p.WeightWrite(key=KEY), p.WeightVersion)
        assert exc.value.code == p.NOT_FOUND
        with pytest.raises(KvpoolError) as exc:
            o.call(p.WeightAttach(key=KEY, write=True), p.WeightGranted)
        assert exc.value.code == p.UNAUTHORIZED
        with pytest.raises(KvpoolError, match="nothing is being written") as exc:
            w.publish()  # a publish without a write
        assert exc.value.code == p.BAD_REQUEST
        for v in (2, 7):  # not the current version
            with pytest.raises(KvpoolError, match="not the current") as exc:
                e.call(p.WeightUse(key=KEY, version=v), p.WeightVersion)
            assert exc.value.code == p.BAD_REQUEST
        with pytest.raises(KvpoolError, match="only a reader") as exc:
            a.call(p.WeightUse(key=KEY, version=1), p.WeightVersion)
        assert exc.value.code == p.BAD_REQUEST
        ws = WeightSet.create(o, SEALED_KEY, PAGE)
        ws.view[:4] = b"abcd"
        ws.seal()
        with pytest.raises(KvpoolError, match="not mutable") as exc:
            o.call(p.WeightWrite(key=SEALED_KEY), p.WeightVersion)
        assert exc.value.code == p.BAD_REQUEST
        # a reader's descriptors map read-only only: no writable mapping, no write(2)
        reply, fds = o.call(p.WeightAttach(key=KEY), p.WeightGranted)
        try:
            assert reply.state == "mutable" and reply.version == 1 and len(fds) == reply.nfds
            for fd in (fds[0], fds[-1]):
                with pytest.raises(PermissionError):
                    mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                with pytest.raises(PermissionError):
                    os.pwrite(fd, b"x", 0)
                assert os.pread(fd, 1, 0) == b"\x01"
            again = os.open(f"/proc/self/fd/{fds[0]}", os.O_RDWR)  # a new description
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(again, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(again)
        finally:
            for fd in fds:
                os.close(fd)
        o.call(p.WeightDetach(key=KEY), p.Done)
        assert daemon.check() == []
        r.detach()
        w.close()
        ws.detach()
    assert daemon.check() == []


def test_writer_killed_mid_publish_leaves_the_last_complete_version(daemon):
    cmd = [sys.executable, str(WORKER), KEY, str(NBYTES), "--run-dir", str(daemon.run_dir)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    daemon.workers.append(proc)
    assert read_event(proc, "ready")["version"] == 1
    with daemon.connect("engine") as e:
        r = MutableReader.attach(e, KEY)
        base = r.range.base
        assert proc.stdin is not None
        proc.stdin.write("write 5\n")
        proc.stdin.flush()
        assert read_event(proc, "writing")["buffer"] == 1  # half of the back buffer written
        assert first(base, NBYTES) == b"\x01" * NBYTES  # the reader sees version 1 only
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(lambda: daemon.check() == [], what="the writer's session ended cleanly")
        assert first(base, NBYTES) == b"\x01" * NBYTES  # still the last complete version
        with pytest.raises(KvpoolError, match="not the current"):  # never published
            r.follow(2)
        assert first(base, NBYTES) == b"\x01" * NBYTES and r.version == 1
        with daemon.monitor() as m:
            held = {t.name: t.weights for t in m.ps().tenants}
        assert held == {"engine": 2 * (-(-NBYTES // PAGE)) * PAGE}
        r.detach()
    wait_for(lambda: pool_weights(daemon) == (0, 0), what="the orphaned set dropped")
    with daemon.monitor() as m:
        pool = m.ps().pool
    assert pool is not None and pool.granted == 0
    assert daemon.check() == []
