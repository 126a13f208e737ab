"""The vmm backend protocol: physical pages, virtual ranges, and mappings between them.

One small interface, two implementations with identical semantics (``host`` on memfd +
mmap, ``cuda`` on the CUDA driver VMM API). No policy and no sockets live here: the
daemon decides who gets which page, the client library maps what it was granted.

Invariants every backend keeps:

* A :class:`Range` is virtual address space only; reserving one costs no memory.
* A :class:`Page` is ``page_size`` bytes of physical memory, and ``page_size`` is the
  one unit of every size and offset: ``reserve(nbytes)``, ``map_pages(rng, offset,
  ...)`` and ``unmap(rng, offset, ...)`` refuse (:class:`InvalidArgument`) any that is
  not a multiple of it, on every backend. :meth:`Backend.min_page_size` (the OS page on
  host, the driver's allocation granularity on CUDA) only bounds ``page_size`` itself,
  which must be a positive multiple of it.
* ``map`` never replaces an existing mapping and ``unmap`` never leaves a hole another
  allocation could take: an unmapped slot stays reserved.
* Physical memory returns to the system once every reference is gone: this process's
  page handle (``release``), every mapping (``unmap``) and every exported fd (closed),
  in every process.
* Every failure raises a :class:`VmmError` subclass naming the operation and the values
  at fault, and leaves the backend fully usable.
"""

from __future__ import annotations

import abc
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Sequence

if TYPE_CHECKING:
    from kvpool.vmm.capabilities import Capabilities


class VmmError(Exception):
    """A vmm operation failed. ``op`` names it; the message names the offending values."""

    def __init__(self, op: str, message: str):
        super().__init__(f"{op}: {message}")
        self.op = op


class OutOfMemory(VmmError):
    """The device (or host) has no physical memory left for the request."""


class InvalidArgument(VmmError):
    """Unaligned sizes, offsets outside a range, double unmap/release, a bad fd, ..."""


class Unsupported(VmmError):
    """The device or driver lacks a capability the backend needs."""


class ResourceLimit(VmmError):
    """An OS or driver limit (``vm.max_map_count``, open files) would be exceeded."""


class DriverError(VmmError):
    """Any other error the driver reported; ``code`` keeps its numeric value."""

    def __init__(self, op: str, message: str, code: int = -1):
        super().__init__(op, message)
        self.code = code


@dataclass(eq=False)
class Page:
    """One physical page owned by this process until :meth:`Backend.release`.

    ``handle`` is backend specific (a memfd on host, a ``CUmemGenericAllocationHandle``
    value on CUDA). ``released`` turns True once released; the object is then dead.
    """

    handle: Any
    size: int
    released: bool = False


@dataclass(eq=False)
class Range:
    """A reserved virtual address range ``[base, base + size)``.

    ``mapped`` maps each mapped page-slot offset to the page mapped there (kept so the
    backend can refuse overlaps and double unmaps). ``pins`` counts live tensor views:
    while it is non-zero, :meth:`Backend.free_range` only marks the range and the
    address space is freed when the last view dies.
    """

    base: int
    size: int
    page_size: int
    mapped: dict[int, Any] = field(default_factory=dict)
    pins: int = 0
    freeing: bool = False
    freed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def npages(self) -> int:
        return self.size // self.page_size

    def addr(self, offset: int) -> int:
        return self.base + offset


class Backend(abc.ABC):
    """Device memory primitives. Thread-safe for calls on distinct pages and slots."""

    name: str = "abstract"
    #: what callers may rely on (see :class:`~kvpool.vmm.capabilities.Capabilities`);
    #: every concrete backend sets it, and :mod:`kvpool.vmm.registry` lists it
    caps: ClassVar[Capabilities]

    def __init__(self, device: int = 0, page_size: int | None = None):
        self.device = device
        smallest = self.min_page_size()
        self.page_size = page_size or smallest
        if self.page_size <= 0 or self.page_size % smallest:
            raise InvalidArgument(
                "init",
                f"page_size {self.page_size} is not a positive multiple of the minimum "
                f"page size {smallest} (the {self.name} backend's granularity)",
            )

    # ---- capabilities -------------------------------------------------------------
    @abc.abstractmethod
    def min_page_size(self) -> int:
        """The smallest ``page_size`` this backend supports; ``page_size`` is a positive
        multiple of it. Sizes and offsets of ranges and mappings are multiples of
        ``page_size``, not of this."""

    @abc.abstractmethod
    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device's physical memory."""

    # ---- virtual ranges -----------------------------------------------------------
    @abc.abstractmethod
    def reserve(self, nbytes: int) -> Range:
        """Reserve ``nbytes`` (a multiple of ``page_size``) of virtual address space."""

    @abc.abstractmethod
    def _free_range(self, rng: Range) -> None:
        """Unmap whatever is still mapped and give the address space back."""

    def free_range(self, rng: Range) -> None:
        """Give a range back; deferred until the last tensor view over it is gone."""
        with rng.lock:
            if rng.freed or rng.freeing:
                raise InvalidArgument("free_range", f"range at {rng.base:#x} already freed")
            rng.freeing = True
            if rng.pins:
                return
        self._free_range(rng)
        rng.freed = True

    def pin(self, rng: Range) -> None:
        """Keep ``rng`` reserved while a view exists (see :meth:`unpin`)."""
        with rng.lock:
            if rng.freed or rng.freeing:
                raise InvalidArgument("pin", f"range at {rng.base:#x} is freed")
            rng.pins += 1

    def unpin(self, rng: Range) -> None:
        with rng.lock:
            rng.pins -= 1
            last = rng.pins == 0 and rng.freeing and not rng.freed
        if last:
            self._free_range(rng)
            rng.freed = True

    # ---- physical pages -----------------------------------------------------------
    @abc.abstractmethod
    def create_page(self) -> Page:
        """Create one page of physical memory (contents unspecified: zero it first)."""

    @abc.abstractmethod
    def export(self, page: Page) -> int:
        """A new shareable POSIX fd for ``page``; the caller closes it."""

    @abc.abstractmethod
    def import_(self, fd: int) -> Page:
        """A page from a shareable fd sent by another process. ``fd`` stays the
        caller's: close it after import (an open fd pins the memory)."""

    def import_owned(self, fd: int) -> Page:
        """:meth:`import_` that takes ``fd`` over: once this returns the caller must not
        close ``fd`` (the page may hold it as its handle); when it raises, ``fd`` is
        still the caller's."""
        page = self.import_(fd)
        os.close(fd)
        return page

    @abc.abstractmethod
    def zero(self, page: Page) -> None:
        """Fill ``page`` with zeros; complete when this returns."""

    @abc.abstractmethod
    def release(self, page: Page) -> None:
        """Drop this process's reference to ``page``; mappings keep their memory."""

    def prefault(self, page: Page) -> None:
        """Have the memory of a fresh ``page`` allocated (and zeroed) now, so that its
        first mapping elsewhere pays no first-touch zeroing: idle work for pages made
        ahead of need. Nothing by default (memory that is committed at creation)."""

    def retire(self, page: Page) -> Page | None:
        """Release ``page`` for good, as its last owner: returns a *probe* (a Page to
        :meth:`release` later) while other processes still reference its memory, so the
        caller can keep charging for it (:meth:`referenced`); None when nothing else
        does, or when this backend cannot tell (then the page is simply released)."""
        self.release(page)
        return None

    def referenced(self, probe: Page) -> bool | None:
        """Whether any other process still holds the memory behind ``probe`` (a
        descriptor or a mapping); None when this backend cannot tell."""
        return None

    def reopen(self, page: Page) -> Page | None:
        """A new handle of ``page``'s memory that shares nothing with the handles and
        descriptors given out so far, so that :meth:`referenced` on it tells whether
        those are all gone; ``page`` stays valid (release it). None when this backend
        cannot make one (then it cannot tell either)."""
        return None

    # ---- weight-set pages (``caps.read_only_maps``; sealed for good: ``read_only_shares``)
    def create_sealable_page(self) -> Page:
        """A fresh page (reads zeros) that :meth:`seal_read_only` can make read-only
        later; until then its holders may write it."""
        raise Unsupported("create_sealable_page", f"the {self.name} backend has no "
                          "read-only shares")

    def import_sealable(self, fd: int) -> Page:
        """:meth:`import_owned` for a page of :meth:`create_sealable_page` (not yet
        sealed for good); ``fd`` is taken over on success."""
        raise Unsupported("import_sealable", f"the {self.name} backend has no read-only "
                          "shares")

    def seal_read_only(self, page: Page) -> None:
        """Make ``page`` read-only for every holder, for good, where the backend can
        (``caps.read_only_shares``); raises :class:`InvalidArgument` while some process
        still maps it writable (the caller must have every writer unmap first).
        Without ``read_only_shares`` it checks ``page`` and does nothing: the caller's
        state change is the seal, and the holders' read-only mappings are their own
        choice (CUDA)."""
        raise Unsupported("seal_read_only", f"the {self.name} backend has no read-only "
                          "shares")

    def seal_future_write(self, page: Page) -> None:
        """A mutable weight set's seal (``caps.read_only_shares``): the writable
        mappings that exist now (its writer's) stay writable, but no process can make a
        new writable mapping or ``write(2)`` it, for good. Without ``read_only_shares`` it
        checks ``page`` and does nothing, as :meth:`seal_read_only`."""
        raise Unsupported("seal_future_write", f"the {self.name} backend has no read-only "
                          "shares")

    def map_read_only(self, rng: Range, offset: int, pages: Sequence[Page]) -> None:
        """:meth:`map_pages`, readable only: a write through the mapping faults."""
        raise Unsupported("map_read_only", f"the {self.name} backend has no read-only "
                          "shares")

    # ---- mappings -----------------------------------------------------------------
    @abc.abstractmethod
    def map_pages(
        self, rng: Range, offset: int, pages: Sequence[Page], populate: bool = False
    ) -> None:
        """Map ``pages`` at consecutive slots from ``offset``, readable and writable.

        All or nothing: on error no slot of the call stays mapped. ``populate`` faults
        the memory in now so first touches stay off the caller's hot path.
        """

    @abc.abstractmethod
    def unmap(self, rng: Range, offset: int, npages: int = 1) -> None:
        """Unmap ``npages`` mapped slots from ``offset``; the slots stay reserved."""

    def map(self, rng: Range, offset: int, page: Page, populate: bool = False) -> None:
        """Map one page at ``offset`` (see :meth:`map_pages`)."""
        self.map_pages(rng, offset, [page], populate)

    def retain_handle(self, addr: int) -> Page:
        """A new reference (a Page to :meth:`release`) to the page mapped at ``addr``, for
        re-exporting pages a process holds only through mappings. Backends whose
        callers keep page handles (host) do not offer it."""
        raise Unsupported("retain_handle", f"the {self.name} backend keeps page handles; "
                          "it cannot retain one from a mapping")

    def close(self) -> None:
        """Free backend-wide resources; ranges and pages must be given back first."""

    # ---- argument checks shared by the backends -----------------------------------
    def _check_live(self, op: str, page: Page) -> None:
        if not isinstance(page, Page):
            raise InvalidArgument(op, f"expected a Page, got {type(page).__name__}")
        if page.released:
            raise InvalidArgument(op, f"page {page.handle!r} was already released")

    def _check_page(self, op: str, page: Page) -> None:
        """Raise unless ``page`` may be used by ``op`` (backends add their own rules)."""
        self._check_live(op, page)

    def _check_map(self, rng: Range, offset: int, pages: Sequence[Page]) -> list[int]:
        """The slots ``pages`` take from ``offset``; raise before any lock if the range,
        the offset or a page is not valid for ``map_pages``."""
        slots = self._check_slots("map", rng, offset, len(pages))
        for page in pages:
            self._check_page("map", page)
        return slots

    @staticmethod
    def _check_unmapped(rng: Range, slots: Sequence[int]) -> None:
        """Raise unless no slot of ``slots`` is mapped (caller holds ``rng.lock``)."""
        taken = [s for s in slots if s in rng.mapped]
        if taken:
            raise InvalidArgument(
                "map", f"slot offset {taken[0]} of range {rng.base:#x} is already mapped"
            )

    @staticmethod
    def _check_mapped(rng: Range, slots: Sequence[int]) -> None:
        """Raise unless every slot of ``slots`` is mapped (caller holds ``rng.lock``)."""
        missing = [s for s in slots if s not in rng.mapped]
        if missing:
            raise InvalidArgument(
                "unmap", f"slot offset {missing[0]} of range {rng.base:#x} is not mapped"
            )

    def _check_slots(self, op: str, rng: Range, offset: int, npages: int) -> list[int]:
        if not isinstance(rng, Range) or rng.freed or rng.freeing:
            raise InvalidArgument(op, "range is not a live reserved Range")
        if npages <= 0:
            raise InvalidArgument(op, f"npages must be positive, got {npages}")
        if offset < 0 or offset % self.page_size:
            raise InvalidArgument(
                op, f"offset {offset} is not a non-negative multiple of page size {self.page_size}"
            )
        end = offset + npages * self.page_size
        if end > rng.size:
            raise InvalidArgument(
                op, f"[{offset}, {end}) lies outside the range of size {rng.size}"
            )
        return list(range(offset, end, self.page_size))

    def _check_size(self, op: str, nbytes: int) -> None:
        if not isinstance(nbytes, int) or nbytes <= 0 or nbytes % self.page_size:
            raise InvalidArgument(
                op, f"size {nbytes!r} is not a positive multiple of page size {self.page_size}"
            )


def contiguous_runs(offsets: Iterable[int], step: int) -> list[tuple[int, int]]:
    """Group sorted slot offsets into (start, count) runs of adjacent slots."""
    runs: list[tuple[int, int]] = []
    for off in offsets:
        if runs and runs[-1][0] + runs[-1][1] * step == off:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((off, 1))
    return runs
