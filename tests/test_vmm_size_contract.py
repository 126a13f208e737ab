"""The vmm size contract on the host backend (the CUDA stub's twin is in
``test_vmm_cuda_stub.py``): ``page_size`` is the one unit of every size and offset;
``min_page_size()`` only bounds ``page_size``, and no method offers a finer unit."""

from __future__ import annotations

import mmap

import pytest

from kvpool.vmm import Backend, InvalidArgument
from kvpool.vmm.host import HostBackend
from vmm.fixtures import host_backend

OS_PAGE = mmap.PAGESIZE
PAGE = 2 << 20


backend = host_backend(PAGE)


def test_the_one_unit_is_page_size(backend):
    assert backend.min_page_size() == OS_PAGE
    assert not hasattr(Backend, "granularity"), "a second name for a size unit is back"
    for n in (1, 8, PAGE // OS_PAGE - 1):
        with pytest.raises(InvalidArgument, match=f"multiple of page size {PAGE}"):
            backend.reserve(n * OS_PAGE)  # multiples of the minimum, not of page_size
    rng = backend.reserve(2 * PAGE)
    page = backend.create_page()
    try:
        for off in (OS_PAGE, PAGE - OS_PAGE):
            with pytest.raises(InvalidArgument, match=f"multiple of page size {PAGE}"):
                backend.map(rng, off, page)
        backend.map(rng, PAGE, page)
        with pytest.raises(InvalidArgument, match=f"multiple of page size {PAGE}"):
            backend.unmap(rng, PAGE + OS_PAGE)
        backend.unmap(rng, PAGE)
    finally:
        backend.release(page)
        backend.free_range(rng)


def test_page_size_must_be_a_multiple_of_the_minimum():
    small = HostBackend(page_size=OS_PAGE)  # the minimum itself is a valid page size
    rng = small.reserve(8 * OS_PAGE)
    small.free_range(rng)
    small.close()
    with pytest.raises(InvalidArgument, match=f"minimum page size {OS_PAGE}"):
        HostBackend(page_size=OS_PAGE + OS_PAGE // 2)
