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

from kvpool.vmm.capabilities import Capabilities
from kvpool.vmm.registry import BACKENDS, REGISTRY, capabilities, device_count, entry


def cuda_available(device: int = 0) -> bool:
    """True when the CUDA driver loads and ``device`` supports VMM with POSIX-fd handles."""
    return REGISTRY.lookup("cuda").available(device)


def open_backend(kind: str = "auto", device: int = 0, page_size: int | None = None,
                 huge_pages: bool = False) -> Backend:
    """Open a backend by name: ``auto``, ``host`` or ``cuda``. ``huge_pages`` backs host
    pages with hugetlb memory (a CUDA page is one mapping already: ignored there)."""
    return entry(kind, device).open(device, page_size, huge_pages)


__all__ = [
    "BACKENDS",
    "Backend",
    "Capabilities",
    "DriverError",
    "InvalidArgument",
    "OutOfMemory",
    "Page",
    "Range",
    "ResourceLimit",
    "Unsupported",
    "VmmError",
    "capabilities",
    "cuda_available",
    "device_count",
    "open_backend",
]
