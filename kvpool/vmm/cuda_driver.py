"""The CUDA driver through cuda-python: loading it, calling it, and its errors.

cuda-python is imported lazily, on the first :func:`load_driver`, so this module imports
fine on machines without it or without a driver. Works with cuda-bindings 12.x and 13.x
(``cuda.bindings.driver``) and with cuda-python <= 12.6.0 (``cuda.cuda``).

Every driver error becomes one of the typed errors of :mod:`kvpool.vmm.base`
(``OUT_OF_MEMORY`` -> :class:`OutOfMemory`, ``INVALID_VALUE``/``INVALID_HANDLE`` ->
:class:`InvalidArgument`, ``NOT_SUPPORTED`` -> :class:`Unsupported`, anything else ->
:class:`DriverError` with the code), with a message naming the call and its values
(:func:`call`). :func:`open_device` checks the capabilities the backend needs;
:func:`probe` says in one line why a device cannot be used.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from kvpool.vmm.base import DriverError, InvalidArgument, OutOfMemory, Unsupported, VmmError

# Numeric values are part of the CUDA ABI (cuda.h); kept here so error mapping and
# capability checks do not depend on enum spellings across cuda-python versions.
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_NOT_SUPPORTED = 801

ATTR_COMPUTE_MODE = 20
ATTR_VMM_SUPPORTED = 102
ATTR_POSIX_FD_SUPPORTED = 103
ATTR_GPU_DIRECT_RDMA_WITH_VMM = 110
COMPUTE_MODE_NAMES = {0: "DEFAULT", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}

DRIVER_MODULE: Any = None
_DRIVER_LOCK = threading.Lock()


def load_driver() -> Any:
    """The cuda-python driver module (12.x/13.x layout first, then the <= 12.6 one)."""
    global DRIVER_MODULE
    if DRIVER_MODULE is not None:
        return DRIVER_MODULE
    with _DRIVER_LOCK:
        if DRIVER_MODULE is None:
            try:
                DRIVER_MODULE = importlib.import_module("cuda.bindings.driver")  # >= 12.6.2
            except ImportError:
                try:
                    DRIVER_MODULE = importlib.import_module("cuda.cuda")  # <= 12.6.0
                except ImportError as e:
                    raise Unsupported(
                        "init", f"cuda-python is not installed or unusable ({e})"
                    ) from e
    return DRIVER_MODULE


def error_text(cu: Any, code: int) -> str:
    """``NAME (code): description`` for a CUresult, never raising."""
    name, desc = f"CUDA error {code}", ""
    try:
        err, s = cu.cuGetErrorName(cu.CUresult(code))
        if int(err) == 0 and s:
            name = s.decode() if isinstance(s, bytes) else str(s)
        err, s = cu.cuGetErrorString(cu.CUresult(code))
        if int(err) == 0 and s:
            desc = s.decode() if isinstance(s, bytes) else str(s)
    except Exception:  # unknown code, or the driver is gone: keep the number
        pass
    return f"{name} ({code})" + (f": {desc}" if desc else "")


def typed_error(cu: Any, op: str, shown: str, code: int) -> VmmError:
    """The :class:`VmmError` subclass for CUresult ``code`` of the call ``shown``."""
    msg = f"{shown} failed with {error_text(cu, code)}"
    if code == CUDA_ERROR_OUT_OF_MEMORY:
        return OutOfMemory(op, msg)
    if code in (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_HANDLE):
        return InvalidArgument(op, msg)
    if code == CUDA_ERROR_NOT_SUPPORTED:
        return Unsupported(op, msg)
    return DriverError(op, msg, code)


def call(cu: Any, op: str, fn: str, *args: Any, show: str | None = None) -> Any:
    """Call ``cu.<fn>(*args)`` and return its outputs (None, one value, or a tuple).

    ``show`` is how the call appears in error messages (defaults to ``fn(args)``).
    A missing driver or function (cuda-python raises a ``RuntimeError`` subclass at the
    first call) becomes :class:`Unsupported`.
    """
    try:
        res = getattr(cu, fn)(*args)
    except RuntimeError as e:
        raise Unsupported(op, f"{fn}: the CUDA driver is not usable ({e})") from e
    code = int(res[0])
    if code != CUDA_SUCCESS:
        shown = show or f"{fn}({', '.join(format_arg(a) for a in args)})"
        raise typed_error(cu, op, shown, code)
    if len(res) == 1:
        return None
    if len(res) == 2:
        return res[1]
    return tuple(res[1:])


def format_arg(v: Any) -> str:
    """A driver call's argument as error messages show it (addresses in hex)."""
    if isinstance(v, int) and not isinstance(v, bool) and v > 0xFFFF:
        return hex(v)
    if isinstance(v, (int, float, str, bool)) or v is None:
        return repr(v)
    return type(v).__name__


def open_device(device: int) -> tuple[Any, Any, dict[int, int]]:
    """Load the driver, ``cuInit``, get ``device`` and check the capabilities we need.

    Returns ``(driver module, CUdevice, {attribute: value})``; raises
    :class:`Unsupported` with the reason otherwise.
    """
    cu = load_driver()
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise InvalidArgument("init", f"device must be a non-negative int, got {device!r}")
    try:
        call(cu, "init", "cuInit", 0)
    except VmmError as e:
        if isinstance(e, Unsupported):
            raise
        raise Unsupported("init", f"no usable CUDA driver or device: {e}") from e
    count = call(cu, "init", "cuDeviceGetCount")
    if count == 0:
        raise Unsupported("init", "the CUDA driver reports no devices")
    if device >= count:
        raise Unsupported("init", f"device {device} does not exist ({count} device(s) present)")
    dev = call(cu, "init", "cuDeviceGet", device)
    attrs: dict[int, int] = {}
    for attr in (
        ATTR_VMM_SUPPORTED,
        ATTR_POSIX_FD_SUPPORTED,
        ATTR_COMPUTE_MODE,
        ATTR_GPU_DIRECT_RDMA_WITH_VMM,
    ):
        try:
            attrs[attr] = int(
                call(cu, "init", "cuDeviceGetAttribute", cu.CUdevice_attribute(attr), dev)
            )
        except VmmError:
            if attr == ATTR_GPU_DIRECT_RDMA_WITH_VMM:  # optional: older drivers
                attrs[attr] = 0
            else:
                raise
    if not attrs[ATTR_VMM_SUPPORTED]:
        raise Unsupported(
            "init",
            f"device {device} does not support virtual memory management "
            "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)",
        )
    if not attrs[ATTR_POSIX_FD_SUPPORTED]:
        raise Unsupported(
            "init",
            f"device {device} cannot share memory through POSIX file descriptors "
            "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)",
        )
    mode = attrs[ATTR_COMPUTE_MODE]
    if mode != 0:
        raise Unsupported(
            "init",
            f"device {device} is in compute mode {COMPUTE_MODE_NAMES.get(mode, mode)}; "
            "several processes must share it, so it needs DEFAULT "
            "(nvidia-smi -i <gpu> -c DEFAULT)",
        )
    return cu, dev, attrs


def posix_fd_type(cu: Any) -> Any:
    """The POSIX-file-descriptor shareable handle type, every page's."""
    return cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def allocation_prop(cu: Any, device: int, rdma: bool) -> Any:
    """``CUmemAllocationProp`` of a page: pinned memory on ``device``, shareable as a
    POSIX fd, GPUDirect-RDMA capable when the device supports it with VMM."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = posix_fd_type(cu)
    if rdma:
        prop.allocFlags.gpuDirectRDMACapable = 1
    return prop


def min_granularity(cu: Any, prop: Any) -> int:
    """The driver's minimum allocation granularity for ``prop`` (the smallest page)."""
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(call(cu, "init", "cuMemGetAllocationGranularity", prop, flag))


def access_descs(cu: Any, device: int, read_only: bool = False) -> list[Any]:
    """Read-write (or read-only) access for ``device``: the ``cuMemSetAccess``
    argument. One object per device (never ``[desc] * n``)."""
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    flags = cu.CUmemAccess_flags
    desc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only \
        else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return [desc]


def format_uuid(raw: bytes | str) -> str:
    """A ``CUuuid``'s 16 bytes as ``nvidia-smi -L`` prints them (``GPU-xxxxxxxx-...``);
    some cuda-python versions give a str of 16 chars."""
    data = raw if isinstance(raw, bytes) else bytes(ord(c) & 0xFF for c in raw)
    h = data.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def device_count() -> int:
    """How many devices the CUDA driver reports (0: no driver or none; never raises)."""
    try:
        cu = load_driver()
        call(cu, "init", "cuInit", 0)
        return int(call(cu, "init", "cuDeviceGetCount"))
    except Exception:  # no cuda-python, no driver: no device
        return 0


def probe(device: int = 0) -> str | None:
    """None when the CUDA backend can run on ``device``, else the reason why not.

    Never raises: no cuda-python, no driver, no device, or a missing capability all
    come back as a one-line reason.
    """
    try:
        open_device(device)
    except VmmError as e:
        return str(e)
    except Exception as e:  # anything unexpected from the bindings
        return f"init: {type(e).__name__}: {e}"
    return None
