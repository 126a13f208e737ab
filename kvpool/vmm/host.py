"""Host backend: the vmm protocol on plain RAM with memfd + mmap (any Linux machine).

* a page is a memfd of ``page_size`` bytes, sealed against shrinking and growing, and
  the seals themselves sealed, so no peer can truncate it under another process's
  mapping (that would be SIGBUS); ``import_`` refuses any descriptor without those
  seals (:data:`REQUIRED_SEALS`), whoever sent it;
* a range is a ``PROT_NONE`` anonymous reservation; it costs no memory;
* map is ``mmap(MAP_FIXED | MAP_SHARED)`` of the memfd inside the range;
* unmap maps ``PROT_NONE`` back over the slots, so the address space stays reserved
  and no other mmap can land in the hole;
* zero punches a hole in the memfd (the memory really goes back to the kernel, and the
  next touch reads zeros); release closes this process's fd.
* a page's handle is its own *open file description* (the memfd reopened through
  ``/proc/self/fd``), so the kernel counts it in the inode's writer count; whoever
  receives it (``export``, SCM_RIGHTS) shares that description. ``retire`` and
  ``referenced`` use that count: a write lease (``F_SETLEASE``) is granted only when
  the caller's description is the inode's only open one, and a mapping holds its
  description, so one momentary lease on a private probe answers "does any process
  still hold a descriptor or a mapping of this page?" exactly, with no access to other
  processes' ``/proc`` (``st_nlink``/``st_blocks`` say nothing about references).

Memory is back when the last fd and the last mapping (in any process) are gone.

With ``huge_pages`` the memfds are hugetlb, their huge pages reserved when created (an
empty pool is :class:`OutOfMemory` there, never a SIGBUS at a first touch:
:mod:`kvpool.vmm.hugetlb`). Reservations are aligned to ``page_size`` in either mode,
so a hugetlb page maps at any slot, in the daemon or in a client that knows no mode.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
from typing import Sequence

from kvpool.vmm import hugetlb
from kvpool.vmm.capabilities import HOST_CAPS
from kvpool.vmm.base import (
    Backend,
    InvalidArgument,
    OutOfMemory,
    Page,
    Range,
    ResourceLimit,
    VmmError,
    contiguous_runs,
)
from kvpool.vmm.libc import MAP_FAILED
from kvpool.vmm.libc import libc as _libc
from kvpool.vmm.page_check import (
    F_SEAL_FUTURE_WRITE, REQUIRED_SEALS, SEALABLE_SEALS, SEALED_READ_ONLY, PageCheck,
)

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x1, 0x2, 0x10, 0x20
MAP_NORESERVE, MAP_POPULATE = 0x4000, 0x8000
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable, no later write faults
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
DEFAULT_PAGE_SIZE = 2 << 20
log = logging.getLogger("kvpool.vmm.host")
# Mappings the rest of the process (Python, torch, libraries) may add after we looked.
MAP_COUNT_HEADROOM = 4096


def _errno_error(op: str, what: str) -> VmmError:
    err = ctypes.get_errno()
    text = f"{what}: {os.strerror(err)} (errno {err})"
    return OutOfMemory(op, text) if err == errno.ENOMEM else InvalidArgument(op, text)


def _reopen(fd: int) -> int:
    """A new open file description of the memfd behind ``fd`` (read-write)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def read_max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return 65530


def count_maps() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


class HostBackend(Backend):
    """memfd + mmap backend. ``device`` is only a label: host memory is one device."""

    name = "host"
    caps = HOST_CAPS

    def __init__(
        self,
        device: int = 0,
        page_size: int | None = None,
        max_map_count: int | None = None,
        huge_pages: bool = False,
    ):
        self.huge_pages = huge_pages
        if huge_pages and (problem := hugetlb.shortage(page_size or DEFAULT_PAGE_SIZE)):
            raise InvalidArgument("open", f"huge_pages: {problem}")
        super().__init__(device, page_size or DEFAULT_PAGE_SIZE)
        self.max_map_count = max_map_count or read_max_map_count()
        self._lock = threading.Lock()
        self._maps_at_start = count_maps()
        self._mapped_slots = 0  # slots this backend has mapped, over all ranges
        self._ranges = 0
        self._madvise_populate = True  # False once the kernel refused MADV_POPULATE_WRITE
        self._probe_warned = False  # referenced() logged that it cannot probe
        self._page_check = PageCheck(self.page_size)  # what import_ takes for a page

    def min_page_size(self) -> int:
        """The OS page (``mmap.PAGESIZE``): ``mmap`` maps no less; the huge page size
        with ``huge_pages``."""
        return (self.huge_pages and hugetlb.huge_page_size()) or mmap.PAGESIZE

    def mem_info(self) -> tuple[int, int]:
        """(available, total) bytes: of RAM, or of the huge page pool with huge pages."""
        if self.huge_pages:
            return hugetlb.pool_bytes()
        info = hugetlb.meminfo()
        return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]

    # ---- virtual ranges -----------------------------------------------------------
    def reserve(self, nbytes: int) -> Range:
        """A PROT_NONE range whose base is aligned to ``page_size`` (hugetlb mappings
        need huge-page-aligned addresses): ``page_size`` more is reserved, the ends
        trimmed."""
        self._check_size("reserve", nbytes)
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
        extra = self.page_size if self.page_size > mmap.PAGESIZE else 0
        raw = _libc.mmap(None, nbytes + extra, PROT_NONE, flags, -1, 0)
        if raw in (None, MAP_FAILED):
            raise _errno_error("reserve", f"mmap of {nbytes} bytes of address space")
        addr = -(-raw // self.page_size) * self.page_size if extra else raw
        for start, size in ((raw, addr - raw), (addr + nbytes, raw + extra - addr - nbytes)):
            if size:  # trim the slack (munmap of part of our own reservation: no failure)
                _libc.munmap(start, size)
        with self._lock:
            self._ranges += 1
        return Range(base=addr, size=nbytes, page_size=self.page_size)

    def _free_range(self, rng: Range) -> None:
        if _libc.munmap(rng.base, rng.size) != 0:
            raise _errno_error("free_range", f"munmap at {rng.base:#x}")
        with self._lock:
            self._mapped_slots -= len(rng.mapped)
            self._ranges -= 1
        rng.mapped.clear()

    # ---- physical pages -----------------------------------------------------------
    def create_page(self) -> Page:
        return self._create_page(REQUIRED_SEALS)

    def create_sealable_page(self) -> Page:
        """A memfd sealed against resizing only: :meth:`seal_read_only` adds the rest."""
        return self._create_page(SEALABLE_SEALS)

    def import_sealable(self, fd: int) -> Page:
        self._page_check.check(fd, SEALABLE_SEALS)
        return Page(handle=fd, size=self.page_size)

    def seal_read_only(self, page: Page) -> None:
        """``F_SEAL_WRITE | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL``: no ``write(2)``, no
        writable shared mapping, no ``mprotect`` to writable, and no seal changes, for
        any holder. The kernel refuses (``EBUSY``) while a writable shared mapping of
        the memfd exists anywhere."""
        self._check_live("seal_read_only", page)
        try:
            if fcntl.fcntl(page.handle, fcntl.F_GET_SEALS) & SEALED_READ_ONLY == \
                    SEALED_READ_ONLY:
                return  # sealed by an earlier try (one that failed on a later page)
            fcntl.fcntl(page.handle, fcntl.F_ADD_SEALS, SEALED_READ_ONLY)
        except OSError as e:
            if e.errno == errno.EBUSY:
                raise InvalidArgument("seal_read_only", "the page is still mapped writable "
                                      "somewhere (unmap it first)") from e
            raise InvalidArgument("seal_read_only", f"F_ADD_SEALS: {e.strerror}") from e

    def seal_future_write(self, page: Page) -> None:
        """``F_SEAL_FUTURE_WRITE | F_SEAL_SEAL``: the writable shared mappings made
        before stay writable (a mutable set's writer), a new writable ``mmap``, a
        ``write(2)`` and an ``mprotect`` of a read-only mapping to writable fail
        (``EPERM``) for every holder, and the page can never be zeroed (a punched hole is
        a write): it is retired when the set goes."""
        self._check_live("seal_future_write", page)
        seals = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
        try:
            if fcntl.fcntl(page.handle, fcntl.F_GET_SEALS) & seals == seals:
                return
            fcntl.fcntl(page.handle, fcntl.F_ADD_SEALS, seals)
        except OSError as e:
            raise InvalidArgument("seal_future_write", f"F_ADD_SEALS: {e.strerror}") from e

    def map_read_only(self, rng: Range, offset: int, pages: Sequence[Page]) -> None:
        self._map(rng, offset, pages, False, PROT_READ)

    def _create_page(self, seals: int) -> Page:
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        try:
            fd = (hugetlb.create_fd if self.huge_pages else os.memfd_create)("kvpool-page", flags)
        except OSError as e:
            raise ResourceLimit("create_page", f"memfd_create: {e.strerror}") from e
        try:
            os.ftruncate(fd, self.page_size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            if self.huge_pages:
                hugetlb.reserve(fd, self.page_size, "create_page")
        except OSError as e:
            os.close(fd)
            raise OutOfMemory("create_page", f"sizing memfd to {self.page_size}: {e}") from e
        except VmmError:
            os.close(fd)
            raise
        try:
            counted = _reopen(fd)  # memfd_create's own description is not counted
        except OSError:
            return Page(handle=fd, size=self.page_size)  # no /proc: referenced() -> None
        os.close(fd)
        return Page(handle=counted, size=self.page_size)

    def export(self, page: Page) -> int:
        self._check_live("export", page)
        return os.dup(page.handle)

    def import_(self, fd: int) -> Page:
        """A page of ``fd`` once :class:`~kvpool.vmm.page_check.PageCheck` passes it
        (a memfd, sealed, of ``page_size``); the handle is a dup (``fd`` stays yours)."""
        self._page_check.check(fd)
        return Page(handle=os.dup(fd), size=self.page_size)

    def import_owned(self, fd: int) -> Page:
        """:meth:`import_` keeping ``fd`` itself as the page's handle (no dup, no close);
        when the check fails ``fd`` is still the caller's."""
        self._page_check.check(fd)
        return Page(handle=fd, size=self.page_size)

    def zero(self, page: Page) -> None:
        self._check_live("zero", page)
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if _libc.fallocate(page.handle, mode, 0, page.size) != 0:
            raise _errno_error("zero", f"punch hole in page fd {page.handle}")
        if self.huge_pages:  # the hole dropped the pages and their reservation: again
            hugetlb.reserve(page.handle, page.size, "zero")  # (failed: release, never map)

    def prefault(self, page: Page) -> None:
        """hugetlb: fault the page's huge pages in through a mapping of its own (the
        kernel clears each one at that fault) and unmap it: they stay the file's, so a
        tenant's first touch only maps them. The memory was reserved at creation, so this
        commits nothing more. shmem: nothing (faulting there would commit RAM the budget
        does not hold yet, and a tenant still faults every 4 KiB entry)."""
        self._check_live("prefault", page)
        if not self.huge_pages:
            return
        addr = _libc.mmap(None, page.size, PROT_READ | PROT_WRITE, MAP_SHARED, page.handle, 0)
        if addr in (None, MAP_FAILED):
            raise _errno_error("prefault", f"mmap of page fd {page.handle}")
        try:
            if _libc.madvise(addr, page.size, MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() != errno.EINVAL:
                    raise _errno_error("prefault", f"populating page fd {page.handle}")
                for off in range(0, page.size, hugetlb.huge_page_size() or page.size):
                    ctypes.memset(addr + off, 0, 1)  # old kernel: one write per huge page
        finally:
            _libc.munmap(addr, page.size)

    def release(self, page: Page) -> None:
        self._check_live("release", page)
        page.released = True
        os.close(page.handle)

    def retire(self, page: Page) -> Page | None:
        self._check_live("retire", page)
        try:
            probe = Page(handle=_reopen(page.handle), size=page.size)
        except OSError:
            self.release(page)
            return None
        self.release(page)
        if self.referenced(probe):
            return probe
        self.release(probe)
        return None

    def referenced(self, probe: Page) -> bool | None:
        """True while a descriptor or mapping of the page exists besides ``probe`` (in
        any process); None when the kernel refuses the probe (leases disabled, or a
        memfd this user does not own)."""
        self._check_live("referenced", probe)
        try:
            fcntl.fcntl(probe.handle, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EBUSY):
                return True
            if not self._probe_warned:
                self._probe_warned = True
                log.warning("cannot tell whether released pages are still held elsewhere "
                            "(F_SETLEASE: %s; fs.leases-enable=0?): they are not accounted",
                            os.strerror(e.errno or 0))
            return None
        fcntl.fcntl(probe.handle, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False

    def reopen(self, page: Page) -> Page | None:
        """A new open file description of the memfd (``/proc/self/fd``): descriptors
        exported so far share the old one, so a lease on the new one is granted only
        once they and their mappings are gone."""
        self._check_live("reopen", page)
        try:
            return Page(handle=_reopen(page.handle), size=page.size)
        except OSError:
            return None

    def resident_bytes(self, page: Page) -> int:
        """Bytes of ``page`` backed by memory now (shmem blocks in use)."""
        self._check_live("resident_bytes", page)
        return os.fstat(page.handle).st_blocks * 512

    # ---- mappings -----------------------------------------------------------------
    def map_pages(
        self, rng: Range, offset: int, pages: Sequence[Page], populate: bool = False
    ) -> None:
        self._map(rng, offset, pages, populate, PROT_READ | PROT_WRITE)

    def _map(self, rng: Range, offset: int, pages: Sequence[Page], populate: bool,
             prot: int) -> None:
        slots = self._check_map(rng, offset, pages)
        use_madvise = populate and self._madvise_populate
        flags = MAP_SHARED | MAP_FIXED | (MAP_POPULATE if populate and not use_madvise else 0)
        with rng.lock:
            self._check_unmapped(rng, slots)
            self._reserve_map_count(len(pages))
            done: list[int] = []
            try:
                for slot, page in zip(slots, pages):
                    addr = _libc.mmap(
                        rng.base + slot, self.page_size, prot, flags,
                        page.handle, 0,
                    )
                    if addr in (None, MAP_FAILED):
                        raise _errno_error("map", f"mmap of page fd {page.handle} at offset {slot}")
                    done.append(slot)
                    rng.mapped[slot] = page.handle
                if use_madvise:
                    self._populate(rng, slots)
            except BaseException:
                self._protect(rng, done)
                for slot in done:
                    del rng.mapped[slot]
                with self._lock:
                    self._mapped_slots -= len(pages)
                raise

    def unmap(self, rng: Range, offset: int, npages: int = 1) -> None:
        slots = self._check_slots("unmap", rng, offset, npages)
        with rng.lock:
            self._check_mapped(rng, slots)
            self._protect(rng, slots)
            for slot in slots:
                del rng.mapped[slot]
        with self._lock:
            self._mapped_slots -= npages

    def _populate(self, rng: Range, slots: list[int]) -> None:
        for start, count in contiguous_runs(slots, self.page_size):
            size = count * self.page_size
            if _libc.madvise(rng.base + start, size, MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == errno.EINVAL:  # old kernel: MAP_POPULATE next time
                    self._madvise_populate = False
                    return
                raise _errno_error("map", f"populating {size} bytes at offset {start}")

    def _protect(self, rng: Range, slots: list[int]) -> None:
        """Put a PROT_NONE reservation back over ``slots`` (never munmap: no holes)."""
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
        for start, count in contiguous_runs(sorted(slots), self.page_size):
            size = count * self.page_size
            if _libc.mmap(rng.base + start, size, PROT_NONE, flags, -1, 0) in (None, MAP_FAILED):
                raise _errno_error("unmap", f"re-reserving {size} bytes at offset {start}")

    def _reserve_map_count(self, n: int) -> None:
        # A mapped slot costs at most two VMAs (itself and the split it makes in its
        # reservation); refuse before the kernel would fail with ENOMEM mid-way.
        with self._lock:
            need = self._maps_at_start + self._ranges + 2 * (self._mapped_slots + n)
            headroom = min(MAP_COUNT_HEADROOM, self.max_map_count // 16)
            if need + headroom > self.max_map_count:
                raise ResourceLimit(
                    "map",
                    f"mapping {n} more pages would need about {need} memory mappings; "
                    f"vm.max_map_count is {self.max_map_count} (raise it with sysctl, or use "
                    f"a larger page size; {self._mapped_slots} pages are mapped now)",
                )
            self._mapped_slots += n
