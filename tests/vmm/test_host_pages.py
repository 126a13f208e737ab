"""Host pages as a trust boundary: seals on import, and retirement that sees who still
holds a page (real memfds, real processes)."""

from __future__ import annotations

import fcntl
import mmap
import os
import subprocess
import sys
import textwrap

import pytest

from kvpool.vmm import InvalidArgument
from kvpool.vmm.host import REQUIRED_SEALS, HostBackend

PAGE = 1 << 20


@pytest.fixture
def backend():
    b = HostBackend(page_size=PAGE)
    yield b
    b.close()


def memfd(size: int = PAGE, seals: int = 0, sealing: bool = True) -> int:
    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealing else 0)
    fd = os.memfd_create("kvpool-page", flags)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize("seals,sealing", [
    (0, True),  # no seal at all: any holder could truncate it (SIGBUS for every mapper)
    (fcntl.F_SEAL_SHRINK, True),
    (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, True),  # may still be unsealed (seals added)
    (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL, True),
    (0, False),  # sealing not allowed: F_SEAL_SEAL only, so it can shrink
])
def test_import_refuses_a_memfd_without_the_required_seals(backend, seals, sealing):
    fd = memfd(seals=seals, sealing=sealing)
    try:
        with pytest.raises(InvalidArgument, match="seal"):
            backend.import_(fd)
    finally:
        os.close(fd)


def test_import_accepts_what_create_page_makes(backend):
    page = backend.create_page()
    got = fcntl.fcntl(page.handle, fcntl.F_GET_SEALS)
    assert got & REQUIRED_SEALS == REQUIRED_SEALS
    fd = backend.export(page)
    try:
        other = backend.import_(fd)
    finally:
        os.close(fd)
    with pytest.raises(OSError):  # nobody, the daemon included, can change its size
        os.ftruncate(other.handle, 0)
    backend.release(other)
    backend.release(page)


def test_import_accepts_a_sealed_memfd_of_the_right_size_only(backend):
    fd = memfd(size=2 * PAGE, seals=REQUIRED_SEALS)
    try:
        with pytest.raises(InvalidArgument, match="bytes"):
            backend.import_(fd)
    finally:
        os.close(fd)
    fd = memfd(seals=REQUIRED_SEALS)
    try:
        backend.release(backend.import_(fd))
    finally:
        os.close(fd)
