"""Host backend (memfd + mmap): real memory, real processes, real sockets."""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import signal
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

from kvpool import fdchannel
from kvpool.client_lib.tensors import live_views, tensor_view
from kvpool.vmm import InvalidArgument, ResourceLimit, open_backend
from kvpool.vmm.host import HostBackend, count_maps

from .fixtures import host_backend

PAGE = 1 << 20


backend = host_backend(PAGE)


def assert_usable(b: HostBackend) -> None:
    """After any error the backend still does a full map / write / read / unmap cycle."""
    rng = b.reserve(2 * b.page_size)
    page = b.create_page()
    b.map(rng, b.page_size, page)
    t = tensor_view(b, rng, torch.int32, offset=b.page_size, nbytes=b.page_size)
    t.fill_(7)
    assert int(t[-1]) == 7
    del t
    b.unmap(rng, b.page_size)
    b.release(page)
    b.free_range(rng)


def test_auto_selects_host_without_gpu():
    from kvpool.vmm import cuda_available

    usable = cuda_available()
    if not os.path.exists("/dev/nvidiactl"):
        assert not usable  # no NVIDIA device node: CUDA cannot be usable here
    b = open_backend("auto", page_size=None if usable else PAGE)
    assert b.name == ("cuda" if usable else "host")
    b.close()
    with pytest.raises(InvalidArgument, match="unknown backend"):
        open_backend("tpu")


def test_reserving_64_gib_costs_no_memory(backend):
    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info().rss
    rng = backend.reserve(64 << 30)
    after = proc.memory_info().rss
    assert after - before < (1 << 20), f"RSS grew by {after - before} bytes"
    backend.free_range(rng)


def test_write_read_through_tensor_and_segv_after_unmap(backend):
    rng = backend.reserve(8 * PAGE)
    pages = [backend.create_page() for _ in range(3)]
    backend.map_pages(rng, 2 * PAGE, pages, populate=True)
    view = tensor_view(backend, rng, torch.float32, offset=2 * PAGE, nbytes=3 * PAGE)
    view.copy_(torch.arange(view.numel(), dtype=torch.float32))
    assert torch.equal(view, torch.arange(view.numel(), dtype=torch.float32))
    backend.unmap(rng, 3 * PAGE)  # the middle page
    pid = os.fork()
    if pid == 0:  # child: touch the unmapped page
        faulthandler.disable()  # die quietly; the parent checks the signal
        ctypes.string_at(rng.base + 3 * PAGE, 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    # the parent is unharmed and its other pages keep their data
    first = view[: PAGE // 4]
    assert float(first[-1]) == PAGE // 4 - 1
    assert float(view[-1]) == view.numel() - 1


CHILD = textwrap.dedent(
    """
    import os, socket, sys, torch
    from kvpool import fdchannel
    from kvpool.vmm.host import HostBackend
    from kvpool.client_lib.tensors import tensor_view
    sock = socket.socket(fileno=int(sys.argv[1]))
    b = HostBackend(page_size=int(sys.argv[2]))
    data, fds = fdchannel.recv_fds(sock)
    with fdchannel.closing(fds):
        page = b.import_(fds[0])
    rng = b.reserve(b.page_size)
    b.map(rng, 0, page)
    b.release(page)  # from here only the mapping holds the page
    t = tensor_view(b, rng, torch.int64)
    sock.send(str(int(t.sum())).encode())
    t[0] = -1  # the parent must see this write
    del t
    sock.send(b"mapped")
    assert sock.recv(64) == b"let go"
    b.unmap(rng, 0); b.free_range(rng)
    sock.send(b"released")
    assert sock.recv(64) == b"bye"  # alive while the parent looks: unmap let go, not exit
    """
)


def test_export_import_across_processes_and_memory_returned():
    """The page's memory is held while any fd or mapping of it exists, in any process,
    and is free to go back once the last is gone. Observed only through this test's own
    page (a private probe's lease and st_blocks), never machine-wide counters that other
    processes move: ``referenced(probe) is False`` means the probe is the page's only
    open description left, so releasing it returns the memory."""
    size = 32 << 20
    b = HostBackend(page_size=size)
    page = b.create_page()
    rng = b.reserve(size)
    b.map(rng, 0, page, populate=True)
    t = tensor_view(b, rng, torch.int64)
    t.copy_(torch.arange(t.numel()))
    expected = int(t.sum())
    assert b.resident_bytes(page) == size  # real memory, charged to this page
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(child.fileno()), str(size)], pass_fds=[child.fileno()]
    )
    child.close()
    try:
        fd = b.export(page)
        fdchannel.send_fds(parent, b"page", [fd])
        os.close(fd)
        assert int(parent.recv(64)) == expected
        assert parent.recv(64) == b"mapped"
        assert int(t[0]) == -1  # the child's write is visible here
        del t
        b.unmap(rng, 0)
        b.free_range(rng)
        probe = b.retire(page)  # releases our fd; a probe only while someone holds it
        assert probe is not None and b.referenced(probe) is True  # the child's mapping
        parent.send(b"let go")
        assert parent.recv(64) == b"released"
        assert b.referenced(probe) is False  # no fd, no mapping left in either process
        assert b.resident_bytes(probe) == size  # still the same memory, held by the probe
        b.release(probe)  # the last reference: the memory goes back
        parent.send(b"bye")
        assert proc.wait(timeout=60) == 0
    finally:
        parent.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        b.close()


def test_zero_zeroes_and_recreated_pages_never_show_old_bytes(backend):
    rng = backend.reserve(PAGE)
    for _ in range(3):
        page = backend.create_page()
        backend.map(rng, 0, page)
        t = tensor_view(backend, rng, torch.uint8)
        assert int(t.max()) == 0, "a fresh page showed old bytes"
        t.fill_(0xAB)
        assert backend.resident_bytes(page) == PAGE
        backend.zero(page)
        assert backend.resident_bytes(page) == 0  # zero really returns memory
        assert int(t.max()) == 0
        t.fill_(0xCD)
        del t
        backend.unmap(rng, 0)
        backend.release(page)


def test_view_keeps_range_reserved(backend):
    gc.collect()
    views_before = live_views()  # other tests' engines may still hold views
    rng = backend.reserve(2 * PAGE)
    page = backend.create_page()
    backend.map(rng, 0, page)
    t = tensor_view(backend, rng, torch.uint8, nbytes=PAGE)
    alias = t[10:20]
    del t
    backend.free_range(rng)
    assert not rng.freed, "range freed while a view exists"
    alias.fill_(3)  # still mapped, still ours
    del alias
    gc.collect()
    assert rng.freed and live_views() == views_before
    backend.release(page)


def test_bad_arguments_raise_typed_errors_and_leave_backend_usable(backend, tmp_path):
    rng = backend.reserve(4 * PAGE)
    page, other = backend.create_page(), backend.create_page()
    bad_calls = {
        "unaligned reserve": lambda: backend.reserve(PAGE + 1),
        "zero reserve": lambda: backend.reserve(0),
        "unaligned offset": lambda: backend.map(rng, 4096, page),
        "negative offset": lambda: backend.map(rng, -PAGE, page),
        "outside range": lambda: backend.map(rng, 4 * PAGE, page),
        "unmap never mapped": lambda: backend.unmap(rng, 0),
        "unmap outside": lambda: backend.unmap(rng, 3 * PAGE, 2),
        "import closed fd": lambda: backend.import_(987654),
        "import foreign fd": lambda: backend.import_(os.open(tmp_path, os.O_RDONLY)),
        "import pipe": lambda: backend.import_(os.pipe()[0]),
        "import not an int": lambda: backend.import_("3"),
        "map not a page": lambda: backend.map(rng, 0, object()),
    }
    for what, call in bad_calls.items():
        with pytest.raises(InvalidArgument) as err:
            call()
        assert str(err.value), what
    backend.map(rng, 0, page)
    with pytest.raises(InvalidArgument, match="already mapped"):
        backend.map(rng, 0, other)
    with pytest.raises(InvalidArgument, match="already mapped"):
        backend.map_pages(rng, 0, [other])
    backend.unmap(rng, 0)
    with pytest.raises(InvalidArgument, match="not mapped"):
        backend.unmap(rng, 0)
    backend.release(page)
    with pytest.raises(InvalidArgument, match="already released"):
        backend.release(page)
    with pytest.raises(InvalidArgument, match="already released"):
        backend.export(page)
    backend.free_range(rng)
    with pytest.raises(InvalidArgument, match="already freed"):
        backend.free_range(rng)
    with pytest.raises(InvalidArgument):
        backend.map(rng, 0, other)
    backend.release(other)
    assert_usable(backend)


def test_map_is_all_or_nothing(backend):
    rng = backend.reserve(4 * PAGE)
    a, b_, c = (backend.create_page() for _ in range(3))
    backend.map(rng, 2 * PAGE, c)
    with pytest.raises(InvalidArgument):
        backend.map_pages(rng, PAGE, [a, b_])  # second slot is taken
    assert sorted(rng.mapped) == [2 * PAGE]
    backend.map_pages(rng, 0, [a, b_])
    assert sorted(rng.mapped) == [0, PAGE, 2 * PAGE]


def test_refuses_before_max_map_count(tmp_path):
    limit = count_maps() + 400
    b = HostBackend(page_size=64 << 10, max_map_count=limit)
    rng = b.reserve(1024 * b.page_size)
    pages = [b.create_page() for _ in range(400)]
    with pytest.raises(ResourceLimit, match="max_map_count"):
        # every other slot, so no two mappings are adjacent
        for i, page in enumerate(pages):
            b.map(rng, 2 * i * b.page_size, page)
    mapped = sorted(rng.mapped)
    assert 0 < len(mapped) < 400
    b.unmap(rng, mapped[-1])
    b.map(rng, mapped[-1], pages[len(mapped) - 1])  # room again after an unmap
    for off in sorted(rng.mapped):
        b.unmap(rng, off)
    for p in pages:
        b.release(p)
    b.free_range(rng)
    assert_usable(b)


def test_page_size_must_be_a_multiple_of_the_os_page():
    with pytest.raises(InvalidArgument, match="page_size"):
        HostBackend(page_size=5000)
