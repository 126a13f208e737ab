"""The registry of vmm backends: each name maps to its capabilities and a factory that
imports the backend's module only when it is opened (the CUDA one needs cuda-python).

Adding a backend: write a :class:`~kvpool.vmm.base.Backend` subclass with a ``caps``
record, and register one :class:`BackendEntry` here (docs/ARCHITECTURE.md, "Adding a
vmm backend"). ``auto`` is no entry: :func:`entry` resolves it to the first available
one; :data:`BACKENDS` (the choices a configuration or the CLI offers) adds it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpool.registry import Registry
from kvpool.vmm.base import Backend, InvalidArgument
from kvpool.vmm.capabilities import CUDA_CAPS, HOST_CAPS, Capabilities


@dataclass(frozen=True)
class BackendEntry:
    """One backend: its capabilities (known without opening it), whether this machine
    can open it (``available(device)``), and how to open it."""

    name: str
    caps: Capabilities
    available: Callable[[int], bool]
    open: Callable[[int, int | None, bool], Backend]  # (device, page_size, huge_pages)
    count: Callable[[], int] = lambda: 1  # devices this machine has (``--devices all``)


def _host_open(device: int, page_size: int | None, huge_pages: bool) -> Backend:
    from kvpool.vmm.host import HostBackend

    return HostBackend(device=device, page_size=page_size, huge_pages=huge_pages)


def _cuda_open(device: int, page_size: int | None, huge_pages: bool) -> Backend:
    from kvpool.vmm.cuda import CudaBackend

    return CudaBackend(device=device, page_size=page_size)  # one mapping a page already


def _cuda_available(device: int) -> bool:
    try:
        from kvpool.vmm.cuda import probe
    except ImportError:
        return False
    return probe(device) is None


def _cuda_count() -> int:
    try:
        from kvpool.vmm.cuda_driver import device_count
    except ImportError:
        return 0
    return device_count()


#: every backend, in the order ``auto`` tries them (the last is always available)
REGISTRY: Registry[BackendEntry] = Registry("backend")
for _entry in (BackendEntry("cuda", CUDA_CAPS, _cuda_available, _cuda_open, _cuda_count),
               BackendEntry("host", HOST_CAPS, lambda device: True, _host_open)):
    REGISTRY.register(_entry.name, _entry)

#: the backend names a configuration may give: ``auto`` and every registered one
BACKENDS = ("auto", *REGISTRY.names())


def entry(kind: str, device: int = 0) -> BackendEntry:
    """The entry for ``kind`` (``auto``: the first available one); one clear
    InvalidArgument for an unknown name."""
    if kind == "auto":
        return next(e for e in REGISTRY.entries() if e.available(device))
    if kind not in REGISTRY:
        raise InvalidArgument("open_backend", f"unknown backend {kind!r} (one of "
                                              f"{', '.join(BACKENDS)})")
    return REGISTRY.lookup(kind)


def device_count(kind: str) -> int:
    """How many devices backend ``kind`` (``auto``: the first available) sees here
    (host memory is one device)."""
    return entry(kind).count()


def capabilities(kind: str, device: int = 0) -> Capabilities:
    """The capabilities of backend ``kind`` without opening it."""
    return entry(kind, device).caps
