"""Backend capabilities are facts the callers branch on: each one the host backend
claims is checked against what its pages actually do, and the registry lists every
backend class with the record the class carries."""

from __future__ import annotations

import mmap
import os

import pytest

from kvpool.vmm import BACKENDS, InvalidArgument, capabilities, open_backend
from kvpool.vmm.base import Backend
from kvpool.vmm.cuda import CudaBackend
from kvpool.vmm.host import HostBackend
from kvpool.vmm.registry import REGISTRY

from vmm.fixtures import host_backend

PAGE = 2 << 20
backend = host_backend(PAGE)


def test_registry_lists_every_backend_class_with_its_own_record() -> None:
    classes = {HostBackend: "host", CudaBackend: "cuda"}
    assert set(REGISTRY) == set(classes.values())
    assert BACKENDS == ("auto", *REGISTRY)
    for cls, name in classes.items():
        assert cls.name == name
        assert REGISTRY.lookup(name).caps is cls.caps
        assert capabilities(name) is cls.caps
    # every concrete subclass anywhere in the package declares its capabilities
    for cls in Backend.__subclasses__():
        assert "caps" in vars(cls), f"{cls.__name__} declares no capabilities"


def test_unknown_backend_is_one_clear_error() -> None:
    with pytest.raises(InvalidArgument, match="unknown backend 'tpu'"):
        open_backend("tpu")
    with pytest.raises(InvalidArgument, match="unknown backend"):
        capabilities("tpu")


def test_host_fresh_pages_read_zeros(backend: HostBackend) -> None:
    assert backend.caps.fresh_pages_zeroed
    page = backend.create_page()
    try:
        with mmap.mmap(page.handle, PAGE, prot=mmap.PROT_READ) as m:
            assert m[:] == bytes(PAGE)
    finally:
        backend.release(page)


def test_host_handles_are_the_pages_descriptors(backend: HostBackend) -> None:
    """An exported descriptor names the same page as the handle (same file), so a
    receiver can keep it as the handle and page identity can be read off it."""
    assert backend.caps.handles_are_fds
    page = backend.create_page()
    fd = backend.export(page)
    try:
        a, b = os.fstat(page.handle), os.fstat(fd)
        assert (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
        os.pwrite(page.handle, b"kv", 0)
        assert os.pread(fd, 2, 0) == b"kv"
    finally:
        os.close(fd)
        backend.release(page)


def test_host_memory_is_not_device_bounded_and_tensors_are_cpu() -> None:
    caps = capabilities("host")
    assert not caps.device_memory_bounded and caps.tensor_device == "cpu" and caps.huge_pages
    cuda = capabilities("cuda")
    assert (cuda.device_memory_bounded, cuda.tensor_device, cuda.handles_are_fds,
            cuda.fresh_pages_zeroed, cuda.huge_pages) == (True, "cuda", False, False, False)
