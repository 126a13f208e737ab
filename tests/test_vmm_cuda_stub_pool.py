"""The daemon's pool on the CUDA backend, against the fake driver: CALLING CONVENTIONS
ONLY (see ``test_vmm_cuda_stub.py``; the real check is ``test_vmm_cuda.py``, marked gpu).

The fresh-allocation rule is backend neutral: a page that changes tenant is a new
``cuMemCreate`` allocation, the released one is ``cuMemRelease``d, so a tenant that kept
an imported handle of a page it released sees none of the next tenant's data."""

from __future__ import annotations

from test_vmm_cuda_stub import run_stub, stub_dir  # noqa: F401  (fixture)


def test_a_page_changing_tenant_is_a_fresh_allocation(stub_dir):  # noqa: F811
    out = run_stub(
        stub_dir,
        """
        from kvpool.daemon.pool import Pool
        b = CudaBackend()
        pool = Pool(b, budget_pages=4, warm_min=0, warm_max=4)
        first = pool.take(2, tenant=1)
        # tenant 1 keeps an imported handle of each page and a mapping of them
        fds = [b.export(pool.pages[x]) for x in first]
        kept = [b.import_(fd) for fd in fds]
        for fd in fds:
            os.close(fd)
        r1 = b.reserve(4 * MiB)
        b.map_pages(r1, 0, kept)
        ctypes.memset(r1.base, 0x5A, 4 * MiB)
        pool.give_back(first, tenant=1)
        again = pool.take(1, tenant=1)  # its own released page comes back as it was
        assert again[0] in first
        pool.give_back(again, tenant=1)
        while pool.has_work():
            pool.maintain(1.0)
        assert pool.renewed == 2 and len(pool.warm) == 2 and not pool.dirty
        assert not set(first) & set(pool.pages), "a retired page is still in the pool"
        second = pool.take(2, tenant=2)
        r2 = b.reserve(4 * MiB)
        b.map_pages(r2, 0, [pool.pages[x] for x in second])
        assert peek(r2.base, 4 * MiB) == bytes(4 * MiB), "fresh pages are zeroed"
        ctypes.memset(r2.base, 0x42, 4 * MiB)
        assert peek(r1.base, 4 * MiB) == b"\\x5a" * (4 * MiB), "kept handle sees new data"
        assert pool.check() == []
        b.unmap(r1, 0, 2); b.unmap(r2, 0, 2)
        for page in kept:
            b.release(page)
        pool.give_back(second, tenant=2)
        pool.close()
        raises(InvalidArgument, b.release, kept[0])  # released exactly once each
        b.free_range(r1); b.free_range(r2)
        assert b.mem_info()[0] == 1 << 30, "every allocation was released"
        b.close()
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_a_weight_set_on_cuda_is_created_sealed_and_attached_read_only(stub_dir):  # noqa: F811
    # weight sets on CUDA (docs/ARCHITECTURE.md, "Weight sets"): the daemon's WeightSets
    # over a CudaBackend pool, and the client library's WeightSet driving the backend's
    # calls (a session that hands the requests straight to WeightSets and the pages'
    # exported fds back). The creator maps RW, writes, unmaps, seals (nothing to do to
    # the allocations), maps read-only; an attacher maps read-only and sees the bytes;
    # a store through its mapping faults (the stub mprotects PROT_READ); an admin's set
    # stays its uid's (no seal on CUDA).
    code = """
        import signal
        from kvpool import protocol as p
        from kvpool.client_lib.weights import WeightSet
        from kvpool.daemon.outcome import Sender
        from kvpool.daemon.pool import Pool
        from kvpool.daemon.tenants import Tenants
        from kvpool.daemon.weights import WeightSets
        b = CudaBackend()
        assert b.caps.read_only_maps and not b.caps.read_only_shares
        pool = Pool(b, budget_pages=8)
        tenants = Tenants()
        socks = []
        def tenant(name, uid, admin):
            a, c = socket.socketpair(); socks.extend((a, c))
            return tenants.add(token=name, pid=1, uid=uid, gid=uid, conn=a, name=name,
                               kind="engine", registered=True, admin=admin, max_pages=8)
        ws = WeightSets(pool, tenants, owed=lambda: 0)
        assert not ws.shared_across_uids
        sender = Sender(identity=b"x", envelope=[b"x"])
        class Session:
            def __init__(self, t):
                self.t, self.backend, self.page_size = t, b, b.page_size
            def call(self, req, expect):
                op = {p.WeightCreate: ws.create, p.WeightAttach: ws.attach,
                      p.WeightSeal: ws.seal, p.WeightDetach: ws.detach}[type(req)]
                out = op(self.t, sender, req)
                reply = getattr(out, "reply", out)
                fds = [b.export(pool.pages[x]) for x in getattr(out, "pfns_to_send", [])]
                assert isinstance(reply, expect), reply
                return reply, fds
        admin, admin2, other = tenant("a", 0, True), tenant("a2", 0, True), tenant("o", 1000, False)
        key = "d4" * 32
        n = 2 * MiB + 100
        sys.stderr.write("=== create\\n"); sys.stderr.flush()
        mine = WeightSet.create(Session(admin), key, n)
        sys.stderr.write("=== end\\n"); sys.stderr.flush()
        assert peek(mine.base, 2 * MiB * 2) == bytes(4 * MiB), "fresh weight pages read zeros"
        raises(ValueError, lambda: mine.view)  # device memory: tensor_view, not a memoryview
        ctypes.memset(mine.base, 0x42, n)
        sys.stderr.write("=== seal\\n"); sys.stderr.flush()
        mine.seal()
        sys.stderr.write("=== end\\n"); sys.stderr.flush()
        assert [s.scope for s in ws.sets.values()] == [0], "an admin's set is its uid's on CUDA"
        theirs = WeightSet.attach(Session(admin2), key)
        assert peek(theirs.base, n) == b"\\x42" * n
        try:
            WeightSet.attach(Session(other), key)
            raise AssertionError("another uid attached an unsealable set")
        except Exception as e:
            assert getattr(e, "code", None) == p.NOT_FOUND, e
        pid = os.fork()
        if pid == 0:  # the attacher writes through its read-only mapping
            ctypes.memset(theirs.base, 7, 1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, status
        assert peek(mine.base, 4) == b"\\x42" * 4
        assert ws.check(set()) == [] and pool.check() == []
        theirs.detach(); mine.detach()
        assert ws.pages == 2 and ws.cached_pages == 2  # cached, held by nobody
        assert ws.evict(2) == 2 and not ws.sets
        pool.close()
        assert b.mem_info()[0] == 1 << 30, "every allocation was released"
        b.close()
        print("ok")
    """
    import os
    import subprocess
    import sys
    import textwrap

    from test_vmm_cuda_stub import PRELUDE, REPO

    environ = dict(os.environ, LD_LIBRARY_PATH=str(stub_dir), KVPOOL_STUB_LOG="1")
    environ["PYTHONPATH"] = str(REPO)
    environ.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True, text=True, env=environ, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-4000:]
    create = proc.stderr.split("=== create")[1].split("=== end")[0]
    assert create.count("cuMemCreate(") == 2 and create.count("cuMemsetD8Async(") == 2  # zeroed
    seal = proc.stderr.split("=== seal")[1].split("=== end")[0]
    assert "cuMemUnmap(" in seal and "flags=1)" in seal and "flags=3)" not in seal  # RW off, RO on


def test_a_daemon_on_the_cuda_backend_shares_a_weight_set(stub_dir, tmp_path):  # noqa: F811
    # the same through a real daemon process started with --backend cuda on the stub:
    # weight_create is no longer refused there, the attacher (same uid) reads the
    # creator's bytes through its read-only mapping, and a store through it faults
    out = run_stub(
        stub_dir,
        f"""
        import signal
        from pathlib import Path
        from kvpool.client_lib import connect
        from kvpool.client_lib.weights import WeightSet
        from kvpool.demo.cluster import Cluster
        ps, key = 2 * MiB, "f6" * 32
        n = ps + 100
        with Cluster(Path({str(tmp_path)!r})) as cl:
            cl.daemon(8 * ps, ps, extra=("--log-level", "WARNING"), backend="cuda")
            with connect(name="creator", run_dir=cl.run_dir) as a, \\
                    connect(name="reader", run_dir=cl.run_dir) as b:
                ws = WeightSet.create(a, key, n)
                ctypes.memset(ws.base, 0x42, n)
                ws.seal()
                r = WeightSet.attach(b, key)
                assert r.state == "sealed" and peek(r.base, n) == b"\\x42" * n
                pid = os.fork()
                if pid == 0:
                    ctypes.memset(r.base, 7, 1)
                    os._exit(0)
                _, status = os.waitpid(pid, 0)
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
                r.detach(); ws.detach()
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_a_trainer_steps_allocator_on_the_cuda_backend(stub_dir, tmp_path):  # noqa: F811
    # a trainer tenant of a daemon started with --backend cuda on the stub: its step's
    # pages are granted and mapped through cuMemMap, and the pluggable allocator's two C
    # callbacks, called through their addresses as torch calls them, carve them (what
    # torch's MemPool would get: tests/client/test_cuda_pool_alloc.py, marked gpu)
    out = run_stub(
        stub_dir,
        f"""
        from pathlib import Path
        from kvpool.client_lib.cuda_pool_alloc import ALLOC_FN, FREE_FN, PoolAllocator
        from kvpool.client_lib.trainer import connect_trainer
        from kvpool.demo.cluster import Cluster
        ps = 2 * MiB
        with Cluster(Path({str(tmp_path)!r})) as cl:
            cl.daemon(8 * ps, ps, extra=("--log-level", "WARNING"), backend="cuda")
            with connect_trainer("tr", run_dir=cl.run_dir) as tr:
                with tr.step(3 * ps) as step:
                    pa = PoolAllocator(step.arena, 0, step.nbytes)
                    a, f = pa.fn_addresses
                    alloc, free = ALLOC_FN(a), FREE_FN(f)
                    x = alloc(ps + 1, 0, None)
                    assert x == step.arena.group.bases[0]
                    ctypes.memset(x, 0x42, 2 * ps)
                    assert peek(x, 2 * ps) == b"\\x42" * (2 * ps)
                    assert alloc(2 * ps, 0, None) is None
                    free(x, ps + 1, 0, None)
                    pa.check_released()
                    assert len(step.arena.group.mapped) == 3
                assert not tr.scratch.group.mapped
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_a_mutable_weight_set_on_the_cuda_backend(stub_dir, tmp_path):  # noqa: F811
    # a mutable weight set (docs/ARCHITECTURE.md, "Mutable weight sets") through a daemon
    # started with --backend cuda on the stub: the writer maps both buffers read-write,
    # the seal does nothing to the allocations, the reader maps the current version
    # cuMemSetAccess read-only (a store through it faults) and follows a published
    # version by a remap at the same address; the fence refuses a write over its buffer
    out = run_stub(
        stub_dir,
        f"""
        import signal
        from pathlib import Path
        from kvpool import protocol as p
        from kvpool.client_lib import KvpoolError, connect
        from kvpool.client_lib.mutable_weights import MutableReader, MutableWriter
        from kvpool.demo.cluster import Cluster
        ps, key = 2 * MiB, "a7" * 32
        n = ps + 100
        with Cluster(Path({str(tmp_path)!r})) as cl:
            cl.daemon(8 * ps, ps, extra=("--log-level", "WARNING"), backend="cuda")
            with connect_trainer_session(cl) as a, connect(name="reader",
                                                           run_dir=cl.run_dir) as b:
                w = MutableWriter.create(a, key, n)
                ctypes.memset(w.base(0), 0x11, n); ctypes.memset(w.base(1), 0x11, n)
                assert w.seal() == 1
                r = MutableReader.attach(b, key)
                base = r.range.base
                assert peek(base, n) == b"\\x11" * n
                assert w.begin_write() == 1
                ctypes.memset(w.base(1), 0x22, n)
                assert peek(base, n) == b"\\x11" * n
                assert w.publish() == 2
                assert r.follow(2) and r.range.base == base and peek(base, n) == b"\\x22" * n
                assert w.begin_write() == 0
                ctypes.memset(w.base(0), 0x33, n)
                assert w.publish() == 3
                try:
                    w.begin_write()
                    raise AssertionError("a write over the buffer a reader reads")
                except KvpoolError as e:
                    assert e.code == p.BUSY, e
                pid = os.fork()
                if pid == 0:  # the reader writes through its read-only mapping
                    ctypes.memset(base, 7, 1)
                    os._exit(0)
                _, status = os.waitpid(pid, 0)
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
                r.detach(); w.close()
        print("ok")
        """.replace("connect_trainer_session(cl)",
                    'connect(name="writer", run_dir=cl.run_dir, kind="trainer")'),
    )
    assert out.strip() == "ok"
