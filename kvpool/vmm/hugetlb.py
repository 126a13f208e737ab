"""hugetlb pages for the host backend: what the kernel's huge page pool holds, and how a
page memfd is created and filled on it.

Why: a 2 MiB shmem memfd is mapped with 512 4 KiB PTEs (unless THP for shmem is on), so
every unmap tears down 512 entries and every first touch takes 512 minor faults; a
hugetlb memfd is one PMD per huge page — one entry to remove, one fault to take.

Invariants:

* a page memfd created here (:func:`create_fd`) has its memory *allocated* before it is
  returned (:func:`allocate`, ``fallocate``): hugetlb reserves at mmap or fault time, and
  a fault that finds the pool empty is SIGBUS in whatever process touched the page. An
  allocated page is in the file's page cache, so mapping and touching it later needs
  nothing from the pool; when the pool is empty, the allocation fails with ENOSPC here,
  in the daemon, and becomes :class:`OutOfMemory` (a grant refused with NO_MEMORY);
* the size of every huge page memfd is a multiple of :func:`huge_page_size` (the
  kernel's default huge page size), and every address it is mapped at is aligned to it
  (the host backend aligns its reservations to the page size);
* nothing here changes the pool's size (``vm.nr_hugepages``): that is the operator's.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from typing import Iterator

from kvpool.vmm.base import OutOfMemory, VmmError

MEMINFO = "/proc/meminfo"


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` as numbers (kB fields in bytes, counts as they are)."""
    out: dict[str, int] = {}
    with open(MEMINFO) as f:
        for line in f:
            key, value = line.split(":", 1)
            parts = value.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def huge_page_size() -> int | None:
    """The kernel's default huge page size in bytes (``Hugepagesize``), None without
    hugetlb support."""
    try:
        return meminfo().get("Hugepagesize") or None
    except OSError:
        return None


def pool_bytes() -> tuple[int, int]:
    """(free, total) bytes of the default-size huge page pool (``HugePages_Free`` and
    ``HugePages_Total`` times ``Hugepagesize``); (0, 0) without hugetlb support."""
    info = meminfo()
    size = info.get("Hugepagesize", 0)
    return info.get("HugePages_Free", 0) * size, info.get("HugePages_Total", 0) * size


def create_fd(name: str, flags: int) -> int:
    """A hugetlb memfd (default huge page size) with ``flags`` added (``MFD_*``)."""
    return os.memfd_create(name, flags | os.MFD_HUGETLB)


def allocate(fd: int, size: int, libc: ctypes.CDLL, op: str) -> None:
    """Put real huge pages behind bytes ``[0, size)`` of ``fd`` now. Raises
    :class:`OutOfMemory` when the pool has too few free pages (ENOSPC/ENOMEM), and
    :class:`VmmError` for anything else. After an error the file may hold some of the
    pages (hugetlbfs keeps a partial fallocate): the caller releases it or punches it."""
    if libc.fallocate(fd, 0, 0, size) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.ENOSPC, errno.ENOMEM):
        free, total = pool_bytes()
        raise OutOfMemory(op, f"no free huge pages for {size} bytes ({free >> 20} MiB of "
                              f"{total >> 20} MiB free in the hugetlb pool, vm.nr_hugepages)")
    raise VmmError(op, f"fallocate of {size} huge page bytes: {os.strerror(err)} (errno {err})")


def shortage(page_size: int) -> str | None:
    """Why ``page_size`` cannot be backed by huge pages on this machine, or None."""
    size = huge_page_size()
    if size is None:
        return "this kernel has no hugetlb support (no Hugepagesize in /proc/meminfo)"
    if page_size % size:
        return (f"page size {page_size} bytes is not a multiple of the huge page size "
                f"{size} bytes")
    return None


NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


class NoHugePages(RuntimeError):
    """The huge pages asked for are not free and could not be reserved (says why)."""


@contextlib.contextmanager
def borrowed(nbytes: int) -> Iterator[None]:
    """For tests and benchmarks: make sure ``nbytes`` of default-size huge pages are free
    for the block. Uses what is free; otherwise, as root, raises ``vm.nr_hugepages`` by
    the shortfall and always writes the old value back on leaving (pages still in use
    then become surplus and go back when freed); otherwise raises :class:`NoHugePages`."""
    size = huge_page_size()
    if size is None:
        raise NoHugePages("this kernel has no hugetlb support")
    need = -(-nbytes // size)
    have = meminfo().get("HugePages_Free", 0)
    if have >= need:
        yield
        return
    try:
        with open(NR_HUGEPAGES) as f:
            old = int(f.read())
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(old + need - have))
    except OSError as e:
        raise NoHugePages(f"{need} huge pages needed, {have} free, and {NR_HUGEPAGES} "
                          f"cannot be raised ({e.strerror}; run as root or reserve them)") from e
    try:
        got = meminfo().get("HugePages_Free", 0)
        if got < need:
            raise NoHugePages(f"{need} huge pages needed, the kernel found only {got} "
                              "(memory too fragmented?)")
        yield
    finally:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(old))
