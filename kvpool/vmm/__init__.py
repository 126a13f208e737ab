"""Device memory primitives. ``open_backend("auto")`` picks CUDA when a usable device
exists and the host (memfd + mmap) backend otherwise."""

from __future__ import annotations

from kvpool.vmm.base import (
    Backend,
    DriverError,
    InvalidArgument,
    OutOfMemory,
    Page,
    Range,
    ResourceLimit,
    Unsupported,
    VmmError,
)

BACKENDS = ("auto", "host", "cuda")


def cuda_available(device: int = 0) -> bool:
    """True when the CUDA driver loads and ``device`` supports VMM with POSIX-fd handles."""
    try:
        from kvpool.vmm.cuda import probe
    except ImportError:
        return False
    return probe(device) is None


def open_backend(kind: str = "auto", device: int = 0, page_size: int | None = None,
                 huge_pages: bool = False) -> Backend:
    """Open a backend by name: ``auto``, ``host`` or ``cuda``. ``huge_pages`` backs host
    pages with hugetlb memory (a CUDA page is one mapping already: ignored there)."""
    if kind not in BACKENDS:
        raise InvalidArgument("open_backend", f"unknown backend {kind!r}; choose one of {BACKENDS}")
    if kind == "auto":
        kind = "cuda" if cuda_available(device) else "host"
    if kind == "cuda":
        from kvpool.vmm.cuda import CudaBackend

        return CudaBackend(device=device, page_size=page_size)
    from kvpool.vmm.host import HostBackend

    return HostBackend(device=device, page_size=page_size, huge_pages=huge_pages)


__all__ = [
    "BACKENDS",
    "Backend",
    "DriverError",
    "InvalidArgument",
    "OutOfMemory",
    "Page",
    "Range",
    "ResourceLimit",
    "Unsupported",
    "VmmError",
    "cuda_available",
    "open_backend",
]
