"""What ``HostBackend.import_`` takes for a page: memfds only, however many came before
(the backend remembers where memfds live; a file elsewhere is judged on its own)."""

from __future__ import annotations

import fcntl
import os
import tempfile

import pytest

from kvpool.vmm import InvalidArgument
from kvpool.vmm.host import REQUIRED_SEALS

from .fixtures import host_backend

PAGE = 1 << 20

backend = host_backend(PAGE)


def sealed_memfd() -> int:
    fd = os.memfd_create("kvpool-page", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, PAGE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    return fd


def import_memfds(backend, n: int) -> None:
    """Import (and release) ``n`` good pages: the backend has seen memfds."""
    for _ in range(n):
        fd = sealed_memfd()
        try:
            backend.release(backend.import_(fd))
        finally:
            os.close(fd)


@pytest.mark.parametrize("where", ["/dev/shm", "/tmp"])
def test_import_refuses_a_file_that_is_no_memfd_after_memfds_were_taken(backend, where):
    """A page-sized tmpfs (or disk) file, after memfds were imported: refused as no memfd
    page, not merely for its seals (``F_GET_SEALS`` alone would not say what it is)."""
    if not os.path.isdir(where):
        pytest.skip(f"no {where}")
    import_memfds(backend, 3)
    fd, path = tempfile.mkstemp(dir=where, prefix="kvpool-not-a-page-")
    try:
        os.unlink(path)
        os.ftruncate(fd, PAGE)
        with pytest.raises(InvalidArgument, match="not a memfd page"):
            backend.import_(fd)
    finally:
        os.close(fd)


def test_import_of_many_memfds_checks_the_seals_of_each(backend):
    """The place is remembered, the seals never: an unsealed memfd after sealed ones is
    refused."""
    import_memfds(backend, 3)
    fd = os.memfd_create("kvpool-page", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, PAGE)
        with pytest.raises(InvalidArgument, match="seal"):
            backend.import_(fd)
    finally:
        os.close(fd)
