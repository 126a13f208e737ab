"""The host backend on hugetlb memory (``huge_pages``): real hugetlb memfds, real child
processes. Pages are sealed and their huge pages reserved when created, map at aligned
slots in a
process that does not know the mode, zero really zeroes, prefault allocates a page's
huge pages without taking more (the pool prefaults its warm pages), retirement still sees who
holds a page, and an exhausted huge page pool refuses ``create_page`` without any
process taking SIGBUS.

Needs free huge pages: the ``huge`` fixture uses those free, or (as root) raises
``vm.nr_hugepages`` for the test and restores it, or skips saying why.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import subprocess
import sys
import textwrap

import pytest

from kvpool.vmm import InvalidArgument, OutOfMemory, hugetlb
from kvpool.vmm.host import REQUIRED_SEALS, HostBackend
from kvpool.vmm.hugetlb import free_pages as free_huge  # neither in use nor reserved

from .fixtures import borrowed_huge_pages, host_backend

HUGE = hugetlb.huge_page_size() or 2 << 20
PAGE = 2 * HUGE  # two huge pages per kvpool page: multi-huge-page pages work too
NEED = 8  # kvpool pages the tests below use at most


huge = borrowed_huge_pages(NEED * PAGE)  # NEED pages' worth free (see the module doc)
backend = host_backend(PAGE, huge_pages=True, after=("huge",))


def child(code: str, *fds: int) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python with ``fds`` inherited (as the same numbers)."""
    for fd in fds:
        os.set_inheritable(fd, True)
    prelude = ("import ctypes, os, sys\nfrom kvpool.vmm.host import HostBackend\n"
               f"PAGE = {PAGE}\n")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          pass_fds=fds, capture_output=True, text=True, timeout=60)


def test_pages_are_sealed_reserved_hugetlb_memfds(backend):
    before = free_huge()
    page = backend.create_page()
    rng = backend.reserve(PAGE)
    try:
        assert free_huge() == before - PAGE // HUGE  # reserved now, not at first touch
        backend.map(rng, 0, page)
        ctypes.memset(rng.base, 1, PAGE)
        assert free_huge() == before - PAGE // HUGE  # the faults consumed the reservation
        assert backend.resident_bytes(page) == PAGE
        backend.unmap(rng, 0)
        assert fcntl.fcntl(page.handle, fcntl.F_GET_SEALS) & REQUIRED_SEALS == REQUIRED_SEALS
        with pytest.raises(OSError):
            os.ftruncate(page.handle, PAGE // 2)
        assert os.fstatvfs(page.handle).f_bsize == HUGE  # hugetlbfs, not shmem
        backend.release(backend.import_(page.handle))  # what it makes, it accepts
    finally:
        backend.free_range(rng)
        backend.release(page)
    assert free_huge() == before  # the last reference gone: back to the pool


@pytest.mark.parametrize("sealing,seals", [(False, 0), (True, 0),
                                           (True, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)])
def test_import_refuses_an_unsealed_hugetlb_memfd(backend, sealing, seals):
    fd = hugetlb.create_fd("kvpool-page", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealing
                                                             else 0))
    try:
        os.ftruncate(fd, PAGE)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        with pytest.raises(InvalidArgument, match="seal"):
            backend.import_(fd)
    finally:
        os.close(fd)


def test_a_page_size_that_is_not_a_multiple_of_the_huge_page_is_refused(huge):
    with pytest.raises(InvalidArgument, match="not a multiple of the huge page size"):
        HostBackend(page_size=HUGE // 2, huge_pages=True)


def test_another_process_maps_writes_and_the_first_reads(backend):
    """A child whose backend does not know about huge pages (as a client's) imports the
    page, maps it at slot 1 of its own range (aligned), writes; we read its bytes."""
    page = backend.create_page()
    fd = backend.export(page)
    try:
        out = child(f"""
            b = HostBackend(page_size=PAGE)
            rng = b.reserve(3 * PAGE)
            print(rng.base % PAGE, flush=True)
            p = b.import_({fd})
            b.map(rng, PAGE, p, populate=True)
            ctypes.memset(rng.base + PAGE, 0x3C, PAGE)
            ctypes.memmove(rng.base + PAGE + 100, b"from the child", 14)
            b.unmap(rng, PAGE)
            b.release(p)
            b.free_range(rng)
        """, fd)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["0"]  # the child's reservation is page-aligned
        rng = backend.reserve(2 * PAGE)
        backend.map(rng, PAGE, page)
        data = ctypes.string_at(rng.base + PAGE, PAGE)
        assert data[100:114] == b"from the child"
        assert data.count(0x3C) == PAGE - 14
        backend.unmap(rng, PAGE)
        backend.free_range(rng)
    finally:
        os.close(fd)
        backend.release(page)


def test_zero_really_zeroes_and_keeps_the_page_reserved(backend):
    page = backend.create_page()
    rng = backend.reserve(PAGE)
    try:
        backend.map(rng, 0, page)
        ctypes.memset(rng.base, 0xA5, PAGE)
        backend.unmap(rng, 0)
        free = free_huge()
        backend.zero(page)
        assert backend.resident_bytes(page) == 0  # the hole gave the memory back
        assert free_huge() == free  # and the page's huge pages are reserved again
        backend.map(rng, 0, page)
        assert ctypes.string_at(rng.base, PAGE) == bytes(PAGE)
        backend.unmap(rng, 0)
    finally:
        backend.free_range(rng)
        backend.release(page)


def test_prefault_allocates_a_fresh_page_zeroed_and_commits_nothing_more(backend):
    page = backend.create_page()
    rng = backend.reserve(PAGE)
    try:
        assert backend.resident_bytes(page) == 0  # reserved, not faulted in
        free = free_huge()  # (neither in use nor reserved: the page's are reserved)
        backend.prefault(page)
        assert backend.resident_bytes(page) == PAGE  # its huge pages are the file's now
        assert free_huge() == free  # the reservation was consumed, nothing more taken
        backend.map(rng, 0, page)
        assert ctypes.string_at(rng.base, PAGE) == bytes(PAGE)
        backend.unmap(rng, 0)
    finally:
        backend.free_range(rng)
        backend.release(page)


def test_the_pool_prefaults_warm_pages_not_those_made_on_a_grant(backend):
    """Idle work (``Pool.maintain``) faults warm pages in, so a tenant's first touch of
    one pays no zeroing; a page a grant has to create is left cold (the grant does not
    wait for its zeroing)."""
    from kvpool.daemon.pool import Pool

    pool = Pool(backend, budget_pages=4, warm_min=2, warm_max=2)
    try:
        while pool.has_work():
            pool.maintain(1.0)
        assert len(pool.warm) == 2
        warm = list(pool.warm)
        assert all(backend.resident_bytes(pool.pages[pfn]) == PAGE for pfn in warm)
        got = pool.take(3, tenant=1)  # the two warm pages and one made now
        made = [pfn for pfn in got if pfn not in warm]
        assert [backend.resident_bytes(pool.pages[pfn]) for pfn in made] == [0]
        pool.give_back(got, tenant=1)
    finally:
        pool.close()


def test_retire_sees_a_mapping_in_another_process(backend):
    """Leases work on hugetlbfs: a child's mapping keeps the page referenced until the
    child unmaps it."""
    page = backend.create_page()
    fd = backend.export(page)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, sys
            from kvpool.vmm.host import HostBackend
            b = HostBackend(page_size={PAGE})
            rng = b.reserve({PAGE})
            p = b.import_({fd})
            os.close({fd})
            b.map(rng, 0, p)
            b.release(p)
            print("mapped", flush=True)
            sys.stdin.readline()
            b.unmap(rng, 0)
            print("unmapped", flush=True)
            sys.stdin.readline()
        """)], pass_fds=(fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mapped"
        os.close(fd)
        probe = backend.retire(page)
        assert probe is not None and backend.referenced(probe) is True
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "unmapped"
        assert backend.referenced(probe) is False
        backend.release(probe)
    finally:
        proc.kill()
        proc.wait()


def test_an_exhausted_pool_refuses_create_page_and_no_process_gets_sigbus(backend):
    """Create pages until the pool is empty: the next is OutOfMemory; then a child maps
    and touches every byte of every page made (none needs the pool: no SIGBUS)."""
    if free_huge() > 4 * NEED * PAGE // HUGE:
        pytest.skip(f"{free_huge()} huge pages free: too many to exhaust in a test")
    pages = []
    try:
        with pytest.raises(OutOfMemory, match="no free huge pages"):
            for _ in range(free_huge() + 1):
                pages.append(backend.create_page())
        assert pages and free_huge() < PAGE // HUGE
        fds = [backend.export(p) for p in pages]
        out = child(f"""
            b = HostBackend(page_size=PAGE)
            fds = {fds}
            rng = b.reserve(len(fds) * PAGE)
            ps = [b.import_(fd) for fd in fds]
            b.map_pages(rng, 0, ps)
            ctypes.memset(rng.base, 0x11, len(fds) * PAGE)
            assert ctypes.string_at(rng.base + len(fds) * PAGE - 1, 1) == b"\\x11"
            print("touched", len(fds), flush=True)
        """, *fds)
        for fd in fds:
            os.close(fd)
        assert out.returncode == 0, (out.returncode, out.stderr)
        assert out.stdout.split() == ["touched", str(len(pages))]
    finally:
        for p in pages:
            backend.release(p)
