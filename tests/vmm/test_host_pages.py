"""Host pages as a trust boundary: seals on import, and retirement that sees who still
holds a page (real memfds, real processes)."""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from kvpool import fdchannel
from kvpool.vmm import InvalidArgument
from kvpool.vmm.host import REQUIRED_SEALS

from .fixtures import host_backend

PAGE = 1 << 20


backend = host_backend(PAGE)


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


def test_retire_of_a_page_nobody_else_holds_leaves_no_probe(backend):
    page = backend.create_page()
    fd = backend.export(page)
    with mmap.mmap(fd, PAGE) as m:  # held, then let go: mapping and descriptor gone
        m[:4] = b"used"
    os.close(fd)
    assert backend.retire(page) is None
    assert page.released


@pytest.mark.parametrize("hold", ["descriptor", "mapping"])
def test_retire_sees_what_another_process_still_holds(backend, hold):
    """A child that received the page over a socket keeps a descriptor or only a
    mapping: the retired page stays referenced until the child lets go."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = textwrap.dedent(f"""
        import mmap, os, socket, sys
        from kvpool import fdchannel
        s = socket.socket(fileno=int(sys.argv[1]))
        _, fds = fdchannel.recv_fds(s)
        m = mmap.mmap(fds[0], {PAGE})
        m[:4] = b"kept"
        if {hold == "mapping"!r}:
            os.close(fds[0])  # only the mapping holds the page now
        fdchannel.send_fds(s, b"holding", [])
        fdchannel.recv_fds(s)  # until told to let go
        m.close()
        if {hold == "descriptor"!r}:
            os.close(fds[0])
        fdchannel.send_fds(s, b"gone", [])
        fdchannel.recv_fds(s)
    """)
    child = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno())],
                             pass_fds=[theirs.fileno()])
    theirs.close()
    try:
        page = backend.create_page()
        fdchannel.send_fds(ours, b"page", [page.handle])  # as the daemon sends a grant
        assert fdchannel.recv_fds(ours)[0] == b"holding"
        probe = backend.retire(page)
        assert probe is not None and backend.referenced(probe) is True
        fdchannel.send_fds(ours, b"let go", [])
        assert fdchannel.recv_fds(ours)[0] == b"gone"
        assert backend.referenced(probe) is False
        with mmap.mmap(probe.handle, PAGE) as m:  # the child's data, nobody else's
            assert m[:4] == b"kept"
        backend.release(probe)
        fdchannel.send_fds(ours, b"bye", [])
    finally:
        ours.close()
        child.wait(30)
    assert child.returncode == 0


def test_a_forked_child_keeps_the_page_referenced(backend):
    page = backend.create_page()
    fd = backend.export(page)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(w)
        os.read(r, 1)  # holds the inherited fd until the parent writes
        os._exit(0)
    os.close(r)
    os.close(fd)  # the parent let go; the child still holds it
    probe = backend.retire(page)
    try:
        assert probe is not None and backend.referenced(probe)
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
    assert backend.referenced(probe) is False
    backend.release(probe)
