"""A group maps the descriptors a grant or a claim brought, taking them over: each one
becomes a page's handle or is closed, on success and on every failure (a real daemon;
real memfds, one of them unfit for a page)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from kvpool.client_lib.tenant import Tenant
from kvpool.vmm import InvalidArgument
from kvpool.vmm.host import REQUIRED_SEALS

from .conftest import PAGE


def memfd(sealed: bool) -> int:
    fd = os.memfd_create("kvpool-page", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, PAGE)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    return fd


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_page_refused_mid_run_leaves_no_descriptor_and_no_mapping(run_dir: Path):
    t = Tenant("mapper", run_dir=run_dir, keeper=False)
    try:
        g = t.region_group(2, 4 * PAGE)
        fds = [memfd(sealed=i != 4) for i in range(6)]  # unit-major: units 0..2, 2 regions
        given = list(fds)
        with pytest.raises(InvalidArgument, match="seal"):
            g._map([0, 1, 2], fds, populate=False)  # region 0: units 0, 1 fine, 2 refused
        assert all(not r.mapped for r in g.ranges)
        assert not g.handles and not g.mapped
        taken = [i for i, fd in enumerate(fds) if fd == -1]
        assert taken == [0, 2]  # region 0's pages of units 0 and 1, then released
        assert [is_open(given[i]) for i in taken] == [False, False]
        assert all(is_open(fd) for fd in fds if fd >= 0)  # the caller's still
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        g.close()
    finally:
        t.close()


def test_granted_units_keep_their_descriptors_as_page_handles(run_dir: Path):
    t = Tenant("mapper", run_dir=run_dir, keeper=False)
    try:
        g = t.region_group(2, 4 * PAGE)
        g.grant([1, 2])
        held = [page.handle for u in (1, 2) for page in g.handles[u]]
        assert len(held) == 4 and all(is_open(fd) for fd in held)
        g.release([1, 2])
        assert not g.handles
        g.close()
    finally:
        t.close()
