"""A training step's CUDA allocations carved from kvpool pages: torch's pluggable
allocator interface (``alloc(size, device, stream)`` / ``free(ptr, size, device,
stream)``) as ctypes callbacks over a trainer's step arena, used through a
``torch.cuda.MemPool`` for the step's block (:meth:`Step.cuda_pool`).

``torch.cuda.memory.CUDAPluggableAllocator`` loads the two functions from a shared
library by name; torch builds the allocator from their two addresses
(``torch._C._cuda_customAllocator``), which is what :meth:`PoolAllocator.torch_allocator`
passes, so no compiled library is needed. The callbacks never talk to the daemon: the
step's pages were granted when the step began; an allocation past them returns NULL,
which torch raises as its own out-of-memory error. First fit over page-aligned extents;
a freed extent is reused by the next allocation, and every page goes back at the end of
the step (:meth:`~kvpool.client_lib.arena.Arena.release_all`), once torch has given its
segments back (``torch.cuda.empty_cache``) — a segment still live then is the caller's
bug, refused with :class:`StepLeak` rather than unmapped under a tensor.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

from kvpool.client_lib.arena import Arena

log = logging.getLogger("kvpool.client")

ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                           ctypes.c_void_p)


class StepLeak(RuntimeError):
    """Memory allocated in a step is still live at its end (a tensor kept past it)."""


class PoolAllocator:
    """Allocations in ``[start, end)`` of ``arena``'s mapped pages (a step's; ``start``
    is rounded up to a page)."""

    def __init__(self, arena: Arena, start: int, end: int):
        ps = arena.page_size
        self.arena = arena
        start = -(-start // ps) * ps
        end = min(end, arena.mapped_bytes)
        self.limit = max(0, end - start)
        self.base = arena.group.bases[0]
        #: (offset, size) of the free extents, sorted
        self.free_extents: list[tuple[int, int]] = [(start, self.limit)] if self.limit else []
        self.live: dict[int, int] = {}  # address -> size
        self.refused = 0
        self._lock = threading.Lock()
        self._alloc_cb = ALLOC_FN(self._alloc)
        self._free_cb = FREE_FN(self._free)

    @property
    def live_bytes(self) -> int:
        return sum(self.live.values())

    @property
    def fn_addresses(self) -> tuple[int, int]:
        """The C addresses of ``alloc`` and ``free`` (what torch calls)."""
        a = ctypes.cast(self._alloc_cb, ctypes.c_void_p).value
        f = ctypes.cast(self._free_cb, ctypes.c_void_p).value
        assert a is not None and f is not None
        return a, f

    def _alloc(self, size: int, device: int, stream: Any) -> int | None:
        ps = self.arena.page_size
        need = max(ps, -(-size // ps) * ps)
        with self._lock:
            for i, (off, n) in enumerate(self.free_extents):
                if n >= need:
                    self.free_extents[i] = (off + need, n - need)
                    if self.free_extents[i][1] == 0:
                        del self.free_extents[i]
                    self.live[self.base + off] = need
                    return self.base + off
            self.refused += 1
        log.warning("step memory exhausted: %d bytes asked, %d of %d live", size,
                    self.live_bytes, self.limit)
        return None  # NULL: torch raises its out-of-memory error

    def _free(self, ptr: int | None, size: int, device: int, stream: Any) -> None:
        with self._lock:
            if ptr is None or ptr not in self.live:
                log.error("free of %s, which this step's allocator did not hand out", ptr)
                return
            n = self.live.pop(ptr)
            self.free_extents.append((ptr - self.base, n))
            self.free_extents.sort()
            merged: list[tuple[int, int]] = []
            for off, m in self.free_extents:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + m)
                else:
                    merged.append((off, m))
            self.free_extents = merged

    def torch_allocator(self) -> Any:
        """torch's allocator object over the two callbacks (CUDA builds of torch)."""
        import torch

        a, f = self.fn_addresses
        return torch._C._cuda_customAllocator(a, f)

    def check_released(self) -> None:
        """Raise :class:`StepLeak` when an allocation is still live."""
        if self.live:
            raise StepLeak(f"{self.live_bytes} bytes allocated in the step are still live "
                           "at its end (a tensor made in the step was kept past it); the "
                           "step's pages stay mapped until the process ends")
