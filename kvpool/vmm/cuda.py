"""CUDA backend: the driver VMM API (``cuMemCreate`` / ``cuMemMap`` / ...) via cuda-python.

cuda-python is imported lazily (:mod:`kvpool.vmm.cuda_driver`), on the first use, so
this module imports fine on machines without it or without a driver; nothing else in
kvpool imports cuda-python.

How the protocol maps onto the driver:

* a :class:`~kvpool.vmm.base.Page` is one ``cuMemCreate`` allocation of ``page_size``
  bytes (pinned device memory, ``requestedHandleTypes = POSIX_FILE_DESCRIPTOR``);
  ``Page.handle`` is the ``CUmemGenericAllocationHandle`` as an ``int``;
* a :class:`~kvpool.vmm.base.Range` is a ``cuMemAddressReserve`` reservation;
* ``map_pages`` is ``cuMemMap`` per page and one ``cuMemSetAccess`` per contiguous run;
* ``unmap`` synchronizes the context first (torch does not track streams for foreign
  memory, and ``cuMemUnmap`` does not reliably wait for in-flight kernels), then issues
  one ``cuMemUnmap`` per contiguous run of slots (each run covers whole mappings only);
* ``export`` / ``import_`` use POSIX fds (``cuMemExportToShareableHandle`` /
  ``cuMemImportFromShareableHandle``); the importer's caller closes its fd, because an
  open fd pins the physical memory;
* ``populate`` is accepted and ignored: ``cuMemCreate`` commits physical memory when the
  page is created (there is no lazy first-touch allocation on the device), so a mapped
  page is already "populated";
* ``zero`` maps the page into a private one-page scratch reservation, runs
  ``cuMemsetD8Async`` on a backend-owned stream and synchronizes that stream.
* ``retire`` is ``cuMemRelease``: a page that changes tenant is a new allocation (the
  daemon's pool creates it), never one exported to the previous tenant.
* weight-set pages (``create_sealable_page``) are zeroed allocations; ``map_read_only``
  maps with ``CU_MEM_ACCESS_FLAGS_PROT_READ``; ``seal_read_only`` does nothing to the
  allocation (the driver has no seal: ``caps.read_only_maps`` only, see its doc).

Every driver error becomes a typed :class:`~kvpool.vmm.base.VmmError` naming the call
and its values (:mod:`kvpool.vmm.cuda_driver`, which also loads the driver and checks
the device).

Threads: the primary context of the device is retained once and made current before
every public operation that calls the driver (``cuCtxSetCurrent`` is a thread-local
store in the driver, so this costs about a microsecond), so any thread may call the
backend. Calls on distinct pages and slots may run concurrently; the per-range lock
serializes map/unmap on one range and a backend lock serializes ``zero``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Sequence

from kvpool.vmm import cuda_driver as drv
from kvpool.vmm.capabilities import CUDA_CAPS
from kvpool.vmm.base import Backend, InvalidArgument, Page, Range, VmmError, contiguous_runs
from kvpool.vmm.cuda_driver import probe


class CudaBackend(Backend):
    """Physical pages are ``cuMemCreate`` allocations on ``device`` (see module doc)."""

    name = "cuda"
    caps = CUDA_CAPS

    def __init__(self, device: int = 0, page_size: int | None = None):
        cu, dev, attrs = drv.open_device(device)
        self._cu = cu
        self._dev = dev
        self._closed = False
        self._ctx = drv.call(cu, "init", "cuDevicePrimaryCtxRetain", dev)
        try:
            self._make_current("init")
            self.rdma_capable = bool(attrs[drv.ATTR_GPU_DIRECT_RDMA_WITH_VMM])
            self._prop = drv.allocation_prop(cu, device, self.rdma_capable)
            self._min_page_size = drv.min_granularity(cu, self._prop)
            super().__init__(device, page_size)
            self._access = drv.access_descs(cu, device)
            self._access_ro = drv.access_descs(cu, device, read_only=True)
            # Alignment for reservations: the page size when it is a power of two (so a
            # slot never straddles a larger-page boundary), else the minimum page size.
            ps = self.page_size
            self._align = ps if ps & (ps - 1) == 0 else self._min_page_size
            self._zero_lock = threading.Lock()
            self._stream = None
            self._scratch = None
            self._stream = drv.call(
                cu, "init", "cuStreamCreate", int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
            )
            self._scratch = int(
                drv.call(cu, "init", "cuMemAddressReserve", self.page_size, self._align, 0, 0)
            )
        except BaseException:
            self._teardown()
            raise

    # ---- helpers ------------------------------------------------------------------
    def _posix_fd_type(self) -> Any:
        return drv.posix_fd_type(self._cu)

    def _make_current(self, op: str) -> None:
        if self._closed:
            raise InvalidArgument(op, "the CUDA backend is closed")
        drv.call(self._cu, op, "cuCtxSetCurrent", self._ctx)

    def _driver(self, op: str, fn: str, *args: Any, show: str | None = None) -> Any:
        """``cu.<fn>(*args)`` with its errors typed (:func:`cuda_driver.call`)."""
        return drv.call(self._cu, op, fn, *args, show=show)

    def _synchronize(self, op: str) -> None:
        """Wait for all work in the context (torch's streams included) to finish."""
        self._driver(op, "cuCtxSynchronize")

    def _check_page(self, op: str, page: Page) -> None:
        self._check_live(op, page)
        if page.size != self.page_size:
            raise InvalidArgument(
                op, f"page of {page.size} bytes does not match page size {self.page_size}"
            )

    def _teardown(self) -> None:
        """Destroy what ``__init__`` made (any part of it), ignoring driver errors."""
        undo = [("cuStreamDestroy", (getattr(self, "_stream", None),)),
                ("cuMemAddressFree",
                 (getattr(self, "_scratch", None), getattr(self, "page_size", 0)))]
        if getattr(self, "_ctx", None) is not None:
            undo.append(("cuDevicePrimaryCtxRelease", (self._dev,)))
        for fn, args in undo:
            if args[0] is not None:
                with contextlib.suppress(VmmError):
                    drv.call(self._cu, "close", fn, *args)
        self._stream = self._scratch = self._ctx = None

    # ---- capabilities -------------------------------------------------------------
    def min_page_size(self) -> int:
        """The driver's minimum allocation granularity (``cuMemGetAllocationGranularity``)."""
        return self._min_page_size

    def mem_info(self) -> tuple[int, int]:
        self._make_current("mem_info")
        free, total = self._driver("mem_info", "cuMemGetInfo")
        return int(free), int(total)

    def device_uuid(self) -> str:
        """The device's UUID as ``nvidia-smi -L`` prints it (``GPU-xxxxxxxx-xxxx-...``).

        Ordinals differ between processes under ``CUDA_VISIBLE_DEVICES``; the UUID
        does not, so tenants and the daemon name devices by it.
        """
        self._make_current("device_uuid")
        return drv.format_uuid(self._driver("device_uuid", "cuDeviceGetUuid", self._dev).bytes)

    # ---- virtual ranges -----------------------------------------------------------
    def reserve(self, nbytes: int) -> Range:
        self._check_size("reserve", nbytes)
        self._make_current("reserve")
        base = self._driver(
            "reserve", "cuMemAddressReserve", nbytes, self._align, 0, 0,
            show=f"cuMemAddressReserve(size={nbytes}, alignment={self._align})",
        )
        return Range(base=int(base), size=nbytes, page_size=self.page_size)

    def _free_range(self, rng: Range) -> None:
        self._make_current("free_range")
        with rng.lock:
            slots = sorted(rng.mapped)
            if slots:
                self._synchronize("free_range")
                for start, count in contiguous_runs(slots, self.page_size):
                    size = count * self.page_size
                    self._driver(
                        "free_range", "cuMemUnmap", rng.base + start, size,
                        show=f"cuMemUnmap({rng.base + start:#x}, {size}) (offset {start})",
                    )
                    for i in range(count):
                        del rng.mapped[start + i * self.page_size]
            self._driver(
                "free_range", "cuMemAddressFree", rng.base, rng.size,
                show=f"cuMemAddressFree({rng.base:#x}, {rng.size})",
            )

    # ---- physical pages -----------------------------------------------------------
    def create_page(self) -> Page:
        self._make_current("create_page")
        h = self._driver(
            "create_page", "cuMemCreate", self.page_size, self._prop, 0,
            show=f"cuMemCreate(size={self.page_size}, device={self.device}, "
            f"handle type POSIX_FILE_DESCRIPTOR)",
        )
        return Page(handle=int(h), size=self.page_size)

    def export(self, page: Page) -> int:
        self._check_page("export", page)
        self._make_current("export")
        fd = int(
            self._driver(
                "export", "cuMemExportToShareableHandle", page.handle, self._posix_fd_type(), 0,
                show=f"cuMemExportToShareableHandle(handle={page.handle:#x}, "
                "POSIX_FILE_DESCRIPTOR)",
            )
        )
        try:
            os.set_inheritable(fd, False)  # an fd leaked into a child would pin the page
        except OSError:
            pass
        return fd

    def import_(self, fd: int) -> Page:
        if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
            raise InvalidArgument("import", f"fd must be a non-negative int, got {fd!r}")
        try:
            os.fstat(fd)
        except OSError as e:
            raise InvalidArgument("import", f"fd {fd} is not an open descriptor: {e}") from e
        self._make_current("import")
        h = self._driver(
            "import", "cuMemImportFromShareableHandle", fd, self._posix_fd_type(),
            show=f"cuMemImportFromShareableHandle(fd={fd}, POSIX_FILE_DESCRIPTOR)",
        )
        # The fd carries no size the driver reports; pages are page_size by contract
        # (daemon and tenants agree on it), and cuMemMap rejects a smaller allocation.
        return Page(handle=int(h), size=self.page_size)

    def retain_handle(self, addr: int) -> Page:
        """A new reference (a Page to :meth:`release`) to the page mapped at ``addr``.

        Wraps ``cuMemRetainAllocationHandle``: lets a process re-export pages it only
        holds through mappings (after the daemon restarted, say).
        """
        if not isinstance(addr, int) or addr <= 0:
            raise InvalidArgument("retain_handle", f"address must be a positive int, got {addr!r}")
        self._make_current("retain_handle")
        h = self._driver(
            "retain_handle", "cuMemRetainAllocationHandle", addr,
            show=f"cuMemRetainAllocationHandle({addr:#x})",
        )
        return Page(handle=int(h), size=self.page_size)

    def zero(self, page: Page) -> None:
        self._check_page("zero", page)
        ps, va = self.page_size, self._scratch
        with self._zero_lock:
            self._make_current("zero")
            self._driver(
                "zero", "cuMemMap", va, ps, 0, page.handle, 0,
                show=f"cuMemMap(scratch {va:#x}, {ps}, 0, handle={page.handle:#x})",
            )
            try:
                self._driver(
                    "zero", "cuMemSetAccess", va, ps, self._access, 1,
                    show=f"cuMemSetAccess(scratch {va:#x}, {ps}, READWRITE on device "
                    f"{self.device})",
                )
                self._driver(
                    "zero", "cuMemsetD8Async", va, 0, ps, self._stream,
                    show=f"cuMemsetD8Async(scratch {va:#x}, 0, {ps})",
                )
                self._driver("zero", "cuStreamSynchronize", self._stream)
            finally:
                self._driver(
                    "zero", "cuMemUnmap", va, ps, show=f"cuMemUnmap(scratch {va:#x}, {ps})"
                )

    def release(self, page: Page) -> None:
        self._check_live("release", page)
        self._make_current("release")
        self._driver("release", "cuMemRelease", page.handle, show=f"cuMemRelease({page.handle:#x})")
        page.released = True

    def retire(self, page: Page) -> Page | None:
        """``cuMemRelease``: the daemon's reference goes; the allocation is never handed
        to anyone again (the pool replaces it with a fresh ``cuMemCreate``). A process
        that kept an imported handle or a mapping keeps the physical memory alive, and
        the driver offers no way to see that from here: it shows up only in the device's
        free memory (``mem_info``), so there is no probe (None)."""
        self.release(page)
        return None

    # ---- weight-set pages (``caps.read_only_maps``; no seal: see seal_read_only) -----
    def create_sealable_page(self) -> Page:
        """A ``cuMemCreate`` page like :meth:`create_page`, zeroed (device memory is
        not: the tail of a set's last page must not show anyone's old data). Any
        allocation can be mapped read-only, so nothing else differs."""
        page = self.create_page()
        try:
            self.zero(page)
        except BaseException:
            with contextlib.suppress(VmmError):
                self.release(page)
            raise
        return page

    def import_sealable(self, fd: int) -> Page:
        """:meth:`import_owned` (a weight page is an ordinary allocation here): ``fd``
        is closed on success, since an open one would pin the memory."""
        return self.import_owned(fd)

    def seal_read_only(self, page: Page) -> None:
        """Nothing to do to the allocation: the driver has no seal, so "sealed" on CUDA
        is the daemon's state change alone (the set becomes attachable, and the
        library of every holder maps it ``PROT_READ``). It cannot see, and does not
        refuse, a writable mapping kept somewhere: a holder of the handle may map it
        writable whenever it likes. That is why ``caps.read_only_shares`` is False
        and the daemon shares such a set within its creator's uid only
        (docs/ARCHITECTURE.md, "Weight sets")."""
        self._check_page("seal_read_only", page)

    def seal_future_write(self, page: Page) -> None:
        """Nothing to do, as :meth:`seal_read_only`: a mutable set's readers map it with
        :meth:`map_read_only` (``cuMemSetAccess`` read-only), its writer with
        :meth:`map_pages`; the fence is the daemon's state."""
        self._check_page("seal_future_write", page)

    # ---- mappings -----------------------------------------------------------------
    def map_pages(
        self, rng: Range, offset: int, pages: Sequence[Page], populate: bool = False
    ) -> None:
        # `populate` is a no-op: cuMemCreate commits the physical memory up front.
        self._map(rng, offset, pages, self._access, "READWRITE")

    def map_read_only(self, rng: Range, offset: int, pages: Sequence[Page]) -> None:
        """Map with ``cuMemSetAccess(CU_MEM_ACCESS_FLAGS_PROT_READ)``: a kernel's store
        through the mapping faults. Checked on the libcuda stub (calling conventions)
        and on a GPU by ``tests/test_vmm_cuda.py::test_map_read_only_refuses_writes``
        and ``::test_weight_set_through_a_daemon`` (``scripts/gpu_check.sh``; not yet
        run on a GPU at this writing). Not a seal: whoever holds a page's handle may
        map it writable in its own process, so ``caps.read_only_shares`` stays False
        (``caps.read_only_maps`` is True: enough within one uid)."""
        self._map(rng, offset, pages, self._access_ro, "READ")

    def _map(self, rng: Range, offset: int, pages: Sequence[Page], access: list[Any],
             what: str) -> None:
        slots = self._check_map(rng, offset, pages)
        ps = self.page_size
        self._make_current("map")
        with rng.lock:
            if rng.freed or rng.freeing:
                raise InvalidArgument("map", "range is not a live reserved Range")
            self._check_unmapped(rng, slots)
            done: list[int] = []
            try:
                for slot, page in zip(slots, pages):
                    va = rng.base + slot
                    self._driver(
                        "map", "cuMemMap", va, ps, 0, page.handle, 0,
                        show=f"cuMemMap({va:#x}, {ps}, 0, handle={page.handle:#x}) "
                        f"(offset {slot} of range {rng.base:#x})",
                    )
                    done.append(slot)
                for start, count in contiguous_runs(slots, ps):
                    va, size = rng.base + start, count * ps
                    self._driver(
                        "map", "cuMemSetAccess", va, size, access, 1,
                        show=f"cuMemSetAccess({va:#x}, {size}, {what} on device "
                        f"{self.device}) (offset {start} of range {rng.base:#x})",
                    )
            except BaseException:
                for slot in done:  # roll back: nothing of this call stays mapped
                    try:
                        self._driver("map", "cuMemUnmap", rng.base + slot, ps)
                    except VmmError:
                        pass
                raise
            for slot, page in zip(slots, pages):
                rng.mapped[slot] = page.handle

    def unmap(self, rng: Range, offset: int, npages: int = 1) -> None:
        slots = self._check_slots("unmap", rng, offset, npages)
        ps = self.page_size
        self._make_current("unmap")
        with rng.lock:
            self._check_mapped(rng, slots)
            self._synchronize("unmap")
            # Each slot is its own mapping; one cuMemUnmap may cover several adjacent
            # whole mappings, so unmap per contiguous run.
            for start, count in contiguous_runs(slots, ps):
                va, size = rng.base + start, count * ps
                self._driver(
                    "unmap", "cuMemUnmap", va, size,
                    show=f"cuMemUnmap({va:#x}, {size}) (offset {start} of range {rng.base:#x})",
                )
                for i in range(count):
                    del rng.mapped[start + i * ps]

    def close(self) -> None:
        """Destroy the zeroing stream and scratch range, release the primary context."""
        if self._closed:
            return
        try:
            self._make_current("close")
        except VmmError:
            pass
        self._teardown()
        self._closed = True


__all__ = ["CudaBackend", "probe"]
