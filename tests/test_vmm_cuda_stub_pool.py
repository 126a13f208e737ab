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
