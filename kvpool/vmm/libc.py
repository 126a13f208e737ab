"""The libc memory calls of the host backend (``host``, ``hugetlb``), typed once:
``mmap``, ``munmap``, ``madvise``, ``fallocate`` through ctypes with ``errno`` kept
(read it with ``ctypes.get_errno()`` right after a failed call)."""

from __future__ import annotations

import ctypes
import ctypes.util

MAP_FAILED = ctypes.c_void_p(-1).value  # what mmap returns on failure

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.restype = ctypes.c_int
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.fallocate.restype = ctypes.c_int
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
