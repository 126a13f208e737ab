"""hugetlb pages for the host backend: what the kernel's huge page pool holds, and how a
page memfd is created and reserved on it.

Why: a 2 MiB shmem memfd is mapped with 512 4 KiB PTEs (unless THP for shmem is on), so
every unmap tears down 512 entries and every first touch takes 512 minor faults; a
hugetlb memfd is one PMD per huge page — one entry to remove, one fault to take.

Invariants:

* every huge page of a page memfd is *reserved* before the page is handed out
  (:func:`reserve`): a fault that finds no free huge page is SIGBUS in whatever process
  touched the page, so it must never need one from the pool. The daemon maps the new
  memfd shared once and unmaps it: the kernel reserves the file's huge pages at that
  mmap and keeps the reservation in the file (a shared mapping's reservations belong
  to the inode, not the mapping) until the file is gone or a hole is punched; each
  first fault, in any process, then consumes its reservation. When the pool cannot
  reserve them the mmap fails with ENOMEM here, in the daemon, and becomes
  :class:`OutOfMemory` (a grant refused with NO_MEMORY). Reserving costs no clearing:
  the first toucher clears each huge page in its one fault, as with shmem;
* "free" means ``HugePages_Free - HugePages_Rsvd`` (free pages include the reserved
  ones not faulted in yet);
* the size of every huge page memfd is a multiple of :func:`huge_page_size` (the
  kernel's default huge page size), and every address it is mapped at is aligned to it
  (the host backend aligns its reservations to the page size);
* the backend never changes the pool's size (``vm.nr_hugepages``): that is the
  operator's; only :func:`borrowed` (tests and benchmarks) raises it for a block and
  always writes the old value back.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from typing import Iterator

from kvpool.vmm.base import OutOfMemory, VmmError
from kvpool.vmm.libc import MAP_FAILED
from kvpool.vmm.libc import libc as _libc

MEMINFO = "/proc/meminfo"
PROT_READ_WRITE, MAP_SHARED = 3, 0x1


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


def free_pages() -> int:
    """Huge pages (default size) neither in use nor reserved."""
    info = meminfo()
    return max(0, info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0))


def pool_bytes() -> tuple[int, int]:
    """(free, total) bytes of the default-size huge page pool (:func:`free_pages` and
    ``HugePages_Total``, times ``Hugepagesize``); (0, 0) without hugetlb support."""
    info = meminfo()
    size = info.get("Hugepagesize", 0)
    return free_pages() * size, info.get("HugePages_Total", 0) * size


def create_fd(name: str, flags: int) -> int:
    """A hugetlb memfd (default huge page size) with ``flags`` added (``MFD_*``)."""
    return os.memfd_create(name, flags | os.MFD_HUGETLB)


def reserve(fd: int, size: int, op: str) -> None:
    """Reserve huge pages for bytes ``[0, size)`` of the hugetlb file ``fd`` (see the
    module invariants). Raises :class:`OutOfMemory` when the pool has too few free
    pages, :class:`VmmError` for anything else; nothing is reserved then."""
    addr = _libc.mmap(None, size, PROT_READ_WRITE, MAP_SHARED, fd, 0)
    if addr not in (None, MAP_FAILED):
        _libc.munmap(addr, size)  # the reservation stays with the file
        return
    err = ctypes.get_errno()
    if err == errno.ENOMEM:
        free, total = pool_bytes()
        raise OutOfMemory(op, f"no free huge pages for {size} bytes ({free >> 20} MiB of "
                              f"{total >> 20} MiB free in the hugetlb pool, vm.nr_hugepages)")
    raise VmmError(op, f"reserving {size} bytes of huge pages: {os.strerror(err)} "
                       f"(errno {err})")


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
    have = free_pages()
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
        got = free_pages()
        if got < need:
            raise NoHugePages(f"{need} huge pages needed, the kernel found only {got} "
                              "(memory too fragmented?)")
        yield
    finally:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(old))
