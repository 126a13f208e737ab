"""Fixture makers shared by the host-backend tests (tests/vmm, tests/daemon, tests/):
a module states its page size once, ``backend = host_backend(PAGE)``, instead of
repeating the fixture. Elsewhere under tests/ import them as ``vmm.fixtures`` (pytest
puts tests/ on the path, as for ``daemon.helpers``).

The fixture function is named as the module attribute it is assigned to (``backend``,
``huge``), so the test modules request them by those names."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from kvpool.vmm import hugetlb
from kvpool.vmm.host import HostBackend


def host_backend(page_size: int, *, huge_pages: bool = False,
                 after: tuple[str, ...] = ()) -> Callable[..., Iterator[HostBackend]]:
    """A ``backend`` fixture: a fresh :class:`HostBackend` of ``page_size`` per test,
    closed after it; the fixtures named in ``after`` (``"huge"``) are set up first."""

    @pytest.fixture
    def backend(request: pytest.FixtureRequest) -> Iterator[HostBackend]:
        for name in after:
            request.getfixturevalue(name)
        b = HostBackend(page_size=page_size, huge_pages=huge_pages)
        yield b
        b.close()

    return backend


def borrowed_huge_pages(nbytes: int) -> Callable[..., Iterator[None]]:
    """A ``huge`` fixture: ``nbytes`` of huge pages free during the test — those free
    already, or (as root) ``vm.nr_hugepages`` raised and restored after
    (:func:`kvpool.vmm.hugetlb.borrowed`) — else the test is skipped, saying why."""

    @pytest.fixture
    def huge() -> Iterator[None]:
        try:
            with hugetlb.borrowed(nbytes):
                yield
        except hugetlb.NoHugePages as e:
            pytest.skip(f"no huge pages for the test: {e}")

    return huge
